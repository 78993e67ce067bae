"""Tiny budgets for documented commands, and the files each command says it writes.

A documented command is run as written with :func:`budget` appended. argparse keeps the last
value of an option given twice, and Hydra applies later overrides over earlier ones, so the
appended arguments shrink the work without editing the command. Hydra commands get overrides
that exist in every run configuration; bench commands get small shapes and one seed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

__all__ = ["HEAVY_FUZZ_CASES", "HYDRA_TINY", "budget", "family", "outputs"]

#: Hydra overrides that shrink one training run to seconds (a subset of experiment=smoke that
#: leaves the documented experiment, attention and precision in place)
HYDRA_TINY = (
    "model=tiny",
    "logger=csv",
    "threads=1",
    "data.num_train=32",
    "data.num_val=8",
    "data.batch_size=8",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "callbacks.weight_snapshot.every_n_steps=1",
    "module.num_samples=2",
    "module.num_sample_steps=2",
    "module.warmup_steps=0",
)

#: the catalogue cases that take most of a ``fuzz`` run's time on a CPU (2^24-element inputs, 256 heads,
#: 1280 heads, 8k keys): left out of documented fuzz commands (tests/fuzz runs them), so a command of
#: five kernels runs in seconds; a command that asks for one by ``--case`` keeps it
HEAVY_FUZZ_CASES = ("offsets_2e24", "bias_dense", "bias_repeated_max", "large_grid", "long_context_8k")

#: argparse flags per command family; appended after the documented ones, so they win
_BENCH_SHAPE = ("--batch", "1", "--heads", "1", "--head-dim", "16", "--repeats", "1")
_BUDGETS: dict[str, tuple[str, ...]] = {
    "bench paper": ("--tiny",),
    "bench precision": (*_BENCH_SHAPE, "--seq-len", "64"),
    "bench seqlen": (*_BENCH_SHAPE, "--seq-len", "32", "64"),
    "bench tiles": (*_BENCH_SHAPE, "--seq-len", "64", "--sram", "256", "1024"),
    "bench speed": (*_BENCH_SHAPE, "--seq-len", "64", "--no-memory"),
    "bench overhead": ("--steps", "2"),
    "bench bias": (*_BENCH_SHAPE, "--seq-len", "32", "--dtype", "bf16"),
    "bench fp8": ("--tiny",),
    "bench verdicts": ("--steps", "2", "--models", "t2i,gpt2"),
    "study": ("--runs", "flash,baseline", *HYDRA_TINY, "study.replicates=1"),
    "train": HYDRA_TINY,
    "fuzz": ("--seeds", "1", "--profile", "default"),
    "compare": (),
    "report": (),
    "kernels": (),
    "replay": (),
}

#: files a command family writes into its output directory (``--out``), as the docs say
_OUTPUTS: dict[str, tuple[str, ...]] = {
    "bench paper": ("paper.json", "paper.md"),
    "bench precision": ("precision.json", "precision.csv", "precision.png"),
    "bench seqlen": ("seqlen.json", "seqlen.csv", "seqlen.png"),
    "bench tiles": ("tiles.json", "tiles.csv", "tiles.png"),
    "bench speed": ("speed.json", "speed.csv", "speed.png"),
    "bench bias": ("bias.json", "bias.csv", "bias.md", "bias.png"),
    "bench fp8": ("fp8.json", "fp8.csv", "fp8.md", "fp8_errors.png", "fp8_pcast.png"),
    "bench verdicts": ("verdicts.json", "verdicts.csv"),
    "study": ("study.json", "study.csv", "report.md", "fig8_wasserstein.png"),
    "compare": ("study.json", "study.csv", "fig8_wasserstein.png"),
    "fuzz": ("fuzz.json",),
}


def family(argv: Sequence[str]) -> str:
    """``"bench precision"``, ``"fuzz"``, ... for a ``flashprobe`` command; ``""`` otherwise."""
    if len(argv) < 2 or argv[0] != "flashprobe":
        return ""
    return " ".join(argv[1:3]) if argv[1] == "bench" and len(argv) > 2 else argv[1]


def budget(argv: Sequence[str]) -> list[str]:
    """The arguments to append to ``argv`` so it runs in seconds.

    Raises:
        KeyError: a ``flashprobe`` command family without a budget (add it to ``_BUDGETS``).
    """
    name = family(argv)
    if not name:
        return []
    if name not in _BUDGETS:
        raise KeyError(f"no tiny budget for 'flashprobe {name}'; add one to tests/docs/_budget.py")
    extra = list(_BUDGETS[name])  # in a Hydra sweep (-m) every job gets it
    if name == "fuzz":
        extra += [arg for case in _heavy_cases_left_out(argv) for arg in ("--exclude", case)]
        asked = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--case"]
        if not any(p.startswith(("seq_", "inv_")) for p in asked):  # tests/fuzz runs them
            extra += ["--exclude", "seq_*", "--exclude", "inv_*"]
        if "--budget" in argv:  # a random search: 4 samples (each may draw thousands of keys)
            extra += ["--budget", "4"]
    return extra


def _heavy_cases_left_out(argv: Sequence[str]) -> list[str]:
    """The :data:`HEAVY_FUZZ_CASES` a documented ``fuzz`` command runs without: all but the first of
    those its own ``--case`` patterns ask for (so it still runs what it asks for), and every other."""
    asked = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--case"]
    wanted = [c for c in HEAVY_FUZZ_CASES if any(fnmatch.fnmatchcase(c, p) for p in asked)]
    return [c for c in HEAVY_FUZZ_CASES if c not in wanted[:1]]


def outputs(argv: Sequence[str]) -> list[str]:
    """The files the command writes, as paths relative to its working directory (``--out`` joined)."""
    files = _OUTPUTS.get(family(argv), ())
    out = None
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            out = argv[i + 1]
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
    if out is None:
        return []
    return [f"{out}/{name}" for name in files]
