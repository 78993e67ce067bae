"""What two runs differ in, read from what they recorded: the test of "like for like".

A comparison of two runs' weights is like for like when the runs differ in one thing (or none: the
noise floor), so the distance measures that thing. The things are read from each run's snapshot
manifest (:data:`FACTS` and its ``config``), its ``config.yaml`` (every setting, counted under the fact
it sets or as a thing of its own; where a run writes its files, its name, logger and the probe's
settings are not things it differs in) and ``run.json``'s machine facts, which change the last bits of
every step. A fact a run did not record is ``unrecorded``: the comparison is then not like for like.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashprobe.formats.jsonio import flatten

__all__ = ["FACTS", "describe_differences", "is_like_for_like", "not_like_for_like", "run_differences"]

#: The facts every snapshot manifest records (``WeightSnapshot``'s arguments or their defaults).
FACTS = ("attention", "precision", "seed")

#: config.yaml keys (exact, or a prefix ending in ".") that carry each fact.
_FACT_KEYS = {
    "attention": ("attention.", "module.attention", "callbacks.weight_snapshot.attention"),
    "precision": ("trainer.precision", "callbacks.weight_snapshot.precision"),
    "seed": ("seed", "data.shuffle_seed", "module.noise_seed", "callbacks.weight_snapshot.seed"),
}
#: config.yaml keys that name or place a run, not how it trains (its directory, name, logger,
#: checkpoint files: a resumed run is bit-identical), the probe's settings (the probe never changes
#: training) and the study's bookkeeping (its effects are the keys above).
_NOT_A_DIFFERENCE = (
    "attention.probe.",
    "callbacks.attention_probe.",
    "run_name",
    "run_dir",
    "output_root",
    "resume",
    "overwrite",
    "ckpt_path",
    "logger.",
    "hydra.",
    "study.",
    "callbacks.checkpoint.",
    "callbacks.weight_snapshot.run_id",
)
_PLACES = (".dirpath", ".save_dir")
#: run.json machine facts that change a run's numbers (the last bits of every step).
_MACHINE = (
    "torch",
    "cpu",
    "cpu_capability",
    "torch_threads",
    "cuda",
    "deterministic_algorithms",
    "float32_matmul_precision",
)


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key.startswith(p) if p.endswith(".") else key == p for p in patterns)


def _settings(run_dir: Path, manifest_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The run's flattened settings: its ``config.yaml``, else the manifest's ``config``; None if neither."""
    path = run_dir / "config.yaml"
    if path.is_file():
        import yaml

        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            tree = None
        if isinstance(tree, Mapping):
            flat = flatten(tree)
            # the model's settings appear twice (model.* and module.model.*): count them once
            return {
                ("model." + k[len("module.model.") :] if k.startswith("module.model.") else k): v
                for k, v in flat.items()
            }
    return flatten(manifest_config) if manifest_config else None


def _machine(run_dir: Path) -> dict[str, Any] | None:
    from flashprobe.formats.run_record import read_run_record

    record = read_run_record(run_dir) or {}
    machine = record.get("machine")
    return {k: machine.get(k) for k in _MACHINE} if isinstance(machine, Mapping) else None


