#!/usr/bin/env bash
# flashprobe's prepared GPU check: one command for a CUDA machine (torch installed, no network).
#
#   scripts/gpu_check.sh OUT_DIR
#
# Runs, in about 8 minutes at most: the gpu-marked tests, `flashprobe bench overhead` forward and
# backward on CUDA (8 layers, N = 2048, d_model 1024, 8 heads of d = 128, bf16 autocast), the
# probe's reference cost per call at B = 2, H = 16, N = 8192, D = 128, a fuzz of the CUDA SDPA
# backends with gradients, and a 50-step study on CUDA. Writes OUT_DIR/gpu_check.json and
# OUT_DIR/gpu_check.md (plus each step's own outputs and logs under OUT_DIR). On a machine without
# CUDA it prints what it would run and exits 0. Exit 1 when a step fails or times out.
set -euo pipefail
if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python}" "$here/gpu_check.py" "$1"
