"""FP8 bug classes, as forward-only E4M3 kernels: used by the fuzzer's and the probe's FP8 tests.

Each is correct FP8 attention (Q, K, V rounded to E4M3 with one amax scale per tensor, attention in
float32) except for one bug a real FP8 kernel can ship: a descale left out (V's values used at their
FP8 scale), Q rotated but not K, K's scale taken from its first rows only (later outlier rows
saturate at 448), the descale of V's last key block left out (FA3's block scales, one per 128 keys:
a tail tile's code path that forgets the descale).
"""

from __future__ import annotations

import torch

from flashprobe.kernels import KernelCapabilities, get_kernel, register_kernel, unregister_kernel
from flashprobe.kernels.fp8 import dequantize, hadamard_rotation, quantize

__all__ = ["FP8_BUGS", "register_fp8_bugs", "unregister_fp8_bugs"]


def fp8_kernel(name, body):
    """Register ``body(q, k, v, mask, causal, scale)`` as a forward-only E4M3 kernel (power-of-two
    head dims, as the rotation needs)."""

    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        with torch.no_grad():
            return body(q, k, v, attn_mask, is_causal, scale).to(q.dtype)

    register_kernel(
        name,
        kernel,
        capabilities=KernelCapabilities(fp8="e4m3", backward_devices=frozenset()),
        overwrite=True,
    )
    return name


def _math(q, k, v, mask, causal, scale):
    return get_kernel("math:dtype=float32")(
        q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal, scale=scale
    )


def _q(x):
    return dequantize(x, "e4m3", scaling="tensor", scale="amax", block=1)


#: FP8 bug classes: a descale left out (V's values used at their FP8 scale), Q rotated but not K,
#: K quantized with a scale from its first rows only (later outlier rows saturate at 448), V's last
#: block of 128 keys not descaled.
def _no_v_descale(q, k, v, mask, causal, scale):
    amax = v.float().abs().amax()
    return _math(_q(q), _q(k), _q(v) * (448.0 / amax), mask, causal, scale)


def _rotate_q_only(q, k, v, mask, causal, scale):
    m = hadamard_rotation(q.shape[-1], 0, dtype=torch.float32)
    return _math(_q(q.float() @ m), _q(k), _q(v), mask, causal, scale)


def _first_rows_scale(q, k, v, mask, causal, scale):
    kf = k.float()
    s = 448.0 / kf[..., :4, :].abs().amax().clamp(min=1e-6)
    k8 = (kf * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s
    return _math(_q(q), k8, _q(v), mask, causal, scale)


def _tail_v_no_descale(q, k, v, mask, causal, scale):
    values, descale = quantize(v, "e4m3", scaling="block", block=128)  # (B, H, N_k, D_v), (B, H, N_k, 1)
    last = (v.shape[-2] - 1) // 128 * 128  # the first key of the last block
    descale = descale.clone()
    descale[..., last:, :] = 1.0  # the tail tile's values at their FP8 scale
    return _math(_q(q), _q(k), values * descale, mask, causal, scale)


#: name → kernel body ``(q, k, v, mask, causal, scale) -> out``
FP8_BUGS = {
    "fp8_bug_no_v_descale": _no_v_descale,
    "fp8_bug_rotate_q_only": _rotate_q_only,
    "fp8_bug_first_rows_scale": _first_rows_scale,
    "fp8_bug_tail_v_no_descale": _tail_v_no_descale,
}


def register_fp8_bugs() -> list[str]:
    """Register every :data:`FP8_BUGS` kernel; returns the names."""
    return [fp8_kernel(name, body) for name, body in FP8_BUGS.items()]


def unregister_fp8_bugs() -> None:
    for name in FP8_BUGS:
        unregister_kernel(name)