def run_differences(a: Any, b: Any) -> dict[str, Any]:
    """What runs ``a`` and ``b`` differ in, from their records.

    Args:
        a: run A's :class:`~flashprobe.weights.store.SnapshotStore`.
        b: run B's.

    Returns:
        ``{"differs": {thing: [value_a, value_b]}, "unrecorded": [fact, ...]}``: the things that
        differ (``attention``, ``precision``, ``seed``, ``attention fallback`` — a run recorded that
        torch's SDPA computed attention its requested kernel could not, so the pair is no kernel
        comparison —, a setting's key, ``machine``), each with
        both runs' values, in that order; and the manifest facts (:data:`FACTS`) that a run did not
        record (their difference is unknown).
    """
    differs: dict[str, list[Any]] = {}
    unrecorded = [f for f in FACTS if getattr(a, f) is None or getattr(b, f) is None]
    for fact in FACTS:
        if fact not in unrecorded and getattr(a, fact) != getattr(b, fact):
            differs[fact] = [getattr(a, fact), getattr(b, fact)]
    fallback_a, fallback_b = _fallback(a), _fallback(b)
    if fallback_a != fallback_b:  # a requested kernel that did not compute all the attention
        differs["attention fallback"] = [fallback_a or "none", fallback_b or "none"]
    run_a, run_b = _run_dir(a), _run_dir(b)
    settings_a, settings_b = _settings(run_a, a.config), _settings(run_b, b.config)
    if settings_a is not None and settings_b is not None:
        for key in sorted(settings_a.keys() | settings_b.keys()):
            va, vb = settings_a.get(key), settings_b.get(key)
            if va == vb or _matches(key, _NOT_A_DIFFERENCE) or key.endswith(_PLACES):
                continue
            if _inside(va, run_a) and _inside(vb, run_b):
                continue  # each a path inside its own run's directory
            fact = next((f for f, keys in _FACT_KEYS.items() if _matches(key, keys)), None)
            if fact is None:
                differs[key] = [va, vb]
            elif fact not in differs:
                differs[fact] = [va, vb]
                if fact in unrecorded:
                    unrecorded.remove(fact)
    machine_a, machine_b = _machine(run_a), _machine(run_b)
    if machine_a is not None and machine_b is not None:
        keys = [k for k in _MACHINE if machine_a[k] != machine_b[k]]
        if "threads" in differs:
            keys = [k for k in keys if k != "torch_threads"]  # the same thing, named once
        if keys:
            differs["machine"] = [
                ", ".join(f"{k} {machine_a[k]}" for k in keys),
                ", ".join(f"{k} {machine_b[k]}" for k in keys),
            ]
    return {"differs": differs, "unrecorded": unrecorded}


def _fallback(store: Any) -> str | None:
    """A run's recorded attention fallback in words (the manifest's ``attention_fallback``: the
    requested kernel did not compute the attention at some sites), or None."""
    fallback = store.manifest.get("attention_fallback")
    if not isinstance(fallback, Mapping):
        return None
    sites = fallback.get("sites") or []
    where = "every site" if fallback.get("every_site") else ", ".join(map(str, sites))
    return (
        f"{fallback.get('kernel', 'torch sdpa')} instead of {fallback.get('requested')} at {where} "
        f"from step {fallback.get('from_step')}"
    )


def _inside(value: Any, run_dir: Path) -> bool:
    """Whether ``value`` is an absolute path inside ``run_dir`` (component-wise, not a text prefix:
    ``runs/flash_seed2`` is not inside ``runs/flash``)."""
    if not isinstance(value, str) or not Path(value).is_absolute():
        return False
    return Path(value).resolve().is_relative_to(run_dir.resolve())


def _run_dir(store: Any) -> Path:
    """The run directory of a store opened on a run or on its ``snapshots`` directory."""
    directory = Path(store.directory)
    return (
        directory.parent
        if Path(store.run_dir) == directory and directory.name == "snapshots"
        else Path(store.run_dir)
    )


def is_like_for_like(pair: Mapping[str, Any]) -> bool:
    """Whether a pair of ``study.json`` differs in at most one thing (``differs``), every fact recorded."""
    differs = pair.get("differs")
    return isinstance(differs, Mapping) and len(differs) <= 1 and not pair.get("unrecorded")


def not_like_for_like(pairs: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The pairs of ``study.json`` not shown to be like for like → what they differ in, in words."""
    return {n: describe_differences(p) for n, p in pairs.items() if not is_like_for_like(p)}


def describe_differences(pair: Mapping[str, Any]) -> str:
    """``attention (sdpa_flash vs math)``, ``seed (1 vs 0), attention (...)``, ``nothing`` or
    ``not recorded``, for a pair of ``study.json``."""
    differs = pair.get("differs")
    if not isinstance(differs, Mapping):
        return "not recorded"
    parts = [f"{thing} ({_value(a)} vs {_value(b)})" for thing, (a, b) in differs.items()]
    if pair.get("unrecorded"):
        parts.append(f"unknown: {', '.join(pair['unrecorded'])} not recorded")
    return ", ".join(parts) or "nothing"


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
