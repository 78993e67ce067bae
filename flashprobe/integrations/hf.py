"""Hugging Face transformers: the attention probe in ``transformers.Trainer``
(:class:`AttentionProbeCallback`), and flashprobe kernels as an ``attn_implementation``
(:func:`register_attention`). This module imports transformers; ``import flashprobe`` does not.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.trainer_callback import ExportableState

from flashprobe.integrations.hf_snapshots import WeightSnapshotCallback
from flashprobe.kernels import Kernel, get_kernel
from flashprobe.probing import ProbeConfig, ProbeWarning, SdpaCall, sites
from flashprobe.probing.call import autocast_dtype, run_kernel
from flashprobe.probing.routing import check_kernel_here
from flashprobe.probing.run_session import SessionCallback, SessionField, plain_failures
from flashprobe.probing.session import nonfinite_weights
from flashprobe.probing.summary import Failure, ProbeSummary, summary_scalars

__all__ = [
    "CONFIG_KEY",
    "DEFAULT_NAME",
    "AttentionProbeCallback",
    "WeightSnapshotCallback",
    "register_attention",
    "trainer_callbacks",
]

log = logging.getLogger(__name__)

#: The ``attn_implementation`` name :func:`register_attention` registers by default. Not
#: "flashprobe": transformers takes every name containing "flash" for a flash-attn kernel to load.
DEFAULT_NAME = "probe_kernel"

#: The config field that picks a model's own kernel spec for a registered ``attn_implementation``
#: (e.g. ``LlamaConfig(..., flashprobe_kernel="tiled:block_k=32")``); saved in ``config.json``.
CONFIG_KEY = "flashprobe_kernel"

#: transformers' own attention implementations: not replaceable by register_attention.
_RESERVED = frozenset(
    {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "paged|eager"}
)


# --- attn_implementation="probe_kernel" ---


class _AttentionKernel:
    """One registered kernel: checked once per device and dtype, run with SDPA's semantics. It is the
    ``route`` a probe's primary runs (duck-typed :class:`~flashprobe.probing.KernelRoute`: ``run``)."""

    def __init__(self, name: str, kernel: Kernel) -> None:
        self.name = name
        self.kernel = kernel
        self._checked: set[tuple[torch.device, torch.dtype]] = set()
        self._warned_dropout = False

    def check(self, call: SdpaCall) -> None:
        key = (call.query.device, autocast_dtype(call.query))
        if key not in self._checked:
            check_kernel_here(self.kernel, *key, f"attn_implementation={self.name!r}")
            self._checked.add(key)

    def run(self, call: SdpaCall) -> torch.Tensor:
        if call.dropout_p > 0:
            if not self._warned_dropout:
                self._warned_dropout = True
                warnings.warn(
                    f"flashprobe: attn_implementation={self.name!r} ({self.kernel.spec!r}): attention "
                    f"calls with dropout {call.dropout_p} run torch's scaled_dot_product_attention "
                    "(kernels implement no attention dropout); set the attention dropout to 0 "
                    "(e.g. config.attention_dropout=0.0) to run the kernel",
                    ProbeWarning,
                    stacklevel=4,
                )
            return call.original()
        return run_kernel(self.kernel, call)


def _dispatch(runner: _AttentionKernel, call: SdpaCall) -> torch.Tensor:
    """Run ``call`` with the registered kernel, through the probe attached to the calling module if any."""
    runner.check(call)
    res = sites.find_caller(sys._getframe(1))
    if res is None:
        with sites.passthrough():
            return runner.run(call)
    return sites.handle_sdpa(res, call, res.route or runner)


_COMPILED_DISPATCH = torch.compiler.disable(_dispatch, reason=sites.GRAPH_BREAK_REASON)


