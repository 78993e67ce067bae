"""Save a model's weights as a snapshot without a trainer (:func:`save_snapshot`), and the helpers the
snapshot callbacks of both trainers share; all write with :class:`~flashprobe.weights.store.SnapshotWriter`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from flashprobe.weights.store import SnapshotWriter, TensorSpec

__all__ = [
    "TRUE_PRECISION",
    "SnapshotSchedule",
    "clean_name",
    "live_tensors",
    "manifest_config",
    "module_tensors",
    "own_attention",
    "save_snapshot",
]

# Prefixes that wrappers (FSDP1, activation checkpointing, torch.compile) insert into module paths.
_WRAPPER_PREFIX = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def clean_name(name: str) -> str:
    """A tensor's name without the prefixes wrappers insert (``blocks._orig_mod.0`` → ``blocks.0``)."""
    return _WRAPPER_PREFIX.sub("", name)


def manifest_config(config: Any) -> dict[str, Any]:
    """A JSON-serialisable plain dict from a dict, a dataclass or an OmegaConf config."""
    if config is None:
        return {}
    from omegaconf import DictConfig, OmegaConf

    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    if hasattr(config, "__dataclass_fields__"):
        from dataclasses import asdict

        config = asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a mapping (dict, dataclass or OmegaConf DictConfig), got {type(config)}"
        )
    try:
        return json.loads(json.dumps(dict(config)))
    except (TypeError, ValueError) as err:
        raise TypeError(f"config must be JSON-serialisable for the snapshot manifest: {err}") from err


class SnapshotSchedule:
    """The settings and step schedule that both trainers' snapshot callbacks share
    (:class:`flashprobe.callbacks.WeightSnapshot`,
    :class:`flashprobe.integrations.hf_snapshots.WeightSnapshotCallback`; their docstrings say what
    each argument means there).

    Raises:
        ValueError: ``every_n_steps`` is not a positive int or None, a step is not a non-negative int,
            or nothing would ever be saved; the message starts with the callback's class name.
        TypeError: ``config`` cannot be stored as JSON.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        every_n_steps: int | None = None,
        steps: Iterable[int] | None = None,
        save_initial: bool = True,
        save_last: bool = True,
        include_buffers: bool = False,
        trainable_only: bool = False,
        run_id: str | None = None,
        seed: int | None = None,
        attention: str | None = None,
        precision: str | None = None,
        config: Any = None,
    ) -> None:
        owner = type(self).__name__
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(f"{owner}: every_n_steps must be a positive int or None, got {every_n_steps!r}")
        step_list = sorted(set(steps or ()))
        bad = [s for s in step_list if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ValueError(f"{owner}: steps must be non-negative ints, got {bad}")
        if every_n_steps is None and not step_list and not save_initial and not save_last:
            raise ValueError(
                f"{owner} would save nothing: set every_n_steps, steps, save_initial=True or save_last=True"
            )
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.every_n_steps = every_n_steps
        self.steps = tuple(step_list)
        self.save_initial = save_initial
        self.save_last = save_last
        self.include_buffers = include_buffers
        self.trainable_only = trainable_only
        self.run_id = None if run_id is None else str(run_id)
        self.seed = None if seed is None else int(seed)
        self.attention = None if attention is None else str(attention)
        self.precision = None if precision is None else str(precision)
        self.config = manifest_config(config)
        self._saved: set[int] = set()
        self._writer: SnapshotWriter | None = None
        #: (fallbacks, sites seen) of the probe when the manifest's attention was last written
        self._attention_seen: tuple[int, int] | None = None

    @property
    def saved_steps(self) -> list[int]:
        """Steps saved by this run so far (those kept from before a resume included), ascending."""
        return sorted(self._saved)

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is one of the configured snapshot steps (ignores initial/last)."""
        return (self.every_n_steps is not None and step % self.every_n_steps == 0 and step > 0) or (
            step in self.steps
        )

    def _open(
        self, run_dir: Path, header: dict[str, Any], step: int, warn: Callable[[str], Any]
    ) -> SnapshotWriter:
        """Open the run's snapshot writer (rank zero) for training that starts at ``step``: snapshots
        after ``step`` belong to an abandoned run and are removed, with a ``warn`` line."""
        self._writer = SnapshotWriter(run_dir, header)
        dropped = self._writer.prune_after(step)
        if dropped:
            warn(
                f"{type(self).__name__}: removed snapshots of steps {dropped} from {self._writer.directory}: "
                f"they are later than the step training starts from ({step}), so they belong to an abandoned "
                "run; they are written again as training reaches them"
            )
        return self._writer

    def _refresh_attention(self, probe: Any, record: Callable[[], dict[str, Any]]) -> None:
        """After a step that saved nothing: rewrite the manifest's attention (``record()``) when the
        probe (a callback with ``fallbacks`` and ``sites_seen``, or None) found a fallback or a new site
        since it was last written, so the manifest says it now, not at the next snapshot; other steps
        read two lengths."""
        seen = None if probe is None else (len(probe.fallbacks), len(probe.sites_seen))
        if seen != self._attention_seen and self._writer is not None:
            self._attention_seen = seen
            self._writer.update_header(record())


