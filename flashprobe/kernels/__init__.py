"""Attention kernels with the contract they really have, chosen by spec strings.

SDPA's ``kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None)`` on ``(B, H, N, D)`` tensors
is the default contract; a kernel registered with another ``api`` (:mod:`flashprobe.kernels.contract`)
runs an :class:`AttentionCall` through its adapter (:meth:`Kernel.run`). Built in: ``math`` (the
baseline), ``tiled`` (FlashAttention re-implemented at any precision), ``sdpa_flash``,
``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``, ``flex``, ``flash_attn`` and ``flashinfer``.
"""

from flashprobe.kernels._inputs import (
    KernelInputError,
    KernelOutputError,
    causal_mask,
    check_inputs,
    default_scale,
    dtype_name,
    output_problem,
    to_dtype,
)
from flashprobe.kernels.call import AttentionCall, CallOutput
from flashprobe.kernels.contract import APIS
from flashprobe.kernels.flash_attn import flash_attn_attention
from flashprobe.kernels.flash_form import FlashForm, FlashFormCall, flash_form_attention
from flashprobe.kernels.flashinfer import flashinfer_attention
from flashprobe.kernels.flex import flex_attention_kernel
from flashprobe.kernels.math import baseline_call, golden_attention, golden_call, math_attention
from flashprobe.kernels.registry import (
    ANY_CAPABILITIES,
    BACKWARD_MASK_KINDS,
    AttentionFn,
    Kernel,
    KernelAvailability,
    KernelCapabilities,
    KernelInfo,
    KernelSpecError,
    KernelUnavailableError,
    KernelUnsupportedError,
    add_import_option,
    available_kernels,
    get_kernel,
    import_kernel_modules,
    kernel_availability,
    list_kernels,
    mask_kind,
    parse_spec,
    register_kernel,
    unregister_kernel,
)
from flashprobe.kernels.sdpa import BACKENDS, sdpa_attention
from flashprobe.kernels.tiled import (
    DEFAULT_PRESET,
    ORDERS,
    PRESETS,
    UPDATES,
    TileNumerics,
    TileSizes,
    resolve_numerics,
    tile_order,
    tile_sizes,
    tiled_attention,
)

__all__ = [
    "ANY_CAPABILITIES",
    "APIS",
    "BACKENDS",
    "BACKWARD_MASK_KINDS",
    "DEFAULT_PRESET",
    "ORDERS",
    "PRESETS",
    "UPDATES",
    "AttentionCall",
    "AttentionFn",
    "CallOutput",
    "FlashForm",
    "FlashFormCall",
    "Kernel",
    "KernelAvailability",
    "KernelCapabilities",
    "KernelInfo",
    "KernelInputError",
    "KernelOutputError",
    "KernelSpecError",
    "KernelUnavailableError",
    "KernelUnsupportedError",
    "TileNumerics",
    "TileSizes",
    "add_import_option",
    "available_kernels",
    "baseline_call",
    "causal_mask",
    "check_inputs",
    "default_scale",
    "dtype_name",
    "flash_attn_attention",
    "flash_form_attention",
    "flashinfer_attention",
    "flex_attention_kernel",
    "get_kernel",
    "golden_attention",
    "golden_call",
    "import_kernel_modules",
    "kernel_availability",
    "list_kernels",
    "mask_kind",
    "math_attention",
    "output_problem",
    "parse_spec",
    "register_kernel",
    "resolve_numerics",
    "sdpa_attention",
    "tile_order",
    "tile_sizes",
    "tiled_attention",
    "to_dtype",
    "unregister_kernel",
]