def _attention_function(default: _AttentionKernel) -> Callable[..., tuple[torch.Tensor, None]]:
    """The attention function registered for ``default``: it prepares the call as transformers' own
    ``sdpa`` function does (causal flag, grouped key/value heads, position bias) and runs the kernel
    with SDPA's semantics, making no SDPA call: inside a probed model it hands the call to the probe
    at the site an SDPA call made there would get, with the kernel as the route the primary runs, so
    ``probe(model)`` compares the flashprobe kernel (``probe(model, primary=...)`` and a
    :func:`~flashprobe.probing.use_kernel` route still take precedence). Under ``torch.compile`` each
    call is one graph break."""
    from transformers.integrations.sdpa_attention import create_position_bias_mask

    runners: dict[str, _AttentionKernel] = {}

    def runner_for(module: nn.Module) -> _AttentionKernel:
        """The registered kernel, or the one the module's config names in ``flashprobe_kernel``."""
        spec = getattr(getattr(module, "config", None), CONFIG_KEY, None)
        if spec is None:
            return default
        if spec not in runners:
            runners[spec] = _AttentionKernel(default.name, get_kernel(spec))
        return runners[spec]

    def flashprobe_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention-function convention: ``query (B, H, N_q, D)``, ``key``/``value``
        ``(B, H_kv, N_k, D)``, ``attention_mask`` bool or additive ``(B, 1, N_q, N_k)`` or None;
        returns ``(B, N_q, H, D_v)`` and no attention weights."""
        runner = runner_for(module)
        if kwargs.get("softcap") is not None:
            raise ValueError(
                f"attn_implementation={runner.name!r} does not support softcap (the SDPA signature "
                "has no soft-capping); load the model with attn_implementation='eager' or 'flex_attention'"
            )
        q_length, kv_length = query.shape[2], key.shape[2]
        # As transformers' sdpa_attention_forward: causal only without a mask and beyond one query.
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
        if is_causal and kv_length > q_length:  # prefill with an empty static cache
            key, value = key[:, :, :q_length], value[:, :, :q_length]
            if position_bias is not None:
                position_bias = position_bias[..., :q_length]
        if position_bias is not None:
            attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
            is_causal = False
        gqa = key.shape[1] != query.shape[1]
        call = SdpaCall(query, key, value, attention_mask, float(dropout), is_causal, scaling, gqa)
        run = _COMPILED_DISPATCH if torch.compiler.is_compiling() else _dispatch
        out = run(runner, call)  # (B, H, N_q, D_v)
        return out.transpose(1, 2).contiguous(), None

    return flashprobe_attention


def register_attention(name: str = DEFAULT_NAME, kernel: str | Kernel = "math") -> str:
    """Make a flashprobe kernel an ``attn_implementation`` of transformers.

    ::

        register_attention("probe_kernel", "tiled:preset=fa2")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="probe_kernel")

    The model's attention calls run ``kernel`` (masks as for ``"sdpa"``), or the kernel spec its
    config names in ``flashprobe_kernel`` (:data:`CONFIG_KEY`); with a probe attached, that kernel
    is the primary the probe compares. Registering a name again replaces its kernel for models
    loaded afterwards and before.

    Args:
        name: the ``attn_implementation`` name.
        kernel: a kernel spec (``"math"``, ``"tiled:block_k=32"``, a registered kernel) or a
            :class:`~flashprobe.kernels.Kernel`; checked against each call's device and dtype at the
            first call there. A model config's ``flashprobe_kernel`` overrides it for that model
            (an unknown spec there raises ``KernelSpecError`` at the model's first attention call).

    Returns:
        ``name``.

    Raises:
        ValueError: ``name`` is one of transformers' own implementations, contains ``flash``,
            ``sdpa`` or ``flex`` (names transformers gives its own meaning), or is not a plain name.
        KernelSpecError: unknown kernel or option.
    """
    if not isinstance(name, str) or not name or name in _RESERVED or any(c in name for c in "/:|"):
        raise ValueError(
            f"register_attention: name={name!r} must be a new plain name (no '/', ':' or '|'), not one "
            f"of transformers' own ({', '.join(sorted(_RESERVED))}); e.g. {DEFAULT_NAME!r}"
        )
    if "flash" in name or "sdpa" in name or "flex" in name:
        raise ValueError(
            f"register_attention: name={name!r} contains 'flash', 'sdpa' or 'flex', which transformers "
            "reads as a request for its own kernels of that family (it would try to load flash-attn); "
            f"choose another name, e.g. {DEFAULT_NAME!r}"
        )
    runner = _AttentionKernel(name, get_kernel(kernel))
    ALL_ATTENTION_FUNCTIONS.register(name, _attention_function(runner))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


# --- The Trainer callback ---


def trainer_callbacks() -> list[TrainerCallback] | None:
    """The callback list of the Trainer's ``CallbackHandler`` that is calling the current hook (found
    on the call stack); None when no handler is calling."""
    from transformers.trainer_callback import CallbackHandler

    frame = sys._getframe(1)
    while frame is not None and not isinstance(frame.f_locals.get("self"), CallbackHandler):
        frame = frame.f_back
    return None if frame is None else frame.f_locals["self"].callbacks


class AttentionProbeCallback(SessionCallback, TrainerCallback, ExportableState):
    """Compare the model's attention kernel with the baseline at every training call of a HF ``Trainer``.

    ::

        trainer = Trainer(model, args, train_dataset=data, callbacks=[AttentionProbeCallback(golden=True)])

    Args:
        config, filename, plot, on_failure, max_reproducers, on_nonfinite, console, **settings: as for
            the Lightning :class:`~flashprobe.callbacks.AttentionProbe`; ``"stop"`` stops training
            through ``control.should_training_stop``.
        log_every_n_steps: read, log and reset the statistics every n optimizer steps; default:
            the Trainer's ``logging_steps``.
        dirpath: directory of ``probe.jsonl`` and ``repro/``; default: ``args.output_dir``.

    It compares every micro-batch of a training step (attached from ``on_step_begin`` to
    ``on_step_end``; evaluation runs the model alone); the work is its
    :class:`~flashprobe.probing.run_session.ProbeSession`'s (``self.session``). The summary's scalars
    (:data:`flashprobe.probing.summary.SUMMARY_SCALARS`) go into the Trainer's ``logs``; so that every
    ``report_to`` logger gets them, the callback moves itself right after ``DefaultFlowCallback`` at
    train begin. Its state (settings, last logged step, failures, tally, bias sums) goes into the
    Trainer's checkpoints (``ExportableState``): resumed with
    ``restore_callback_states_from_checkpoint=True``, a run keeps its verdict and bias
    (``probe.jsonl`` drops the records after the checkpoint's step either way).

    Raises:
        ProbeConfigError: an unknown setting or a bad value, naming it.
        ValueError: a bad ``on_failure``, ``max_reproducers``, interval or filename, naming it.
        KernelSpecError: an unknown kernel spec (at construction).
        KernelUnavailableError: at train begin, a kernel that cannot run on the model's device/dtype.
        RuntimeError: after the first training step, when the model made no attention call.
    """

    def __init__(self, config: ProbeConfig | None = None, /, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._pending: dict[str, float] = {}

    # The Trainer restores a checkpoint's state by setting these (see :meth:`state`).
    _restored_bias = SessionField("The signed-bias sums to continue from.", "restored_bias")

    @property
    def _tally_state(self) -> dict[str, Any]:
        return self.session.tally.state_dict()

    @_tally_state.setter
    def _tally_state(self, state: dict[str, Any]) -> None:
        self.session.tally.load_state_dict(state)

    @property
    def _restored_failures(self) -> list[dict[str, Any]]:
        """The first failures to apply at the next attach, as plain data."""
        return plain_failures(self.session.restored_failures)

    @_restored_failures.setter
    def _restored_failures(self, failures: list[dict[str, Any]]) -> None:
        self.session.restored_failures = [Failure.from_dict(f) for f in failures]

    # ------------------------------------------------------------------------------ lifecycle
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise RuntimeError(f"{type(self).__name__}: the Trainer passed no model to on_train_begin")
        self._lead_the_loggers()

        def publish(step: int, stats: dict[str, Any], summary: ProbeSummary) -> None:
            self._pending = summary_scalars(summary)  # into the Trainer's logs at its next on_log

        distributed = args.world_size > 1 and torch.distributed.is_available()
        self.session.attach(
            model,
            root=args.output_dir or ".",
            dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
            is_zero=state.is_world_process_zero,
            reduce_device=args.device if distributed and torch.distributed.is_initialized() else None,
            resumed_at=state.global_step if state.global_step > 0 else None,
            publish=publish,
        )

    def _lead_the_loggers(self) -> None:
        """Move this callback right after ``DefaultFlowCallback`` in the Trainer's callback list, so
        that the scalars it puts into ``logs`` reach the reporting callbacks that follow. The list is
        that of the ``CallbackHandler`` calling this hook (found on the call stack)."""
        from transformers.trainer_callback import DefaultFlowCallback

        callbacks = trainer_callbacks()
        if callbacks is None or self not in callbacks:
            log.warning(
                "%s: could not find the Trainer's callback list; the probe's scalars reach only the "
                "callbacks after it",
                type(self).__name__,
            )
            return
        callbacks.remove(self)
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        callbacks.insert(flow[0] + 1 if flow else 0, self)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.begin_step(state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self.session.pause()  # evaluation, saving and logging run the model alone
        model = kwargs.get("model")
        result = self.session.end_step(
            state.global_step,
            every=state.logging_steps,
            last=state.max_steps > 0 and state.global_step >= state.max_steps,
            weights=(lambda: nonfinite_weights(model)) if isinstance(model, nn.Module) else None,
            stopping=control.should_training_stop,
        )
        if result.flushed:
            control.should_log = True  # the Trainer logs at this step, with the probe's scalars
        if result.stop:
            control.should_training_stop = True
        return control

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or not self._pending or "loss" not in logs:  # training logs only
            return
        logs.update(self._pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        self._pending = {}

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session.probe is not None:
            from flashprobe.report.probe_figures import plot_probe  # matplotlib: imported at the end only

            self.session.finish(state.global_step, draw=plot_probe)

    # ---------------------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """The callback's arguments and progress, as plain data for the Trainer's checkpoints."""
        session = self.session.state_dict()
        return {
            "args": {
                **self.config.as_dict(),
                "log_every_n_steps": self.log_every_n_steps,
                "dirpath": None if self.dirpath is None else str(self.dirpath),
                "filename": self.filename,
                "plot": self.plot,
                "on_failure": self.on_failure,
                "max_reproducers": self.max_reproducers,
                "on_nonfinite": self.on_nonfinite,
                "console": self.console,
            },
            "attributes": {
                "last_logged_step": self.last_logged_step,
                "records": self.records,
                "_tally_state": session["tally"],
                "_restored_failures": session["failures"],
                "_restored_bias": session["bias"],
            },
        }
