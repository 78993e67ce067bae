"""The library layers import without the application: the probe, the kernels, the weights and the
deviation statistics pull in neither Lightning, Hydra, W&B nor transformers, nor the app's
modules (checked in a fresh interpreter, so nothing imported by other tests hides a leak)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("lightning", "hydra", "wandb", "transformers", "diffusers", "flashprobe.t2i", "flashprobe.app")
LAYERS = (
    "flashprobe",
    "flashprobe.deviation",
    "flashprobe.kernels",
    "flashprobe.probing",
    "flashprobe.weights",
)


def test_library_layers_do_not_import_the_app() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {LAYERS!r}:\n"
        "    importlib.import_module(name)\n"
        f"    leaked = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "    if leaked:\n"
        "        sys.exit(f'importing {name} imported {leaked}')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
