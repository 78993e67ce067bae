"""``ProbeConfig``: every setting of the shadow probe, with one name, one default and one check.

:func:`~flashprobe.probing.probe`, :class:`~flashprobe.probing.ShadowAttention`, the training callbacks
and the Hydra config (``attention.probe``, schema stored by :func:`register_schema`) all take these
settings and validate them here::

    cfg = ProbeConfig(backward=True, every_n_steps=10)
    probe(model, cfg)                      # or probe(model, backward=True, every_n_steps=10)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from flashprobe.errors import FlashprobeError
from flashprobe.judge import fp8_baseline
from flashprobe.kernels import Kernel, get_kernel

__all__ = ["DROPOUT_POLICIES", "ProbeConfig", "ProbeConfigError", "register_schema"]

#: What to do with calls that use attention dropout.
DROPOUT_POLICIES = ("compare", "skip")


#: The config :meth:`ProbeConfig.resolve_backward` is copying (its kernels are not resolved again).
_COPYING: ContextVar[ProbeConfig | None] = ContextVar("flashprobe_probe_config_copying", default=None)


class ProbeConfigError(ValueError, FlashprobeError):
    """A probe setting has a value it cannot take; the message names the setting and the fix."""


def _int_at_least(name: str, value: Any, low: int, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ProbeConfigError(f"{name}={value!r} must be an int >= {low} ({example})")


def _strict_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ProbeConfigError(f"{name}={value!r} must be true or false")


def _sites(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if isinstance(items, Sequence) and not isinstance(items, str):
        items = list(items)
        if items and all(isinstance(s, str) and s.strip("!") for s in items):
            return tuple(items)
    raise ProbeConfigError(
        f"sites={value!r}: give glob patterns of site names, e.g. 'blocks.*.attn' or "
        "['blocks.*', '!blocks.0.*'] ('!' excludes), or null for every site"
    )


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """What the shadow probe compares, how, and when.

    Raises:
        ProbeConfigError: a value out of range or of the wrong type, naming the setting.
        KernelSpecError: an unknown kernel spec or option (``primary``, ``baseline``).
    """

    primary: Any = None
    """Kernel spec (or :class:`~flashprobe.kernels.Kernel`) whose output the model receives; None: the
    kernel the model already uses, so its outputs are exactly unchanged."""
    baseline: Any = "math"
    """Kernel spec of the baseline, computed at the primary's dtype on the same inputs (an FP8 primary
    gets ``math:fp8=<format>`` in place of ``math`` and that format's limits)."""
    golden: bool = True
    """Also compute the FP64 golden value (the golden pairs and the error ratio)."""
    backward: bool | str = "auto"
    """Also compare ``dq, dk, dv`` for the model's own output gradient: ``True``, ``False``, or
    ``"auto"``: where the primary and the baseline have a backward on the model's device (decided at
    attach time)."""
    every_n_calls: int = 1
    """Compare every n-th call of each site (others run the primary only)."""
    every_n_steps: int = 1
    """Compare only at steps that are multiples of n (the step counter the caller advances)."""
    sites: Any = None
    """Glob patterns of site names to compare (``"!pattern"`` excludes); None: every site."""
    dropout: str = "compare"
    """Calls with attention dropout: ``compare`` their dropout-free primary, or ``skip`` them."""
    fallback: bool = False
    """A call the primary cannot run (attention dropout): ``False`` refuses it, naming the fix; ``True``
    runs torch's SDPA for it and records the fallback (summary, manifest, ``run.json``)."""
    memory_budget: int | None = None
    """Bytes one reference block may use; None: a quarter of the device's free memory."""

    def __post_init__(self) -> None:
        source = _COPYING.get()
        if source is None:
            self._resolve_kernels()
        else:  # resolve_backward's copy: the same kernels
            object.__setattr__(self, "_kernels", source._kernels)
            object.__setattr__(self, "_precision", source._precision)
        _strict_bool("golden", self.golden)
        _strict_bool("fallback", self.fallback)
        if self.backward != "auto":
            _strict_bool("backward", self.backward)
        _int_at_least("every_n_calls", self.every_n_calls, 1, "1 = every call")
        _int_at_least("every_n_steps", self.every_n_steps, 1, "1 = every step")
        object.__setattr__(self, "sites", _sites(self.sites))
        if self.dropout not in DROPOUT_POLICIES:
            raise ProbeConfigError(f"dropout={self.dropout!r}: use one of {', '.join(DROPOUT_POLICIES)}")
        if self.memory_budget is not None:
            _int_at_least("memory_budget", self.memory_budget, 1, "bytes, e.g. 1073741824 = 1 GiB")

    def _resolve_kernels(self) -> None:
        """Resolve ``primary`` and ``baseline`` once, and an FP8 primary's baseline and precision."""
        kernels: dict[str, Kernel] = {}
        for name in ("primary", "baseline"):
            value = getattr(self, name)
            if value is None and name == "primary":
                continue
            if not isinstance(value, str | Kernel):
                raise ProbeConfigError(
                    f"{name}={value!r} must be a kernel spec such as 'math' or 'sdpa_flash' "
                    "(`flashprobe kernels` lists them)" + (" or None" if name == "primary" else "")
                )
            kernels[name] = get_kernel(value)  # unknown kernels and options fail here
        precision = None
        if self.primary is not None:  # an FP8 primary's baseline is the FP8 one
            baseline, precision = fp8_baseline(kernels["primary"], kernels["baseline"])
            if baseline is not kernels["baseline"]:
                object.__setattr__(self, "baseline", baseline)
                kernels["baseline"] = get_kernel(baseline)
        object.__setattr__(self, "_kernels", kernels)
        object.__setattr__(self, "_precision", precision)

    @property
    def primary_kernel(self) -> Kernel | None:
        """The primary resolved (None: the model's own attention)."""
        return self._kernels.get("primary")

    @property
    def baseline_kernel(self) -> Kernel:
        """The baseline resolved."""
        return self._kernels["baseline"]

    @property
    def precision(self) -> torch.dtype | None:
        """The FP8 dtype whose limits judge the primary (an FP8 kernel), or None: the call's dtype."""
        return self._precision

    def resolve_backward(self, device: torch.device | str) -> ProbeConfig:
        """This config with ``backward="auto"`` decided for ``device`` (its kernels not resolved again)."""
        if self.backward != "auto":
            return self
        backward = all(k.capabilities.has_backward(device) for k in self._kernels.values())
        token = _COPYING.set(self)
        try:
            return dataclasses.replace(self, backward=backward)
        finally:
            _COPYING.reset(token)

    @classmethod
    def from_settings(cls, config: ProbeConfig | None = None, /, **settings: Any) -> ProbeConfig:
        """``config`` (default: the defaults) with ``settings`` replacing its fields.

        Raises:
            ProbeConfigError: a name that is not a setting (the message lists them), or a bad value.
        """
        if config is not None and not isinstance(config, ProbeConfig):
            raise ProbeConfigError(f"expected a ProbeConfig, got {type(config).__name__}")
        unknown = sorted(set(settings) - set(setting_names()))
        if unknown:
            names = ", ".join(setting_names())
            raise ProbeConfigError(f"unknown probe setting(s) {', '.join(unknown)}; the settings are {names}")
        if config is None:
            return cls(**settings)
        return dataclasses.replace(config, **settings) if settings else config

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, ignore: Sequence[str] = ()) -> ProbeConfig:
        """A config from a mapping (e.g. Hydra's ``attention.probe``), leaving out the keys ``ignore``."""
        return cls.from_settings(**{k: v for k, v in values.items() if k not in ignore})

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data (kernels as their spec strings)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Kernel):
                value = value.spec
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def setting_names() -> tuple[str, ...]:
    """The names of :class:`ProbeConfig`'s settings, in declaration order."""
    return tuple(f.name for f in fields(ProbeConfig))


def register_schema() -> None:
    """Store the Hydra schema of ``attention.probe`` (``flashprobe_probe_schema``): the settings with
    their defaults plus ``enabled``. Typed ``Any`` so :class:`ProbeConfig` checks the values, as in
    Python; the schema makes an unknown key an error when the config is composed."""
    from hydra.core.config_store import ConfigStore

    spec = [(f.name, Any, field(default=f.default)) for f in fields(ProbeConfig)]
    spec.append(("enabled", Any, field(default=True)))
    schema = dataclasses.make_dataclass("ProbeSchema", spec, kw_only=True)
    ConfigStore.instance().store(name="flashprobe_probe_schema", node=schema)
