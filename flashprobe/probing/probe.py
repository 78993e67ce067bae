"""``probe(model)``: shadow every attention call of an unmodified model, per site.

::

    with probe(model, golden=True, backward=True) as p:       # or p = probe(...); ...; p.detach()
        for batch in loader:
            loss = model(batch).sum(); loss.backward(); opt.step()
            if p.step % 100 == 0:
                s = p.summary(); print(s.verdict, s.limit_ratio); p.reset()  # > 1 fails
            p.next_step()

Every attention call made inside ``model`` (caught and named by :mod:`flashprobe.probing.intercept`)
goes through one :class:`~flashprobe.probing.ShadowAttention`; statistics are kept per site (module
path) on the device. ``every_n_calls``, ``every_n_steps`` and ``sites`` sample the calls compared;
the others run only the primary.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping
from typing import Any, NoReturn

import torch
from torch import nn

from flashprobe.probing.call import SdpaCall
from flashprobe.probing.config import ProbeConfig
from flashprobe.probing.direct import LibraryCall
from flashprobe.probing.intercept import AttentionRoute, active_handles
from flashprobe.probing.routing import KernelRoute, model_device_dtype
from flashprobe.probing.shadow import ShadowAttention
from flashprobe.probing.sites import passthrough
from flashprobe.probing.stats import failure_order
from flashprobe.probing.summary import Failure, ProbeSummary

__all__ = ["Probe", "probe"]


class Probe(AttentionRoute):
    """Handle of a probed model (returned by :func:`probe`).

    Attributes:
        model: the probed model (unmodified).
        shadow: the :class:`ShadowAttention` every sampled call goes through (its ``config`` has
            ``backward="auto"`` decided for the model's device).
    """

    kind = "probe"

    def __init__(self, model: nn.Module, shadow: ShadowAttention, config: ProbeConfig | None = None) -> None:
        super().__init__(model)
        self.shadow = shadow
        self._config = shadow.config if config is None else config
        sites = shadow.config.sites or ()
        self._include = tuple(p for p in sites if not p.startswith("!"))
        self._exclude = tuple(p[1:] for p in sites if p.startswith("!"))
        self._selected: dict[str, bool] = {}
        self._calls: dict[str, int] = {}
        self._step = 0

    @property
    def config(self) -> ProbeConfig:
        """The probe's settings as given (``backward="auto"`` stays; see ``shadow.backward``)."""
        return self._config

    @property
    def every_n_calls(self) -> int:
        """Compare every n-th call of each site."""
        return self.shadow.config.every_n_calls

    @property
    def every_n_steps(self) -> int:
        """Compare only when ``step % every_n_steps == 0``."""
        return self.shadow.config.every_n_steps

    # Routing --------------------------------------------------------------------------------

    def attach(self) -> Probe:
        """(Re-)attach; another probe already on the same model pauses until this one detaches."""
        if not self.attached and any(b.kind == "probe" for b in active_handles(self.model)):
            self.warn_once(
                "stacked",
                f"flashprobe: {type(self.model).__name__} already has a probe attached; it pauses "
                "until this one detaches",
            )
        return super().attach()

    def selects(self, site: str) -> bool:
        """Whether the ``sites`` patterns select ``site`` for comparison (decided once per site)."""
        wanted = self._selected.get(site)
        if wanted is None:
            include = not self._include or any(fnmatch.fnmatchcase(site, p) for p in self._include)
            wanted = include and not any(fnmatch.fnmatchcase(site, p) for p in self._exclude)
            self._selected[site] = wanted
        return wanted

    def will_compare(self, site: str) -> bool:
        """Whether the next call at ``site`` is compared (sampling and ``sites``); counts nothing."""
        n = self._calls.get(site, 0)
        return not (n % self.every_n_calls or self._step % self.every_n_steps) and self.selects(site)

    def count_call(self, site: str) -> None:
        """Count a call made at ``site`` that runs without the shadow (not sampled)."""
        self._calls[site] = self._calls.get(site, 0) + 1

    def handle(self, site: str, call: SdpaCall, route: KernelRoute | None = None) -> torch.Tensor:
        """Run one intercepted call made at ``site`` (called by the dispatcher)."""
        compare = self.will_compare(site)
        self.count_call(site)
        if not compare:
            return self.shadow.primary_output(call, route, site=site)
        return self.shadow.run(site, call, route)

    def handle_library(self, site: str, call: LibraryCall) -> Any:
        """Run one intercepted attention library call made at ``site`` (sampled like SDPA calls)."""
        compare = self.will_compare(site)
        self.count_call(site)
        with passthrough():
            if not compare:
                return self.shadow._library_primary(call, None)
            return self.shadow.run_library(site, call)

    def handle_flex(self, site: str, call: Any) -> Any:
        """Run one intercepted ``flex_attention`` call made at ``site`` (sampled like SDPA calls)."""
        compare = self.will_compare(site)
        self.count_call(site)
        if not compare:
            return call.original()
        return self.shadow.run_flex(site, call)

    # Step counter -----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step counter (advanced by the caller; sampling with ``every_n_steps`` reads it)."""
        return self._step

    def set_step(self, step: int) -> None:
        """Set the step counter (e.g. to ``trainer.global_step``)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        self._step = self.shadow.step = step

    def next_step(self) -> int:
        """Advance the step counter by one; returns the new step."""
        self._step += 1
        self.shadow.step = self._step
        return self._step

    @property
    def failures(self) -> list[Failure]:
        """The first failure of each site and direction so far (kept across :meth:`reset`), in step order."""
        return sorted(self.shadow.failures.values(), key=failure_order)

    @property
    def fallbacks(self) -> list[dict[str, Any]]:
        """Where torch's SDPA computed the attention instead of the primary (``fallback=True``: calls
        with attention dropout), ``{site, requested, kernel, from_step, reason}`` each, in step order."""
        return sorted(self.shadow.fallbacks.values(), key=lambda f: (f["from_step"], f["site"]))

    @property
    def judged(self) -> list[dict[str, Any]]:
        """Sites whose verdict judges another computation than the one that trained (attention
        dropout), ``{site, trained, judged, gradients, from_step, reason}`` each, in step order."""
        return sorted(self.shadow.judged.values(), key=lambda j: (j["from_step"], j["site"]))

    # Reading ----------------------------------------------------------------------------------

    @property
    def sites(self) -> list[str]:
        """Sites with recorded statistics, in first-call order."""
        return self.shadow.sites

    @property
    def calls(self) -> dict[str, int]:
        """Intercepted calls per site since attaching (sampled or not)."""
        return dict(self._calls)

    def stat_tensors(self) -> dict[str, torch.Tensor]:
        """Raw per-site accumulators for cross-rank reduction; see :meth:`ShadowAttention.stat_tensors`."""
        return self.shadow.stat_tensors()

    def stats(
        self, tensors: Mapping[str, torch.Tensor] | None = None, *, flat: bool = False
    ) -> dict[str, Any]:
        """Per-site statistics (:meth:`ShadowAttention.stats`); warns once if the model made no call."""
        if not self._calls:
            self.warn_once("no-calls", self._no_calls_message())
        return self.shadow.stats(tensors, flat=flat)

    def summary(self, stats: Mapping[str, Any] | None = None) -> ProbeSummary:
        """The verdict and the worst values over all sites
        (:class:`~flashprobe.formats.probe_summary.ProbeSummary`; its ``to_dict()`` is what
        ``probe.jsonl`` holds) with the step counter, ``notes`` (why values are missing),
        ``dropout_calls``, :attr:`fallbacks` and :attr:`judged`.

        Args:
            stats: per-site statistics to summarise (default: :meth:`stats`).
        """
        stats = self.stats() if stats is None else stats
        summary = self.shadow.summary(stats)
        summary.step = self._step
        summary.dropout_calls = sum(e.get("dropout_calls", 0) for e in stats.values())
        summary.fallbacks = self.fallbacks
        summary.notes = self._notes(stats)
        summary.judged = self.judged or None
        return summary

    def typed_summary(self, stats: Mapping[str, Any] | None = None) -> NoReturn:
        """Replaced by :meth:`summary`, which returns the typed summary; raises naming it."""
        raise AttributeError("Probe.typed_summary() is now Probe.summary(), which returns the ProbeSummary")

    def _no_calls_message(self) -> str:
        return (
            f"flashprobe: {type(self.model).__name__} has made no "
            "torch.nn.functional.scaled_dot_product_attention call since the probe was attached, so "
            "there is nothing to compare. Usual causes: a transformers model loaded with "
            "attn_implementation='eager' (load it with attn_implementation='sdpa'); "
            "nn.MultiheadAttention called with need_weights=True; torch's fused inference fast path "
            "(eval mode under no_grad); a fused kernel flashprobe does not intercept, or a direct "
            "flash-attn/FlashInfer call it could not compare (warned when it ran); or the model has not "
            "run yet"
        )

    def _notes(self, stats: Mapping[str, Any]) -> list[str]:
        notes = []
        if not self._calls:
            notes.append(self._no_calls_message().removeprefix("flashprobe: "))
        dropout = {site: e["dropout_calls"] for site, e in stats.items() if e.get("dropout_calls")}
        sites, calls = ", ".join(sorted(dropout)), sum(dropout.values())
        if dropout and self.shadow.dropout == "skip":
            notes.append(
                f"{calls} calls with attention dropout at {sites} were skipped (dropout='skip'); "
                "dropout='compare' compares their dropout-free primary"
            )
        elif dropout:
            note = f"{calls} calls with attention dropout at {sites}: their forward compares the "
            note += "dropout-free primary"
            if self.shadow.backward:
                note += (
                    "; their backward is not compared (the gradients depend on the random dropout "
                    "mask), so those sites have no dq/dk/dv statistics. Set the attention dropout to "
                    "0 to compare gradients (transformers configs: attention_dropout, attn_pdrop or "
                    "attention_probs_dropout_prob = 0.0; nn.MultiheadAttention: dropout=0.0)"
                )
            notes.append(note)
        return notes

    def reset(self) -> None:
        """Zero the statistics (e.g. after each logging step); the step counter is kept."""
        self.shadow.reset()

    def __repr__(self) -> str:
        return f"Probe({type(self.model).__name__}, {self.shadow.extra_repr()}, attached={self.attached})"


def probe(
    model: nn.Module,
    config: ProbeConfig | None = None,
    /,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    on_failure: str = "warn",
    repro_dir: str | os.PathLike[str] | None = None,
    max_reproducers: int = 8,
    **settings: Any,
) -> Probe:
    """Attach a shadow probe to every attention call made inside ``model``.

    Args:
        model: any ``nn.Module`` (not modified); its attention calls are compared per site.
        config: the settings (:class:`~flashprobe.probing.ProbeConfig`); ``primary=None`` compares
            the kernel the model already uses, so its outputs are exactly unchanged.
        device: device to check the kernels against (default: the model's).
        dtype: compute dtype to check against (default: the model's; pass the autocast dtype under
            autocast).
        on_failure: ``"warn"``, ``"raise"`` or ``"ignore"`` at the first failing call of each site
            and direction (:class:`~flashprobe.probing.ShadowAttention`).
        repro_dir: save reproducers of failing calls there (:mod:`flashprobe.probing.repro`).
        max_reproducers: at most this many reproducer files.
        **settings: fields of :class:`~flashprobe.probing.ProbeConfig` replacing ``config``'s.

    Returns:
        The attached :class:`Probe`; use it as a context manager or call ``.detach()``.

    Warns:
        ProbeWarning: a module's transformers config asks for ``attn_implementation='eager'``.

    Raises:
        ProbeConfigError: an unknown setting or a bad value.
        KernelSpecError: unknown kernel spec or option.
        KernelUnavailableError: a kernel cannot run on the model's device/dtype, or golden on a
            device without float64.
    """
    cfg = ProbeConfig.from_settings(config, **settings)
    dev, dt = model_device_dtype(model, device, dtype)
    shadow = ShadowAttention(
        cfg, device=dev, dtype=dt, on_failure=on_failure, repro_dir=repro_dir, max_reproducers=max_reproducers
    )
    handle = Probe(model, shadow, cfg)
    eager = _eager_attention_site(model)
    if eager is not None:
        where = "" if not eager else f" (its submodule {eager!r})"
        handle.warn_once(
            "eager",
            f"flashprobe: {type(model).__name__}{where} has a transformers config with "
            "attn_implementation='eager', which computes attention with matmuls and makes no "
            "scaled_dot_product_attention call, so the probe has nothing to compare there. Load the "
            "model with attn_implementation='sdpa' (or 'probe_kernel' after "
            "flashprobe.integrations.hf.register_attention())",
        )
    return handle.attach()


def _eager_attention_site(model: nn.Module) -> str | None:
    """Path of the first module whose (duck-typed transformers) config asks for eager attention."""
    for name, module in model.named_modules():
        if getattr(getattr(module, "config", None), "_attn_implementation", None) == "eager":
            return name
    return None
