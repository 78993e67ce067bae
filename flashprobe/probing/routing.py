"""``use_kernel(model, spec)``: run a model's attention calls with another kernel, no statistics.

A :class:`KernelRoute` runs every intercepted call with the kernel (SDPA's semantics, no host
synchronisation), checked against the model's device and dtype before anything is attached.
"""

from __future__ import annotations

import torch
from torch import nn

from flashprobe.kernels import Kernel, KernelUnavailableError, KernelUnsupportedError, get_kernel
from flashprobe.probing.call import SdpaCall, run_kernel
from flashprobe.probing.intercept import AttentionRoute

__all__ = ["KernelRoute", "check_kernel_here", "model_device_dtype", "use_kernel"]


class KernelRoute(AttentionRoute):
    """Handle returned by :func:`use_kernel`: SDPA calls inside ``model`` run ``kernel``.

    Attributes:
        model: the routed model.
        kernel: the kernel every call is routed to.
    """

    def __init__(self, model: nn.Module, kernel: Kernel) -> None:
        super().__init__(model)
        self.kernel = kernel

    def run(self, call: SdpaCall) -> torch.Tensor:
        """Run one call: the kernel, or torch's SDPA for calls with attention dropout."""
        if call.dropout_p > 0:
            self.warn_once(
                "dropout",
                f"use_kernel({self.kernel.spec!r}): attention calls with dropout_p="
                f"{call.dropout_p} run torch's scaled_dot_product_attention (kernels implement "
                "no attention dropout); set the attention dropout to 0 to route them",
            )
            return call.original()
        return run_kernel(self.kernel, call)

    def __repr__(self) -> str:
        return f"KernelRoute({type(self.model).__name__}, {self.kernel.spec!r}, attached={self.attached})"


def model_device_dtype(
    model: nn.Module, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a model computes in: given values, else its first floating tensor's.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"expected an nn.Module, got {type(model).__name__}; to shadow a bare attention "
            "function use flashprobe.probing.ShadowAttention"
        )
    if device is None or dtype is None:
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                device = t.device if device is None else device
                dtype = t.dtype if dtype is None else dtype
                break
    return torch.device(device if device is not None else "cpu"), dtype or torch.get_default_dtype()


def check_kernel_here(
    kernel: Kernel, device: torch.device, dtype: torch.dtype, role: str, *, backward: bool = False
) -> None:
    """Run ``kernel.check`` on ``device`` and ``dtype`` (and its backward when ``backward``).

    Raises:
        KernelUnavailableError: the kernel cannot run there; the message names ``role`` (``"primary"``,
            ``"baseline"``, ...), the kernel, the feature and the fix (the autocast dtype).
    """
    try:
        kernel.check(device, dtype, backward=backward)
    except KernelUnsupportedError as err:
        raise KernelUnsupportedError(
            f"{role} kernel {kernel.spec!r} on {device} with {dtype}: {err}"
        ) from None
    except KernelUnavailableError as err:
        raise KernelUnavailableError(
            f"{role} kernel {kernel.spec!r} cannot run on {device} with {dtype}: {err} "
            "(if the model runs under autocast, pass dtype=<the autocast dtype>)"
        ) from None


def use_kernel(
    model: nn.Module,
    spec: str | Kernel,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> KernelRoute:
    """Route every ``scaled_dot_product_attention`` call made inside ``model`` to ``spec``, with
    SDPA's semantics and no statistics. Calls with attention dropout run torch's SDPA (warned once).
    Routes stack: the newest applies; detaching it restores the previous one.

    Args:
        model: any ``nn.Module``; it is not modified.
        spec: a kernel spec (``"tiled:mask_value=-5e4"``) or :class:`~flashprobe.kernels.Kernel`.
        device: device to check the kernel against (default: the model's).
        dtype: compute dtype to check against (default: the model's; the autocast dtype under autocast).

    Returns:
        The attached :class:`KernelRoute`; ``.detach()`` it or use it as a context manager.

    Raises:
        KernelSpecError: unknown kernel or option.
        KernelUnavailableError: the kernel cannot run on the model's device/dtype.
    """
    kernel = get_kernel(spec)
    dev, dt = model_device_dtype(model, device, dtype)
    check_kernel_here(kernel, dev, dt, "routed")
    route = KernelRoute(model, kernel)
    route.attach()
    return route
