"""``ShadowAttention``: the primary kernel's output, with the baseline and golden alongside.

The **primary** kernel's output goes to the model untouched. On detached copies of the inputs (in the
primary's compute dtype) the **baseline** kernel and, with ``golden=True``, the FP64 **golden** value
are computed and their deviations folded into per-site :class:`DeviationStats` on the device, without
host synchronisation. With ``backward=True`` an identity autograd function (:class:`_GradTap`) hands the
primary's ``dq, dk, dv`` to the comparison and passes them on unchanged. References run in blocks
planned by :mod:`flashprobe.kernels.reference` within ``memory_budget`` (default: a quarter of the free
device memory), with IEEE float32 matmuls. Gradient statistics are divided by the loss scale
(:meth:`ShadowAttention.set_grad_scale`). The probe draws no random numbers and changes no autocast
state; a failing reference computation is counted (``shadow_errors``) and warned about, never raised.
Calls with attention dropout are compared on their dropout-free primary (``dropout="compare"``) or
skipped (``dropout="skip"``), forward only.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashprobe.bias import BIAS_FIELDS, BiasStats
from flashprobe.deviation import SUM_ROWS, StatsWorkspace, combine_sums, pair_sums, reads_are_free
from flashprobe.errors import FlashprobeError
from flashprobe.formats.jsonio import flatten
from flashprobe.formats.reproducer import kernel_module, reproducer_stem, save_reproducer
from flashprobe.judge import CRITERIA, call_statistics, reason, row_statistics
from flashprobe.kernels import KernelUnavailableError, KernelUnsupportedError
from flashprobe.kernels.call import AttentionCall, convert_lse
from flashprobe.kernels.flash_form import flash_form_attention
from flashprobe.kernels.math import plain_attention
from flashprobe.kernels.reference import (
    Block,
    GroupGradients,
    expand_kv,
    numerics_flags,
    plan_blocks,
    reference_budget,
    reference_gradients,
    reference_outputs,
)
from flashprobe.probing.call import Prepared, SdpaCall, autocast_off, prepare, run_kernel
from flashprobe.probing.config import ProbeConfig
from flashprobe.probing.direct import LibraryCall, prepare_call
from flashprobe.probing.flex import flex_reference
from flashprobe.probing.routing import KernelRoute, check_kernel_here
from flashprobe.probing.sites import GRAPH_BREAK_REASON, ProbeWarning, passthrough
from flashprobe.probing.stats import (
    DIRECTIONS,
    LSE_CRITERIA,
    DeviationStats,
    site_directions,
    stats_dict,
)
from flashprobe.probing.summary import Failure, ProbeSummary, add_failure_log, summarize

__all__ = ["ON_FAILURE", "ProbeFailureError", "ShadowAttention"]

#: What the probe does at a call's first failure per site and direction.
ON_FAILURE: tuple[str, ...] = ("warn", "raise", "ignore")


class ProbeFailureError(RuntimeError, FlashprobeError):
    """Raised with ``on_failure="raise"`` at the first failing call (message: site, direction, step,
    reason, reproducer)."""

    def __init__(self, message: str, failure: Failure) -> None:
        super().__init__(message)
        self.failure = failure


#: Per row of :func:`~flashprobe.deviation.pair_sums`, the power of the loss scale it carries:
#: maxima and sums of |d| and |ref| (1), sums of squares (2), counts (0).
_POWERS = dict(max_abs=1, sum_abs=1, sum_sq_diff=2, sum_sq_ref=2, nonfinite=0, count=0, max_ref=1)
_SCALE_POWERS = tuple(_POWERS[row] for row in SUM_ROWS)


class _GradTap(torch.autograd.Function):
    """Identity on the primary's inputs; its backward hands their gradients to a record."""

    @staticmethod
    def forward(ctx: Any, record: _BackwardRecord, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.record = record
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.record.on_input_grads(grads)
        return (None, *grads)


class _BackwardRecord:
    """What the comparison of one call needs until its backward runs.

    The forward comparison waits for the backward, so each reference runs forward once for both. If
    the backward never comes, a finalizer queues the forward comparison (:meth:`ShadowAttention._drain`).
    """

    def __init__(
        self,
        shadow: ShadowAttention,
        site: str,
        prepared: Prepared,
        logical: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.shadow = shadow
        self.site = site
        self.logical = logical  # a library's output gradient ("out") and q/k/v gradients → logical form
        self.step = shadow.step  # the step of the forward, recorded with a failure in the backward
        self.prepared = prepared  # detached, compute dtype, 4-D
        self.names: tuple[str, ...] = ()
        self.grad_out: torch.Tensor | None = None
        self.out: torch.Tensor | None = None  # the primary's output, kept for the forward comparison
        self._finalizer: weakref.finalize | None = None

    def keep_output(self, out: torch.Tensor) -> None:
        """Keep a copy of the primary's output (the model may change its own in place)."""
        self.out = out.detach().clone()
        self._finalizer = weakref.finalize(
            self, self.shadow._orphans.append, (self.site, self.prepared, self.out, self.step)
        )

    def take_output(self) -> torch.Tensor | None:
        """The kept output, once (the backward compares it; the finalizer then has nothing to do)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        out, self.out = self.out, None
        return out

    def tap(self, call: SdpaCall) -> SdpaCall:
        tensors = self.tap_tensors({"q": call.query, "k": call.key, "v": call.value})
        return call.replace(query=tensors["q"], key=tensors["k"], value=tensors["v"])

    def tap_tensors(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``q``, ``k``, ``v`` through the tap (those that require grad): their gradients come here."""
        found = dict(tensors)
        self.names = tuple(n for n, t in found.items() if t.requires_grad)
        tapped = _GradTap.apply(self, *(found[n] for n in self.names))
        found.update(zip(self.names, tapped, strict=True))
        return found

    def on_grad_out(self, grad: torch.Tensor) -> None:
        self.grad_out = grad.detach()

    def on_input_grads(self, grads: Iterable[torch.Tensor | None]) -> None:
        grad_out, self.grad_out = self.grad_out, None
        out = self.take_output()
        if grad_out is None:  # no gradient reached the output: forward comparison only
            if out is not None:
                self.shadow._compare_forward(self.site, None, out, self.prepared, step=self.step)
            return
        primary = {n: g.detach() for n, g in zip(self.names, grads, strict=True) if g is not None}
        if self.logical is not None:
            grad_out = self.logical("out", grad_out)
            primary = {n: self.logical(n, g) for n, g in primary.items()}
        self.shadow._compare_backward(self, grad_out, primary, out)


class ShadowAttention(nn.Module):
    """Drop-in for ``F.scaled_dot_product_attention`` that shadows the primary kernel.

    ``forward`` takes SDPA's arguments and returns the primary's output unchanged, recording its
    deviations from the references per site (module docstring). Use it inside your own attention
    module, or let :func:`flashprobe.probing.probe` route a whole model through one. It has no
    parameters or buffers.

    Args:
        config: the probe's settings (:class:`~flashprobe.probing.ProbeConfig`; default: its defaults).
        record: keep statistics; ``False`` computes the references and throws them away (the
            overhead control of ``flashprobe bench overhead``).
        name: site name used when called directly.
        device: if given, check the kernels against this device (and ``dtype``, default float32) now.
        on_failure: at the first failing call of a site and direction: ``"warn"`` (one
            :class:`~flashprobe.probing.ProbeWarning`), ``"raise"`` (:class:`ProbeFailureError`) or
            ``"ignore"``. On the CPU each call's verdict is read at once; on an accelerator a failure
            is seen when the statistics are read, and the site is then *armed*: its next failing call
            is read at once and saved as the reproducer.
        repro_dir: directory for reproducers of failing calls (None: none are saved).
        max_reproducers: at most this many reproducer files per shadow.
        **settings: fields of :class:`~flashprobe.probing.ProbeConfig` replacing ``config``'s.

    Raises:
        ProbeConfigError: an unknown setting or a bad value.
        KernelSpecError: unknown kernel or option.
        KernelUnavailableError: ``device`` given and a kernel cannot run there.
    """

    def __init__(
        self,
        config: ProbeConfig | None = None,
        /,
        *,
        record: bool = True,
        name: str = "attention",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        on_failure: str = "warn",
        repro_dir: str | os.PathLike[str] | None = None,
        max_reproducers: int = 8,
        **settings: Any,
    ) -> None:
        super().__init__()
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure={on_failure!r} must be one of {', '.join(map(repr, ON_FAILURE))}")
        if isinstance(max_reproducers, bool) or not isinstance(max_reproducers, int) or max_reproducers < 0:
            raise ValueError(f"max_reproducers={max_reproducers!r} must be an int >= 0 (0: save none)")
        if repro_dir is not None and (not str(repro_dir) or Path(repro_dir).is_file()):
            raise ValueError(f"repro_dir={str(repro_dir)!r} must be a directory path (not empty, not a file)")
        self.on_failure = on_failure
        self.repro_dir = None if repro_dir is None else Path(repro_dir)
        self.max_reproducers = max_reproducers
        self.step = 0
        #: ``{(site, direction): failure}``: the first failure of each, kept on the host across resets.
        self.failures: dict[tuple[str, str], Failure] = {}
        self.reproducers: list[Path] = []
        #: ``{site: fallback}``: where torch's SDPA ran instead of the primary (``fallback=True``).
        self.fallbacks: dict[str, dict[str, Any]] = {}
        #: ``{site: note}``: sites whose verdict judges another computation than the one that trained.
        self.judged: dict[str, dict[str, Any]] = {}
        self._armed: set[str] = set()
        self.config = ProbeConfig.from_settings(config, **settings)
        if device is not None:  # backward="auto": decided by the kernels' capabilities there
            self.config = self.config.resolve_backward(device)
        cfg = self.config
        self.primary = cfg.primary_kernel  # resolved once, when the config was built
        self.baseline = cfg.baseline_kernel
        self.record = bool(record)
        self.name = name
        if device is not None:
            self.check(torch.device(device), dtype or torch.float32)
        self._stats: dict[str, DeviationStats] = {}
        #: ``{site: bias sums}`` restored from a checkpoint, added when the site is first recorded.
        self._restored_bias: dict[str, list[float]] = {}
        self._errors: dict[str, int] = {}
        self._dropout_calls: dict[str, int] = {}
        self._warned: set[Any] = set()
        self._workspace = StatsWorkspace()
        self._plans: dict[tuple[Any, ...], list[Block]] = {}
        self._budgets: dict[torch.device, int] = {}
        self._grad_scale: Callable[[], torch.Tensor | float | None] | None = None
        # Forward comparisons of calls whose backward never came (appended by finalizers).
        self._orphans: collections.deque[tuple[str, Prepared, torch.Tensor, int]] = collections.deque()

    @property
    def golden(self) -> bool:
        """Whether the FP64 golden value is computed."""
        return self.config.golden

    @property
    def backward(self) -> bool:
        """Whether gradients are compared (``"auto"`` not decided for a device: no)."""
        return self.config.backward is True

    @property
    def dropout(self) -> str:
        """The policy for calls with attention dropout."""
        return self.config.dropout

    def set_grad_scale(self, scale: Callable[[], torch.Tensor | float | None] | None) -> None:
        """Give the probe the loss scale of the backward passes it compares (``GradScaler``).

        Args:
            scale: called at each compared backward; returns the scale the output gradient carries
                (a 0-d tensor, read without a host sync, or a float, or None); ``None``: no scaling.
        """
        self._grad_scale = scale

    def numerics(self) -> dict[str, Any]:
        """The training's matmul precision flags; the references always run IEEE float32 matmuls."""
        return {**numerics_flags(), "references_fp32_matmul": "ieee"}

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise :class:`KernelUnavailableError` if a kernel cannot run on ``device``/``dtype``."""
        if self.primary is not None:
            check_kernel_here(self.primary, device, dtype, "primary", backward=self.backward)
        check_kernel_here(self.baseline, device, dtype, "baseline", backward=self.backward)
        if self.golden and device.type == "mps":
            raise KernelUnavailableError(
                "golden attention needs float64, which MPS devices do not support; pass golden=False"
            )

    def extra_repr(self) -> str:
        primary = "torch SDPA" if self.primary is None else self.primary.spec
        return (
            f"primary={primary!r}, baseline={self.baseline.spec!r}, golden={self.golden}, "
            f"backward={self.backward}"
        )

    def _plan(self, p: Prepared, backward: bool) -> list[Block]:
        """The reference blocks of a call of ``p``'s shape (planned once per shape)."""
        mask_key = None if p.attn_mask is None else tuple(p.attn_mask.shape)
        key = (tuple(p.q.shape), tuple(p.k.shape), tuple(p.v.shape), mask_key, p.is_causal, backward)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_blocks(
                p.q.shape,
                p.k.shape,
                p.v.shape,
                is_causal=p.is_causal,
                backward=backward,
                budget=self._budget(p.q.device),
            )
        return plan

    def _joins(self, elements: int, bytes_per_element: int, device: torch.device) -> bool:
        """Whether ``elements`` output elements of ``bytes_per_element`` fit the block budget."""
        return elements * bytes_per_element <= self._budget(device)

    def _budget(self, device: torch.device) -> int:
        """Bytes a reference block may use on ``device`` (``memory_budget``, else read once)."""
        budget = self.config.memory_budget
        if budget is None:
            budget = self._budgets.get(device)
            if budget is None:
                budget = self._budgets[device] = reference_budget(device)
        return budget

    # --- Calls ---

    @torch.compiler.disable(reason=GRAPH_BREAK_REASON)
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """SDPA's signature; returns the primary's ``(..., N_q, D_v)`` output (a graph break
        under ``torch.compile``)."""
        call = SdpaCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        with passthrough():
            return self.run(self.name, call)

    def primary_output(
        self, call: SdpaCall, route: KernelRoute | None = None, *, site: str | None = None
    ) -> torch.Tensor:
        """The output the model receives: the primary kernel, else ``route``'s, else torch's SDPA.

        Raises:
            KernelUnsupportedError: a call with ``dropout_p > 0`` and ``fallback=False`` (with
                ``fallback=True`` torch's SDPA runs it, recorded in :attr:`fallbacks`).
        """
        if self.primary is None:
            return call.original() if route is None else route.run(call)
        if call.dropout_p > 0:
            self._fall_back(site or self.name, call.dropout_p)
            return call.original()
        return run_kernel(self.primary, call)

    def _fall_back(self, site: str, dropout_p: float, kernel: str = "torch sdpa") -> None:
        """Refuse a dropout call for the primary, or record that ``kernel`` runs it."""
        assert self.primary is not None
        spec = self.primary.spec
        if not self.config.fallback:
            raise KernelUnsupportedError(dropout_refusal(f"site {site!r}", dropout_p, spec))
        if site not in self.fallbacks:
            who = "torch's SDPA" if kernel == "torch sdpa" else kernel
            self.fallbacks[site] = {
                "site": site,
                "requested": spec,
                "kernel": kernel,
                "from_step": self.step,
                "reason": f"attention dropout (dropout_p={dropout_p}): {spec!r} implements none, so "
                f"{who} computed the attention at {site} from step {self.step} (fallback=True)",
            }
            self._warn_once(("dropout-primary", site), f"flashprobe: {self.fallbacks[site]['reason']}")

    def run(self, site: str, call: SdpaCall, route: KernelRoute | None = None) -> torch.Tensor:
        """Run one call at ``site``: return the primary's output, record the comparison."""
        self._drain()
        if self.record:  # sites are listed in the order of their first call
            self._site(site, call.query.device)
        if call.dropout_p > 0:
            return self._run_dropout(site, call, route)
        tensors = (call.query, call.key, call.value)
        record = None
        if self.backward and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            try:
                record = _BackwardRecord(self, site, prepare(call.detached()))
            except Exception as err:
                self._failed(site, err)
        out = self.primary_output(call if record is None else record.tap(call), route, site=site)
        if record is not None and out.requires_grad:
            out.register_hook(record.on_grad_out)
            record.keep_output(out)
        else:
            self._compare_forward(site, call, out, None if record is None else record.prepared)
        return out

    def run_flex(self, site: str, call: Any) -> Any:
        """Run one ``flex_attention`` call (:class:`~flashprobe.probing.flex.FlexCall`) at ``site``:
        return its own output, compare it forward."""
        self._drain()
        out = call.original()
        primary = out[0] if isinstance(out, tuple) else out
        device = primary.device
        if self.record:
            self._site(site, device)
        try:
            with passthrough(), torch.no_grad():
                budget = self._budget(device)
                base = flex_reference(call, primary.dtype, budget=budget)
                gold = flex_reference(call, torch.float64, budget=budget) if self.golden else None
                if self.record:
                    sums = pair_sums(primary.detach(), base, gold, self._workspace)
                    rows = None if gold is None else {"out": row_statistics(primary.detach(), base, gold)}
                    stats = self._stats[site]
                    if gold is not None:
                        stats.bias.add("out", primary.detach(), gold, base)
                    kinds = stats.add_many({"out": sums}, primary.dtype, self.step, rows)
                    stats.add_nonfinite_inputs(
                        dict(zip("qkv", (call.query, call.key, call.value), strict=True))
                    )
                    self._after_call(site, self.step, kinds, None, None)
        except Exception as err:
            self._failed(site, err)
        return out

    def run_library(self, site: str, lib: LibraryCall) -> Any:
        """Run one attention library call at ``site``: return the library's result (the primary's,
        in the library's form, when one is set); compare its output, LSE and gradients."""
        self._drain()
        if self.record:
            self._site(site, lib.call.q.device)
        try:
            p = prepare_call(lib)  # before the library runs: a KV-cache call appends in place
        except Exception as err:
            self._failed(site, err)
            return lib.run(None, None)
        if (p.terms is not None or p.lse_base is not None) and self.baseline.spec != "math":
            self._warn_once(
                ("baseline-terms", site),
                f"flashprobe: the {lib.what} call at site {site!r} has terms beyond SDPA's (lengths, "
                f"windows, bottom-right causal, softcap, ALiBi, sinks or an LSE), which the baseline "
                f"{self.baseline.spec!r} cannot take; it runs unchanged and is not compared (use "
                "baseline='math')",
            )
            return lib.run(None, None)
        if lib.dropout_p > 0:
            return self._run_library_dropout(site, lib, p)
        record = None
        wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in lib.tensors.values())
        if self.backward and lib.differentiable and wants_grad:
            record = _BackwardRecord(self, site, p, logical=_logical_grads(lib.call))
        returned = self._library_primary(lib, None if record is None else record.tap_tensors(lib.tensors))
        try:
            found = lib.outputs(returned)
        except Exception as err:
            self._failed(site, err)
            return returned
        raw = returned[0] if isinstance(returned, tuple | list) else returned
        # (an LSE with a gradient of its own would take part in the backward: not compared then)
        lse_grad = found.lse is not None and found.lse.requires_grad
        if record is not None and isinstance(raw, torch.Tensor) and raw.requires_grad and not lse_grad:
            raw.register_hook(record.on_grad_out)
            if found.lse is None:  # compared with the gradients, from the same reference passes
                record.keep_output(found.out)
                return returned
        self._compare_forward(site, None, found.out, p, lse=found.lse)
        return returned

    def _library_primary(self, lib: LibraryCall, tensors: Mapping[str, torch.Tensor] | None) -> Any:
        """The library's return on ``tensors`` (None: the caller's), or the primary's, in its form."""
        if self.primary is None:
            return lib.run(tensors, None if tensors is None else 0.0)
        call = lib.call
        if tensors is not None:
            call = call.replace(q=tensors["q"], k=tensors["k"], v=tensors["v"])
        return call.q_from_logical(self.primary.run(call).out.to(call.out_dtype))

    def _run_library_dropout(self, site: str, lib: LibraryCall, p: Prepared) -> Any:
        """A library call with dropout: the model gets the library's result; the dropout-free call is
        compared forward and noted in :attr:`judged`."""
        if self.primary is not None:
            self._fall_back(site, lib.dropout_p, kernel=lib.what)
        returned = lib.run(None, None)
        who = lib.what if self.primary is None else repr(self.primary.spec)
        if not self._dropout_policy(site, lib.dropout_p, f"{lib.what} with dropout_p={lib.dropout_p}", who):
            return returned
        try:
            with torch.no_grad():
                plain = self._library_primary(lib, {n: t.detach() for n, t in lib.tensors.items()})
                found = lib.outputs(plain)
        except Exception as err:
            self._failed(site, err)
            return returned
        self._compare_forward(site, None, found.out, p, lse=found.lse)
        return returned

    def _dropout_policy(self, site: str, dropout_p: float, trained: str, judged: str) -> bool:
        """Count and warn once about a dropout call, note it in :attr:`judged`; whether to compare it."""
        self._dropout_calls[site] = self._dropout_calls.get(site, 0) + 1
        if self.dropout == "skip":
            what = "skipping these calls (dropout='skip')"
        else:
            what = (
                "comparing the dropout-free primary instead (one extra primary call, no random numbers "
                "drawn, forward only); pass dropout='skip' to skip"
            )
        self._warn_once(
            ("dropout", site),
            f"flashprobe: site {site!r} uses attention dropout (dropout_p={dropout_p}), which "
            f"cannot be compared exactly; {what}",
        )
        if self.dropout == "skip":
            return False
        if site not in self.judged:
            unchecked = "; its gradients went unchecked" if self.backward else ""
            self.judged[site] = {
                "site": site,
                "trained": trained,
                "judged": f"{judged} without dropout",
                "gradients": "unchecked" if self.backward else "not compared (backward=False)",
                "from_step": self.step,
                "reason": f"attention dropout at {site}: training ran {trained}; the verdict judges "
                f"{judged} without dropout on the same inputs, forward only{unchecked}",
            }
        return True

    def _drain(self) -> None:
        """Run the forward comparisons of calls whose backward never came."""
        while self._orphans:
            site, prepared, out, step = self._orphans.popleft()
            self._compare_forward(site, None, out, prepared, step=step)

    def _run_dropout(self, site: str, call: SdpaCall, route: KernelRoute | None) -> torch.Tensor:
        out = self.primary_output(call, route, site=site)
        backend = _sdpa_backend(call)
        torch_sdpa = "torch SDPA" + ("" if backend is None else f" ({backend.name} backend)")
        trained = f"{torch_sdpa} with dropout_p={call.dropout_p}"
        judged = (
            torch_sdpa
            if self.primary is None and route is None
            else repr((self.primary or route.kernel).spec)
        )
        if not self._dropout_policy(site, call.dropout_p, trained, judged):
            if self.record:
                self._site(site, out.device)  # the site shows in stats() with its dropout_calls
            return out
        plain = call.replace(dropout_p=0.0)
        try:
            # torch's own SDPA is judged on the backend that trained (it picks another without dropout)
            chosen = sdpa_kernel(backend) if backend is not None and judged == torch_sdpa else nullcontext()
            with torch.no_grad(), chosen:
                reference = self.primary_output(plain.detached(), route, site=site)
        except Exception as err:
            self._failed(site, err)
            return out
        self._compare_forward(site, plain, reference)
        return out

    # --- Comparisons ---

    def _call_args(self, p: Prepared) -> dict[str, Any]:
        args = {"attn_mask": p.attn_mask, "is_causal": p.is_causal, "scale": p.scale}
        if p.terms is not None:
            args["terms"] = p.terms
        return args

    def _baseline_fn(self, p: Prepared) -> Callable[..., Any]:
        """The configured baseline, or plain attention for a call with terms beyond SDPA's."""
        return self.baseline if p.terms is None and p.lse_base is None else plain_attention

    def _compare_forward(
        self,
        site: str,
        call: SdpaCall | None,
        out: torch.Tensor,
        prepared: Prepared | None = None,
        step: int | None = None,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Compare the primary's output ``out`` (and its LSE ``(B, H, N_q)``, in ``prepared.lse_base``,
        where it returned one) with the references (``prepared``, else ``call``'s)."""
        step = self.step if step is None else step
        try:
            # Prepared before autocast is switched off: the compute dtype is the autocast dtype.
            if prepared is None:
                assert call is not None
                prepared = prepare(call.detached())
            p = prepared
            with passthrough(), torch.no_grad(), autocast_off(out.device.type):
                out4 = out.detach().reshape(p.out_shape)
                plan = self._plan(p, backward=False)
                args = self._call_args(p)
                want = lse is not None and p.lse_base is not None and self.record
                base = reference_outputs(self._baseline_fn(p), p.q, p.k, p.v, blocks=plan, lse=want, **args)
                gold = (
                    reference_outputs(
                        plain_attention, p.q, p.k, p.v, blocks=plan, dtype=torch.float64, lse=want, **args
                    )
                    if self.golden
                    else itertools.repeat((None, None))
                )
                lses: list[torch.Tensor | None] = [None, None]  # the baseline's and the golden's LSE
                # blocks that fit the budget are gathered and compared once, as one call
                gather = self.record and len(plan) > 1 and self._joins(out4.numel(), 24, out4.device)
                found: tuple[dict[str, Any], ...] = ({}, {}, {})  # sums, rows, noise
                bias = self._site(site, out.device).bias if self.record else None
                whole = None
                for (blk, b), (_, g) in zip(base, gold, strict=False):  # gold: repeat(None) without golden
                    if want:
                        (b, b_lse), (g, g_lse) = b, (g if g is not None else (None, None))
                        for i, part in enumerate((b_lse, g_lse)):
                            if part is not None:
                                if lses[i] is None:
                                    lses[i] = part.new_empty(p.out_shape[:3])
                                lses[i][blk.batch, blk.q_heads(p.rep), blk.rows] = part
                    if gather:
                        if whole is None:
                            whole = (b.new_empty(out4.shape), None if g is None else g.new_empty(out4.shape))
                        blk.take_q(whole[0], p.rep).copy_(b)
                        if g is not None and whole[1] is not None:
                            blk.take_q(whole[1], p.rep).copy_(g)
                    elif self.record:
                        self._fold(found, "out", blk.take_q(out4, p.rep), b, g, bias=bias)
                if whole is not None:
                    self._fold(found, "out", out4, *whole, bias=bias)
                sums, rows = found[0].get("out"), found[1].get("out")
                if self.record and sums is not None:
                    stats = self._site(site, out.device)
                    worst = None if rows is None else {"out": rows}
                    kinds = stats.add_many({"out": sums}, p.dtype, step, worst)
                    stats.add_nonfinite_inputs(dict(zip("qkv", p[:3], strict=True)))
                    if want and lses[1] is not None:
                        kinds = self._fold_lse(stats, lse, lses[0], lses[1], p, step, kinds)
                    self._after_call(site, step, kinds, p, None)
        except Exception as err:
            self._failed(site, err)

    def _fold_lse(
        self,
        stats: DeviationStats,
        lse: torch.Tensor,
        base: torch.Tensor | None,
        gold: torch.Tensor,
        p: Prepared,
        step: int,
        kinds: tuple[tuple[str, ...], torch.Tensor],
    ) -> tuple[tuple[str, ...], torch.Tensor]:
        """Fold the primary's LSE ``(B, H, N_q)`` (in ``p.lse_base``) into ``stats``'s ``lse``
        direction; ``kinds`` with its code added."""
        rows = None if p.terms is None or p.terms.q_lens is None else p.terms.q_lens.long()
        refs = []
        for x in (base if base is not None else gold, gold):
            if rows is not None:  # padding rows are no rows (a sink would see them)
                at = torch.arange(x.shape[-1], device=x.device)[None, None, :]
                x = x.masked_fill(at >= rows[:, None, None], float("-inf"))
            refs.append(convert_lse(x, "e", p.lse_base))
        code = stats.add_lse(lse, refs[0], refs[1], p.dtype, step)
        return (*kinds[0], "lse"), torch.cat((kinds[1], code.reshape(1)))

    def _fold(
        self,
        found: tuple[dict[str, Any], ...],
        d: str,
        mine: torch.Tensor,
        base: torch.Tensor,
        gold: torch.Tensor | None,
        form: torch.Tensor | None = None,
        *,
        bias: BiasStats | None = None,
    ) -> None:
        """Fold one block's statistics of direction ``d`` into ``found`` (pair sums, row statistics,
        flash-form noise; gradients in the model's units) and its signed bias into ``bias``."""
        sums, rows, noise = found
        if gold is None:
            part, row, form_noise, finite = pair_sums(mine, base, None, self._workspace), None, None, False
        else:
            part, row, form_noise, finite = call_statistics(mine, base, gold, self._workspace, form=form)
        sums[d] = combine_sums(sums.get(d), part if d == "out" else self._unscale(part))
        rows[d] = _worst(rows.get(d), row)
        if form_noise is not None:
            noise[d] = self._noise(noise.get(d), form_noise)
        if bias is not None and gold is not None:
            bias.add(d, mine, gold, base, finite=finite)

    def _compare_backward(
        self,
        record: _BackwardRecord,
        grad_out: torch.Tensor,
        primary: Mapping[str, torch.Tensor],
        out: torch.Tensor | None = None,
    ) -> None:
        """Compare the primary's gradients (and, when ``out`` is given, its forward output) with the
        references', all from one forward and backward pass of each reference."""
        site = record.site
        try:
            p = record.prepared
            with passthrough(), autocast_off(grad_out.device.type):
                names = tuple(n for n in ("q", "k", "v") if n in primary)
                mine = {n: primary[n].reshape(getattr(p, n).shape) for n in names}
                grad_out = grad_out.reshape(p.out_shape)
                out4 = None if out is None else out.reshape(p.out_shape)
                stats = self._site(site, grad_out.device) if self.record else None
                sums, rows, noise = self._gradient_sums(p, grad_out, mine, out4, stats)
                if stats is not None:
                    inputs = {"grad_out": grad_out}
                    if out4 is not None and sums["out"] is not None:
                        inputs.update(zip("qkv", p[:3], strict=True))
                    found = {d: s for d, s in sums.items() if s is not None}
                    worst = {d: r for d, r in rows.items() if r is not None}
                    forms = {d: r for d, r in noise.items() if r is not None}
                    kinds = stats.add_many(found, p.dtype, record.step, worst, forms)
                    stats.add_nonfinite_inputs(inputs)
                    self._after_call(site, record.step, kinds, p, grad_out)
        except Exception as err:
            self._failed(site, err)

    def _loss_scale(self, device: torch.device) -> torch.Tensor | None:
        """The loss scale of the backward being compared, a 0-d float64 tensor on ``device`` (None: none)."""
        scale = None if self._grad_scale is None else self._grad_scale()
        if scale is None:
            return None
        return torch.as_tensor(scale, dtype=torch.float64, device=device).reshape(())

    def _unscale(self, sums: torch.Tensor) -> torch.Tensor:
        """Gradient pair sums in the model's units: divided by the loss scale's power per row."""
        s = self._loss_scale(sums.device)
        if s is None:
            return sums
        powers = torch.tensor(_SCALE_POWERS, dtype=torch.float64, device=sums.device).unsqueeze(1)
        return sums / s.pow(powers)

    def _gradient_sums(
        self,
        p: Prepared,
        grad_out: torch.Tensor,
        mine: Mapping[str, torch.Tensor],
        out: torch.Tensor | None = None,
        stats: DeviationStats | None = None,
    ) -> tuple[dict[str, torch.Tensor | None], ...]:
        """Pair sums, row statistics and flash-form noise per direction (``dq``/``dk``/``dv``, and
        ``out`` when the primary's ``(B, H, N_q, D_v)`` output ``out`` is given) of the primary's
        gradients ``mine`` against the references' for ``grad_out``, over all blocks; adds the signed
        bias to ``stats.bias``. The flash form is a second baseline: flash kernels take
        ``rowsum(dO∘O)`` from the rounded output, which autograd through the baseline does not."""
        names = tuple(mine)
        directions = tuple(f"d{n}" for n in names)
        sums: dict[str, torch.Tensor | None] = dict.fromkeys((*directions, "out"))
        rows: dict[str, torch.Tensor | None] = dict.fromkeys((*directions, "out"))
        noise: dict[str, torch.Tensor | None] = dict.fromkeys(directions)
        found = (sums, rows, noise)
        plan = self._plan(p, backward=True)
        args = {**self._call_args(p), "need": names, "blocks": plan}
        base = reference_gradients(self._baseline_fn(p), p.q, p.k, p.v, grad_out, dtype=p.dtype, **args)
        gold = (
            reference_gradients(plain_attention, p.q, p.k, p.v, grad_out, dtype=torch.float64, **args)
            if self.golden
            else itertools.repeat(None)
        )
        # the flash form takes lengths, windows and ALiBi as a mask; not softcap or sinks
        form = p.terms is None or not (p.terms.softcap or p.terms.sinks is not None)
        flash = (
            reference_gradients(_flash_form_terms, p.q, p.k, p.v, grad_out, dtype=p.dtype, **args)
            if self.golden and form
            else itertools.repeat(None)
        )
        bias = None if stats is None else stats.bias
        for bg, gg, fg in zip(base, gold, flash, strict=False):  # gold, flash: repeat(None) without golden
            if not self.record:
                continue
            # A group's row blocks whose outputs fit the budget are compared as one (as the forward).
            if len(bg.blocks) > 1 and self._joins(sum(o.numel() for o in bg.outs), 48, grad_out.device):
                bg, gg, fg = (None if x is None else _rows_as_one(x) for x in (bg, gg, fg))
                assert bg is not None
            with torch.no_grad():
                for i, blk in enumerate(bg.blocks):
                    if out is not None:
                        g_out = gg.outs[i] if gg else None
                        self._fold(found, "out", blk.take_q(out, p.rep), bg.outs[i], g_out, bias=bias)
                    if "q" in names:
                        q_refs = (bg.dq[i], gg.dq[i] if gg else None, fg.dq[i] if fg else None)
                        self._fold(found, "dq", blk.take_q(mine["q"], p.rep), *q_refs, bias=bias)
                first = bg.blocks[0]
                for n in ("k", "v"):
                    if n in names:
                        refs = (getattr(x, f"d{n}") if x else None for x in (bg, gg, fg))
                        self._fold(found, f"d{n}", mine[n][first.batch, first.heads], *refs, bias=bias)
        return sums, rows, noise

    def _noise(self, total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
        """Fold one block's flash-form gradient noise into ``total``, in the model's units."""
        if part is None:
            return total
        s = self._loss_scale(part.device)
        if s is not None:
            part = part / torch.stack((s * s, s.new_ones(())))
        return part if total is None else torch.stack((total[0] + part[0], torch.maximum(total[1], part[1])))

    # --- Failures: seen, saved, reported ---

    def _after_call(
        self,
        site: str,
        step: int,
        kinds: tuple[tuple[str, ...], torch.Tensor],
        p: Prepared | None,
        grad_out: torch.Tensor | None,
    ) -> None:
        """Read this call's verdicts (``kinds`` of :meth:`DeviationStats.add_many`) where that is free
        (CPU) or the site is armed; act on new failures."""
        directions, codes_tensor = kinds
        if not self.golden or not directions:
            return
        if not reads_are_free(codes_tensor.device) and site not in self._armed:
            return
        # the read: free on the CPU; elsewhere made for armed sites only
        codes = dict(zip(directions, codes_tensor.tolist(), strict=True))
        failing = [d for d, code in codes.items() if code > 0]  # < 0: undetermined
        new = [d for d in failing if (site, d) not in self.failures]
        if new:
            self._new_failures(site, step, {d: int(codes[d]) for d in new})
        unsaved = [self.failures[(site, d)] for d in failing if not self._has_repro(site, d)]
        if unsaved:
            self._save_repro(unsaved, p, grad_out)
        for d in new:
            self._react(self.failures[(site, d)])
        if site in self._armed and all(self._has_repro(s, d) for s, d in self.failures if s == site):
            self._armed.discard(site)

    def _new_failures(self, site: str, step: int, codes: Mapping[str, int]) -> None:
        """Record the first failures of ``site``'s directions at this call (their values: one read)."""
        entries = site_directions(self._stats[site].as_dict())
        for direction, code in codes.items():
            first = entries[direction].get("first_failure") or {}
            same = first.get("step") == step
            kind = first["kind"] if same else LSE_CRITERIA.get(code) or CRITERIA.get(code, "relative")
            value = first.get("value", float("nan")) if same else float("nan")
            limit = first.get("limit", float("nan")) if same else float("nan")
            self.failures[(site, direction)] = Failure(
                site=site,
                direction=direction,
                step=step,
                kind=kind,
                value=value,
                limit=limit,
                reason=first["reason"] if same else reason(kind, value, limit, self.config.precision),
            )

    def _has_repro(self, site: str, direction: str) -> bool:
        failure = self.failures.get((site, direction))
        return failure is not None and (failure.repro is not None or self.repro_dir is None)

    def _save_repro(
        self, failures: list[Failure], p: Prepared | None, grad_out: torch.Tensor | None
    ) -> None:
        """Save the failing SDPA-shaped call ``p`` (and ``grad_out``) as one reproducer for ``failures``."""
        if p is None or self.repro_dir is None or len(self.reproducers) >= self.max_reproducers:
            return  # (p is None: a FlexAttention call, whose score_mod is code, not data)
        if p.terms is not None or p.lse_base is not None:
            return
        first = failures[0]
        path = self.repro_dir / (reproducer_stem(first.site, first.step) + ".safetensors")
        try:
            save_reproducer(
                path,
                q=p.q,
                k=p.k,
                v=p.v,
                attn_mask=p.attn_mask,
                is_causal=p.is_causal,
                scale=p.scale,
                grad_out=grad_out,
                meta={
                    **{k: getattr(first, k) for k in ("site", "direction", "step", "kind", "reason")},
                    "directions": [f.direction for f in failures],
                    "reasons": {f.direction: f.reason for f in failures},
                    "primary": None if self.primary is None else self.primary.spec,
                    "kernel_module": kernel_module(self.primary),
                    "baseline": self.baseline.spec,
                    "gqa_rep": p.rep,
                },
            )
        except OSError as err:
            self._warn_once(
                ("repro", str(self.repro_dir)),
                f"flashprobe: could not save a reproducer in {self.repro_dir}: {err}",
            )
            return
        for failure in failures:
            failure.repro = str(path)
        self.reproducers.append(path)

    def _react(self, failure: Failure) -> None:
        message = failure_message(failure)
        if self.on_failure == "raise":
            raise ProbeFailureError(message, failure)
        if self.on_failure == "warn":
            warnings.warn(message, ProbeWarning, stacklevel=2)

    def _note_read(self, stats: Mapping[str, Any]) -> None:
        """Record the failures a read of the accumulators shows; arm their sites."""
        for site, entry in stats.items():
            for direction, e in site_directions(entry).items():
                first = e.get("first_failure")
                if not first:
                    continue
                known = self.failures.get((site, direction))
                if known is not None and known.step <= first["step"]:
                    continue
                failure = Failure(site=site, direction=direction, **first)
                if known is not None:
                    failure.repro = known.repro
                self.failures[(site, direction)] = failure
                if known is None:
                    self._react(failure)
                if not self._has_repro(site, direction):
                    self._armed.add(site)

    # --- Bookkeeping and reading ---

    def _site(self, site: str, device: torch.device) -> DeviationStats:
        stats = self._stats.get(site)
        if stats is None:
            stats = self._stats[site] = DeviationStats(
                device, golden=self.golden, precision=self.config.precision
            )
            restored = self._restored_bias.pop(site, None)
            if restored is not None:
                bias = stats.bias.state
                bias += torch.tensor(restored, dtype=bias.dtype, device=bias.device).view_as(bias)
        return stats

    def bias_state(self) -> dict[str, list[float]]:
        """This process's signed-bias sums per site, for a checkpoint (:meth:`restore_bias`)."""
        self._drain()
        sites = {s: v.bias.state.flatten().tolist() for s, v in self._stats.items()}
        return {**self._restored_bias, **sites}

    def restore_bias(self, state: Mapping[str, Sequence[float]]) -> None:
        """Continue a run's signed bias from :meth:`bias_state`.

        Raises:
            ValueError: a site's sums are not ``4 · 2 · 3`` numbers.
        """
        size = len(DIRECTIONS) * len(BIAS_FIELDS)
        for site, sums in state.items():
            if len(sums) != size:
                raise ValueError(
                    f"restore_bias: site {site!r} has {len(sums)} bias sums, expected {size} "
                    "(from ShadowAttention.bias_state())"
                )
        for site, sums in state.items():
            if site in self._stats:
                bias = self._stats[site].bias.state
                bias.copy_(torch.tensor(list(sums), dtype=bias.dtype, device=bias.device).view_as(bias))
            else:
                self._restored_bias[site] = [float(x) for x in sums]

    def _failed(self, site: str, err: BaseException) -> None:
        """Count and warn once about a failed shadow computation; re-raise a :class:`ProbeFailureError`."""
        if isinstance(err, ProbeFailureError):
            raise err
        self._errors[site] = self._errors.get(site, 0) + 1
        self._warn_once(
            ("error", site),
            f"flashprobe: the shadow computation at site {site!r} failed and was skipped "
            f"({type(err).__name__}: {err}); the model's output is unaffected. Further failures at "
            "this site are counted in stats()[site]['shadow_errors']",
        )

    def _warn_once(self, key: Any, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, ProbeWarning, stacklevel=4)

    @property
    def sites(self) -> list[str]:
        """Sites with recorded statistics, in the order they were first recorded."""
        return list(self._stats)

    def stat_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the raw per-site accumulators (:mod:`flashprobe.probing.stats`), e.g. to
        :func:`~flashprobe.probing.stats.reduce_across_ranks` and pass to :meth:`stats`."""
        self._drain()
        return {site: s.values.clone() for site, s in self._stats.items()}

    def stats(
        self, tensors: Mapping[str, torch.Tensor] | None = None, *, flat: bool = False
    ) -> dict[str, Any]:
        """Per-site statistics as plain Python data (one host copy for all sites).

        Args:
            tensors: accumulators to read instead of this shadow's own.
            flat: flatten to ``"out.primary_golden.max_abs"``-style keys.

        Returns:
            ``{site: {"forward": ..., "backward": ..., "nonfinite_inputs": ...,
            "shadow_errors": n, "dropout_calls": n}}``; see :func:`flashprobe.probing.stats.stats_dict`.
        """
        self._drain()
        source = {s: v.values for s, v in self._stats.items()} if tensors is None else dict(tensors)
        if not source:
            return {}
        device = next(iter(source.values())).device
        rows = torch.stack([t.detach().to(device, torch.float64) for t in source.values()]).tolist()
        nested: dict[str, Any] = {}
        for site, values in zip(source, rows, strict=True):
            entry = stats_dict(values, golden=self.golden, precision=self.config.precision)
            entry["shadow_errors"] = self._errors.get(site, 0)
            entry["dropout_calls"] = self._dropout_calls.get(site, 0)
            entry["verdict"], entry["verdict_reason"] = site_verdict(entry, golden=self.golden)
            nested[site] = entry
        if self.record:
            self._note_read(nested)
        return {site: flatten(entry) for site, entry in nested.items()} if flat else nested

    def summary(self, stats: Mapping[str, Any] | None = None) -> ProbeSummary:
        """The verdict and the worst values over all sites (:func:`~flashprobe.probing.summarize`) with
        the failures of earlier intervals (:attr:`failures`).

        Args:
            stats: per-site statistics to summarise (default: :meth:`stats`).
        """
        return add_failure_log(summarize(self.stats() if stats is None else stats), self.failures)

    def reset(self) -> None:
        """Zero every site's statistics (on device, no sync); sites stay known."""
        self._orphans.clear()
        for s in self._stats.values():
            s.reset()
        self._errors.clear()
        self._dropout_calls.clear()


def _sdpa_backend(call: SdpaCall) -> SDPBackend | None:
    """The backend torch's SDPA picks for ``call`` (host-side), or None."""
    try:
        p = prepare(call)
        k, v = (p.k, p.v) if p.rep == 1 else expand_kv(p.k, p.v, p.rep)
        return SDPBackend(
            torch._fused_sdp_choice(p.q, k, v, p.attn_mask, call.dropout_p, p.is_causal, scale=p.scale)
        )
    except Exception:
        return None


def _logical_grads(call: AttentionCall) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A library call's output gradient (``"out"``) and ``q``/``k``/``v`` gradients in the logical form."""

    def logical(name: str, grad: torch.Tensor) -> torch.Tensor:
        return call.q_to_logical(grad) if name in ("out", "q") else call.kv_to_logical(grad)

    return logical


def _flash_form_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    valid: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~flashprobe.kernels.flash_form.flash_form_attention` with ``valid`` keys and ALiBi ``bias``
    folded into one additive mask."""
    if valid is None and bias is None:
        return flash_form_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    keep = torch.ones((), dtype=torch.bool, device=q.device) if valid is None else valid
    if is_causal:
        keep = keep & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    extra = torch.zeros((), dtype=q.dtype, device=q.device) if bias is None else bias.to(q.dtype)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            extra = extra + attn_mask.to(q.dtype)
    mask = torch.where(keep, extra, float("-inf"))
    return flash_form_attention(q, k, v, attn_mask=mask, scale=scale)


def _rows_as_one(group: GroupGradients) -> GroupGradients:
    """A group's row blocks as one block: its outputs and ``dq`` concatenated along the rows."""
    first, last = group.blocks[0], group.blocks[-1]
    whole = dataclasses.replace(first, rows=slice(first.rows.start, last.rows.stop))
    outs = [torch.cat(group.outs, dim=2)] if group.outs else []
    dq = [torch.cat(group.dq, dim=2)] if group.dq else []
    return dataclasses.replace(group, blocks=[whole], outs=outs, dq=dq)


def _worst(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    """The running maximum of :func:`~flashprobe.judge.row_statistics` over blocks (None without golden)."""
    if part is None:
        return total
    return part if total is None else torch.maximum(total, part)


def site_verdict(entry: Mapping[str, Any], *, golden: bool = True) -> tuple[str, str]:
    """A site's verdict over its directions and its reason: ``fail`` when one failed or is biased
    (:mod:`flashprobe.bias`), ``pass`` when one was judged and none failed, else ``undetermined``."""
    directions = site_directions(entry)
    failed = [d for d, e in directions.items() if e.get("verdict") == "fail"]
    biased = [d for d, e in directions.items() if (e.get("bias") or {}).get("verdict") == "biased"]
    words = [
        f"{d} z={directions[d]['bias']['z']:.3g} (limit {directions[d]['bias']['limit']:g})" for d in biased
    ]
    if failed:
        reasons = [
            f"{d}: {directions[d]['first_failure']['reason']}"
            for d in failed
            if directions[d].get("first_failure")
        ]
        return "fail", "; ".join(reasons + ([f"biased: {', '.join(words)}"] if words else []))
    if biased:
        return "fail", f"biased: {', '.join(words)}"
    undetermined = {
        why: sum((e.get("undetermined_calls") or {}).get(why, 0) for e in directions.values())
        for why in ("ill_conditioned", "unrepresentable")
    }
    left = ", ".join(f"{n} {why.replace('_', '-')}" for why, n in undetermined.items() if n)
    if any(e.get("verdict") == "pass" for e in directions.values()):
        note = f" ({left} calls undetermined)" if left else ""
        return "pass", "every compared call within the rule" + note
    if left:
        return "undetermined", f"every judged call undetermined ({left})"
    if not golden:
        return "undetermined", "no FP64 golden value (golden=False): the rule needs it"
    if entry.get("dropout_calls"):
        return "undetermined", "only calls with attention dropout, which are not judged"
    if entry.get("shadow_errors"):
        return "undetermined", "every reference computation failed"
    return "undetermined", "no call compared"


def dropout_refusal(where: str, dropout_p: float, spec: str) -> str:
    """Why a primary kernel is refused for attention with dropout, and the fixes (one paragraph)."""
    return (
        f"flashprobe: {where} uses attention dropout ({dropout_p}), and the primary {spec!r} (like every "
        f"kernel) implements no dropout: the model would train with torch's scaled_dot_product_attention "
        f"there, not with {spec!r}. Set the attention dropout to 0 (nn.TransformerEncoderLayer(..., "
        "dropout=0.0), nn.MultiheadAttention(dropout=0.0), transformers configs attention_dropout / "
        "attn_pdrop / attention_probs_dropout_prob = 0.0) to train with it, or pass fallback=True to "
        "train those calls with torch's SDPA, recorded as a fallback (then `flashprobe compare` does not "
        "call the run a kernel comparison)"
    )


def failure_message(failure: Failure) -> str:
    """One line for a failure: site, direction, step, reason and the reproducer."""
    repro = failure.repro
    where = f"; reproducer: {repro} (flashprobe replay {repro})" if repro else ""
    return (
        f"flashprobe: FAIL at site {failure.site!r}, {failure.direction}, step {failure.step}: "
        f"{failure.reason}{where}"
    )
