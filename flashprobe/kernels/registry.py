"""Kernel registry and spec strings.

A **spec** names a kernel and its options: ``name[:key=value,...]``, for example ``math``,
``sdpa_flash``, ``tiled:block_q=32,block_k=128,dtype=bfloat16`` or ``tiled:mask_value=-5e4``.
Values are parsed as int, float (``inf``/``-inf``/``1e-3``), bool (``true``/``false``) or string;
each kernel converts them further (dtype names, ...). The same strings work from Python, the CLI
and Hydra configs.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "AttentionFn",
    "Kernel",
    "KernelAvailability",
    "KernelInfo",
    "KernelSpecError",
    "KernelUnavailableError",
    "available_kernels",
    "get_kernel",
    "import_kernel_modules",
    "kernel_availability",
    "list_kernels",
    "parse_spec",
    "register_kernel",
    "unregister_kernel",
]


class AttentionFn(Protocol):
    """The SDPA signature every kernel implements; tensors are ``(B, H, N, D)``."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor: ...


class KernelSpecError(ValueError):
    """A kernel spec string is malformed, names an unknown kernel or an unknown option."""


class KernelUnavailableError(RuntimeError):
    """A kernel cannot run here (missing package, wrong device, unsupported dtype)."""


@dataclass(frozen=True)
class _Entry:
    fn: Callable[..., torch.Tensor]
    description: str
    check: Callable[..., None] | None
    options: tuple[str, ...]
    validate: Callable[..., None] | None = None


_REGISTRY: dict[str, _Entry] = {}


def register_kernel(
    name: str,
    fn: Callable[..., torch.Tensor] | None = None,
    *,
    description: str = "",
    check: Callable[..., None] | None = None,
    validate: Callable[..., None] | None = None,
    overwrite: bool = False,
) -> Any:
    """Register an attention kernel under ``name`` so specs can select it.

    ``fn`` has the SDPA signature ``fn(q, k, v, *, attn_mask=None, is_causal=False, scale=None,
    **options)``; its extra keyword arguments become the spec's options. Usable as a decorator::

        @register_kernel("mine")
        def my_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, block=64): ...

    Args:
        name: the spec name, letters, digits and ``_`` only.
        fn: the kernel function (omit to use as a decorator).
        description: one line shown by ``flashprobe`` listings.
        check: optional ``check(device, dtype, /, **options)`` that raises
            :class:`KernelUnavailableError` when the kernel cannot run there (make ``device`` and
            ``dtype`` positional-only if the kernel has an option of that name).
        validate: optional ``validate(**options)`` that raises ``ValueError`` for bad option
            values; :func:`get_kernel` calls it so a bad spec fails when it is parsed.
        overwrite: replace an existing kernel of that name.

    Returns:
        ``fn`` (or the decorator).

    Raises:
        KernelSpecError: the name is invalid or already taken.
    """

    def decorate(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if not name or not name.replace("_", "").isalnum():
            raise KernelSpecError(f"kernel name {name!r} must be letters, digits and '_'")
        if name in _REGISTRY and not overwrite:
            raise KernelSpecError(f"kernel {name!r} is already registered; pass overwrite=True")
        params = inspect.signature(f).parameters
        base = {"q", "k", "v", "attn_mask", "is_causal", "scale"}
        options = tuple(p for p, prm in params.items() if p not in base and prm.kind == prm.KEYWORD_ONLY)
        doc = description or (inspect.getdoc(f) or "").split("\n")[0]
        _REGISTRY[name] = _Entry(f, doc, check, options, validate)
        return f

    return decorate(fn) if fn is not None else decorate


@dataclass(frozen=True)
class KernelInfo:
    """What the registry knows of one kernel.

    Attributes:
        name: the spec name.
        description: one line.
        options: the spec options it accepts, in signature order.
        builtin: shipped with flashprobe (cannot be unregistered).
    """

    name: str
    description: str
    options: tuple[str, ...]
    builtin: bool


def list_kernels() -> list[KernelInfo]:
    """Every registered kernel, sorted by name."""
    _ensure_builtin()
    return [KernelInfo(n, e.description, e.options, _is_builtin(e)) for n, e in sorted(_REGISTRY.items())]


def _is_builtin(entry: _Entry) -> bool:
    return entry.fn.__module__.startswith("flashprobe.kernels.")


def available_kernels() -> dict[str, str]:
    """Registered kernel names mapped to their one-line descriptions."""
    return {info.name: info.description for info in list_kernels()}


#: the dtypes :func:`kernel_availability` tries, in this order
_AVAILABILITY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class KernelAvailability:
    """Whether a kernel runs on one device, and why not.

    Attributes:
        spec: the kernel spec that was tried.
        device: the device, e.g. ``"cpu"``.
        dtypes: the dtypes it ran at (``"bf16"``, ...); empty when it cannot run there at all.
        reasons: dtype name → why it cannot run at that dtype (the kernel's own message).
    """

    spec: str
    device: str
    dtypes: tuple[str, ...]
    reasons: Mapping[str, str]

    @property
    def available(self) -> bool:
        """True when it runs at one dtype or more."""
        return bool(self.dtypes)

    @property
    def reason(self) -> str:
        """Why it cannot run (at some dtypes); ``""`` when it runs at every dtype tried."""
        distinct = list(dict.fromkeys(self.reasons.values()))
        if len(distinct) == 1 and not self.dtypes:
            return distinct[0]
        return "; ".join(f"{dtype}: {why}" for dtype, why in self.reasons.items())


def kernel_availability(
    spec: str | Kernel,
    device: torch.device | str = "cpu",
    dtypes: tuple[torch.dtype, ...] = _AVAILABILITY_DTYPES,
) -> KernelAvailability:
    """Try a kernel on ``device`` at each dtype: its ``check``, then one tiny call ``(1, 1, 8, 16)``.

    Nothing heavy runs; the tiny call catches what a kernel's ``check`` does not know (a
    missing package imported only when called, a user kernel without a check).

    Args:
        spec: the kernel spec.
        device: where to try it.
        dtypes: the dtypes to try.

    Returns:
        the dtypes it ran at and, for the others, the reason it gave.

    Raises:
        KernelSpecError: the spec is not valid.
    """
    kernel = get_kernel(spec)
    device = torch.device(device)
    ran: list[str] = []
    reasons: dict[str, str] = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        name = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}.get(name, name)
        try:
            kernel.check(device, dtype)
            x = torch.zeros(1, 1, 8, 16, device=device, dtype=dtype)
            kernel(x, x, x)
        except Exception as err:  # any failure means "not here"; its message says why
            unavailable = isinstance(err, KernelUnavailableError)
            reasons[name] = str(err) if unavailable else f"{type(err).__name__}: {err}"
        else:
            ran.append(name)
    return KernelAvailability(kernel.spec, str(device), tuple(ran), reasons)