def module_tensors(
    module: torch.nn.Module, *, include_buffers: bool, trainable_only: bool
) -> tuple[dict[str, torch.Tensor], list[TensorSpec]]:
    """CPU copies of a (not sharded) module's parameters (and persistent buffers), with their specs.

    Names have the wrappers' prefixes (FSDP1, activation checkpointing, ``torch.compile``) removed.
    """
    tensors, kinds = live_tensors(module, include_buffers=include_buffers, trainable_only=trainable_only)
    copies = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}
    return copies, [TensorSpec.of(n, t, kinds[n]) for n, t in copies.items()]


def live_tensors(
    module: torch.nn.Module, *, include_buffers: bool, trainable_only: bool
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's tensors to save, by clean name, and each one's kind (``parameter``/``buffer``)."""
    params = {clean_name(n): p for n, p in module.named_parameters()}
    if trainable_only:
        params = {n: p for n, p in params.items() if p.requires_grad}
    buffers: dict[str, torch.Tensor] = {}
    if include_buffers:
        persistent = {clean_name(k) for k in module.state_dict(keep_vars=True)}
        buffers = {clean_name(n): b for n, b in module.named_buffers() if clean_name(n) in persistent}
    kinds = {**{n: "parameter" for n in params}, **{n: "buffer" for n in buffers}}
    return {**params, **buffers}, kinds


def own_attention(module: torch.nn.Module) -> str:
    """What "the model's own attention" is for ``module``, resolved where the run is recorded.

    A Hugging Face model (``module`` or a submodule with a ``config._attn_implementation``) names its
    attention implementation; any other model is its own attention calls. Both name the device the
    parameters are on (torch's SDPA picks its backend per device), so two runs of the same model on
    the same kind of device record the same value: ``"own sdpa on cpu"``, ``"own attention on cuda"``.
    """
    implementation = next(
        (
            str(impl)
            for m in module.modules()
            if isinstance(impl := getattr(getattr(m, "config", None), "_attn_implementation", None), str)
        ),
        "attention",
    )
    device = next((p.device.type for p in module.parameters()), "cpu")
    return f"own {implementation} on {device}"


#: Lightning's name of a run trained in a parameter dtype throughout (what ``trainer.precision`` records).
TRUE_PRECISION = {
    torch.float32: "32-true",
    torch.float64: "64-true",
    torch.bfloat16: "bf16-true",
    torch.float16: "16-true",
}


def save_snapshot(
    model: torch.nn.Module,
    run_dir: str | os.PathLike[str],
    step: int,
    *,
    seed: int | None = None,
    attention: str | None = None,
    precision: str | None = None,
    config: Any = None,
    run_id: str | None = None,
    epoch: int | None = None,
    include_buffers: bool = False,
    trainable_only: bool = False,
) -> Path:
    """Save ``model``'s weights at ``step`` into ``run_dir/snapshots`` (the snapshot callbacks' format).

    Call it at the steps you want to compare (e.g. every 100 optimizer steps of your own loop); each
    call adds one ``step_XXXXXXX.safetensors`` file atomically and lists it in ``manifest.json``
    (a step saved again is replaced). Compare two such runs with
    :func:`~flashprobe.weights.compare_runs`.

    Args:
        model: the model; its parameters (and, with ``include_buffers``, persistent buffers) are
            copied to the CPU in their dtype.
        run_dir: the run directory (created if missing).
        step: the optimizer step the weights belong to (a non-negative int).
        seed: the run's seed, recorded in the manifest (the comparison says whether two runs differ
            in it).
        attention: the attention the model trains with (a kernel spec); default: the model's own
            (``"own attention on cpu"``, or ``"own sdpa on cpu"`` for a Hugging Face model).
        precision: the training precision in Lightning's names; default: the parameters' dtype
            trained throughout (``"32-true"`` for float32, ``"bf16-true"``, ...).
        config: a JSON-serialisable mapping (dict, dataclass or OmegaConf config) recorded in the
            manifest.
        run_id: recorded in the manifest; default: the name of ``run_dir``.
        epoch: recorded in the snapshot's manifest entry when given.
        include_buffers: also save the persistent buffers.
        trainable_only: save only the parameters with ``requires_grad=True``.

    Returns:
        The snapshot file's path.

    Raises:
        ValueError: ``step`` is not a non-negative int, or the model has no tensors to save.
        TypeError: ``config`` cannot be stored as JSON.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_snapshot: step must be a non-negative int (the optimizer step), got {step!r}")
    tensors, specs = module_tensors(model, include_buffers=include_buffers, trainable_only=trainable_only)
    if not tensors:
        raise ValueError(
            "save_snapshot: the model has no tensors to save"
            + (" (trainable_only=True and every parameter is frozen)" if trainable_only else "")
        )
    if precision is None:
        dtype = next(iter(tensors.values())).dtype
        precision = TRUE_PRECISION.get(dtype, str(dtype).removeprefix("torch."))
    header = {
        "run_id": str(run_id) if run_id is not None else Path(run_dir).name,
        "seed": None if seed is None else int(seed),
        "attention": str(attention) if attention is not None else own_attention(model),
        "precision": str(precision),
        "config": manifest_config(config),
    }
    extra = {} if epoch is None else {"epoch": int(epoch)}
    return SnapshotWriter(run_dir, header).write(step, tensors, specs, **extra)