def import_kernel_modules(modules: Iterable[str]) -> None:
    """Import the modules that register a user's kernels (the ``--import MODULE`` of the CLIs),
    finding modules in the working directory as ``python -m`` does.

    Raises:
        KernelSpecError: a module cannot be imported, naming it and the fix.
    """
    modules = list(modules)
    if modules and "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise KernelSpecError(
                f"--import {module}: {err}; run from the directory that holds it or add that to PYTHONPATH"
            ) from None


def unregister_kernel(name: str) -> None:
    """Remove a kernel registered with :func:`register_kernel`.

    Raises:
        KernelSpecError: no kernel of that name, or a built-in kernel (they cannot be removed).
    """
    _ensure_builtin()
    if name not in _REGISTRY:
        raise KernelSpecError(f"no kernel {name!r} is registered; registered: {', '.join(sorted(_REGISTRY))}")
    if _is_builtin(_REGISTRY[name]):
        raise KernelSpecError(f"kernel {name!r} is built into flashprobe and cannot be unregistered")
    del _REGISTRY[name]


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(low)
    except ValueError:
        pass
    try:
        return float(low)
    except ValueError:
        return text.strip()


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,..."`` into ``(name, options)``.

    Raises:
        KernelSpecError: the spec is malformed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise KernelSpecError(f"kernel spec must be a non-empty string like 'tiled:block_k=64', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    options: dict[str, Any] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise KernelSpecError(
                    f"kernel spec {spec!r}: option {item!r} must look like key=value "
                    "(e.g. 'tiled:block_k=64,dtype=bf16')"
                )
            if key.strip() in options:
                raise KernelSpecError(f"kernel spec {spec!r}: option {key.strip()!r} is given twice")
            options[key.strip()] = _parse_value(value)
    return name.strip(), options


@dataclass(frozen=True)
class Kernel:
    """A registered kernel bound to its options; call it like SDPA.

    Attributes:
        name: registry name (``"tiled"``).
        options: the options from the spec, as parsed.
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> str:
        """The canonical spec string, e.g. ``"tiled:block_k=64"``."""
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.options.items())

    @property
    def fn(self) -> Callable[..., torch.Tensor]:
        return _REGISTRY[self.name].fn

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Run the kernel: q, k, v ``(B, H, N_q|N_k, D|D_v)`` → ``(B, H, N_q, D_v)``."""
        return self.fn(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **self.options)

    def check(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Raise :class:`KernelUnavailableError` if this kernel cannot run on ``device``/``dtype``."""
        entry = _REGISTRY[self.name]
        if entry.check is not None:
            entry.check(torch.device(device), dtype, **self.options)

    def __str__(self) -> str:
        return self.spec


def get_kernel(spec: str | Kernel) -> Kernel:
    """Resolve a spec string (or pass through a :class:`Kernel`).

    Raises:
        KernelSpecError: unknown kernel name or option (naming the allowed ones), or an option
            value the kernel rejects.
    """
    if isinstance(spec, Kernel):
        return spec
    _ensure_builtin()
    name, options = parse_spec(spec)
    if name not in _REGISTRY:
        allowed = ", ".join(sorted(_REGISTRY))
        raise KernelSpecError(
            f"unknown kernel {name!r} in spec {spec!r}; available: {allowed} "
            "(register your own with flashprobe.register_kernel)"
        )
    entry = _REGISTRY[name]
    unknown = [k for k in options if k not in entry.options]
    if unknown:
        allowed = ", ".join(entry.options) or "(none)"
        raise KernelSpecError(
            f"kernel {name!r} has no option {unknown[0]!r} (spec {spec!r}); its options: {allowed}"
        )
    if entry.validate is not None:
        try:
            entry.validate(**options)
        except ValueError as err:
            raise KernelSpecError(f"kernel spec {spec!r}: {err}") from None
    return Kernel(name, options)


_BUILTIN_LOADED = False


def _ensure_builtin() -> None:
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        _BUILTIN_LOADED = True
        from flashprobe.kernels import flash_attn, math, sdpa, tiled  # noqa: F401  (registers)
