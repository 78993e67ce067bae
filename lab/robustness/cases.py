"""The robustness table's cases: bad inputs and faults for every ``flashprobe`` command, each with the
exit code and the phrase a clean refusal gives, and what its directory holds before the command.

The table reuses the tests' own tables (:data:`tests.safety.test_bad_inputs.CASES` and the
parametrized cases of the safety, app, fuzz, bench and probe tests) and adds the cases of issue 42
(crafted reproducers, manifests and checkpoints, symlinked and non-UTF-8 paths, a full disk, a
read-only HOME, sizes and budgets past any machine, unknown launchers, kernels that raise or return
the wrong shape) and of issue 53 (paths set in config files, links and recorded settings in a run
directory, a kernel that turns the weights to NaN, config files Hydra cannot use, read-only disks,
files of another version, text with escape sequences). Cases that need a finished run copy one
prepared run (:class:`Prepared`). ``test_robustness.py`` runs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: How a case can end: clean (the expected exit code and phrase, nothing else wrong), a traceback, silent
#: (exit 0, or no message, where it should refuse), late (refused after work started: files written,
#: training begun, its time limit reached), writes-outside (a file outside its directory changed), or
#: mismatch (another exit code or message than the table expects, or raw escape sequences printed).
CLASSES = ("clean", "traceback", "silent", "late", "writes-outside", "mismatch")

#: the expected "exit code" of a command that keeps working until its time limit stops it (a long
#: search): clean when, by then, its output holds the expected phrase
RUNS_ON = -1

#: output that shows training started (a refusal after it is late)
TRAINING_STARTED = ("WeightSnapshot: saved", "`Trainer.fit` stopped", "| Name ")


@dataclass(frozen=True)
class Case:
    """One row of the table.

    Attributes:
        args: the arguments after ``flashprobe``; ``{name}`` placeholders are filled by the setup.
        expect: a phrase the output must contain ('' = any message).
        code: the exit code expected.
        setup: what the case's directory holds before the command (a key of :data:`SETUPS`).
        source: where the case comes from (a test file, or ``issue 42``).
        writes: the command may write into its own directory (it does work by design).
        env: extra environment variables (values may hold placeholders).
        timeout: seconds before the case is stopped (and classified late).
        cwd: where the command runs, inside the case's directory (a placeholder; default: there).
    """

    args: tuple[str, ...]
    expect: str = ""
    code: int = 2
    setup: str = "inputs"
    source: str = "issue 42"
    writes: bool = False
    env: tuple[tuple[str, str], ...] = ()
    timeout: float = 120.0
    cwd: str = ""

    @property
    def key(self) -> tuple:
        """Equal for the same command in the same situation (a directory with or without the shared
        bad-input files counts as the same)."""
        return (self.setup if self.setup not in ("empty", "inputs") else "", self.args, self.env)

    @property
    def command(self) -> str:
        """The command family: ``train``, ``bench tiles``, ... (``flashprobe`` alone: ``-``)."""
        if not self.args:
            return "-"
        return self.args[0] if self.args[0] != "bench" else " ".join(self.args[:2])


def _c(*args: str, expect: str = "", code: int = 2, setup: str = "inputs", **kw: Any) -> Case:
    return Case(tuple(args), expect, code, setup, **kw)


# ---------------------------------------------------------------------------------------------------
# the tests' own tables


def _parametrized(function: Callable) -> list[tuple]:
    """The argument values of a test's ``@pytest.mark.parametrize`` (the first mark with several
    names: its rows as tuples; a single name: its values as 1-tuples)."""
    for mark in getattr(function, "pytestmark", []):
        if mark.name == "parametrize":
            names, values = mark.args[0], mark.args[1]
            several = isinstance(names, (tuple, list)) or "," in names
            return [tuple(v) if several else (v,) for v in values]
    raise LookupError(f"{function.__name__} is not parametrized")


def _test_cases() -> list[Case]:
    """The bad inputs the tests already check, as CLI cases."""
    from tests.app import test_before_training, test_errors
    from tests.bench import test_output_dir, test_sweeps
    from tests.fuzz import test_cli as fuzz_cli
    from tests.safety import test_bad_inputs, test_manifest, test_outputs, test_paths, test_resume_is_data
    from tests.safety._runs import SHORT

    cases = [Case(tuple(a), p, source="tests/safety/test_bad_inputs.py") for a, p in test_bad_inputs.CASES]
    src = "tests/safety/test_paths.py"
    for args, needles in _parametrized(
        test_paths.test_train_refuses_paths_that_leave_the_run_before_any_write
    ):
        cases.append(Case(("train", "experiment=smoke", *args), needles[0], setup="empty", source=src))
    for (command,) in _parametrized(
        test_paths.test_an_empty_out_is_refused_not_taken_as_the_working_directory
    ):
        cases.append(Case(tuple(command), "empty", setup="empty", source=src))
    cases.append(_c("study", "--out", "study", "run_name=../../escaped", expect="cannot be used", source=src))
    src = "tests/app/test_errors.py"
    for setting, problem, _ in _parametrized(
        test_errors.test_a_refused_setting_is_one_paragraph_with_exit_code_2_before_training
    ):
        cases.append(
            Case(("train", *SHORT, setting, "hydra.run.dir=run"), problem, setup="empty", source=src)
        )
    src = "tests/app/test_before_training.py"
    for (key,) in _parametrized(
        test_before_training.test_a_cuda_only_kernel_on_the_cpu_is_refused_before_training
    ):
        cases.append(
            _c(
                "train",
                *SHORT,
                f"{key}=sdpa_cudnn",
                "hydra.run.dir=run",
                expect="runs on CUDA devices only",
                setup="empty",
                source=src,
            )
        )
    cases.append(
        _c(
            "train",
            *SHORT,
            "attention.probe.sites=[nosuch.*]",
            "hydra.run.dir=run",
            expect="matches no module of the model",
            setup="empty",
            source=src,
        )
    )
    cases.append(
        _c(
            "study",
            "--out",
            "study",
            "--runs",
            "flash,baseline",
            *_tiny_study(),
            "hydra/launcher=nosuch",
            expect="is not a Hydra launcher installed here",
            setup="empty",
            source=src,
        )
    )
    src = "tests/safety/test_resume_is_data.py"
    for vector in test_resume_is_data.VECTORS:
        cases.append(
            _c("train", "resume={run}", expect="data, never instructions", setup=f"evil:{vector}", source=src)
        )
    cases.append(
        _c(
            "train",
            "resume=.",
            expect="lies inside the run directory",
            setup="evil-conf",
            source=src,
            cwd="{run}",
        )
    )
    for line, reason in _parametrized(test_resume_is_data.test_each_refusal_says_what_the_override_would_do):
        cases.append(_c("train", "resume={run}", expect=reason, setup=f"recorded:{line}", source=src))
    src = "tests/safety/test_manifest.py"
    for (name,) in _parametrized(
        test_manifest.test_a_resume_never_deletes_a_file_a_manifest_entry_points_outside
    ):
        cases.append(
            _c(
                "train",
                "resume={run}",
                "trainer.max_steps=3",
                expect="is not a plain file name inside",
                setup=f"entry:{name}",
                source=src,
            )
        )
    for damage, message in _parametrized(
        test_manifest.test_a_damaged_run_is_refused_before_the_resume_writes
    ):
        phrase = message.replace("\\", "").split(".*")[0].strip()
        cases.append(
            _c(
                "train",
                "resume={run}",
                "trainer.max_steps=3",
                expect=phrase,
                setup=f"damage:{damage}",
                source=src,
            )
        )
    src = "tests/safety/test_outputs.py"
    for (mode,) in _parametrized(test_outputs.test_the_users_files_are_never_deleted_from_the_cli):
        cases.append(
            _c(
                "train",
                "experiment=smoke",
                "hydra.run.dir=proj",
                mode,
                expect="which no flashprobe run recorded as its own",
                setup="users-files",
                source=src,
            )
        )
    src = "tests/fuzz/test_cli.py"
    for argv, message in _parametrized(fuzz_cli.test_bad_arguments_fail_before_any_case_runs):
        cases.append(
            Case(("fuzz", "--kernel", "tiled", *argv, "--out", "out"), message, setup="empty", source=src)
        )
    src = "tests/bench/test_sweeps.py"
    for args, message in _parametrized(test_sweeps.test_tiles_bad_arguments):
        tiles = ("bench", "tiles", "--seq-len", "16", "--head-dim", "8", "--dtype", "fp32")
        cases.append(Case((*tiles, *args, "--out", "out"), message, setup="empty", source=src))
    src = "tests/bench/test_output_dir.py"
    for (command,) in _parametrized(test_output_dir.test_every_command_checks_out_first):
        cases.append(Case(("bench", command, "--out", "a_file"), "is a file", source=src))
    for (command,) in _parametrized(
        test_output_dir.test_a_shape_too_large_for_memory_is_refused_with_the_estimate
    ):
        shape = ("--batch", "1", "--heads", "4", "--seq-len", "10000000", "--head-dim", "64")
        cases.append(
            Case(("bench", command, *shape, "--out", "out"), "needs at least", setup="empty", source=src)
        )
    return cases


def _tiny_study() -> tuple[str, ...]:
    from tests.app._study import TINY

    return tuple(TINY)


# ---------------------------------------------------------------------------------------------------
# the cases issue 42 adds


def _repro_cases() -> list[Case]:
    """Crafted reproducers for ``replay`` and ``fuzz --from`` (the metadata table of the probe's tests
    and more)."""
    from tests.probing import test_repro_metadata

    src = "tests/probing/test_repro_metadata.py"
    commands = (("replay", "{repro}"), ("fuzz", "--from", "{repro}", "--out", "out"))
    t = test_repro_metadata
    tables = {
        "repro-meta": t.test_bad_metadata_is_refused_naming_the_field,
        "repro-call": t.test_tensors_that_are_not_one_attention_call_are_refused_before_any_kernel_runs,
    }
    cases = []
    for kind, test in tables.items():
        for i, (_, _, message) in enumerate(_parametrized(test)):
            phrase = message.split(".*")[0].replace("\\", "")
            cases += [_c(*args, expect=phrase, setup=f"{kind}:{i}", source=src) for args in commands]
    crafted = {  # setup → phrase
        "repro:pickle": "flashprobe does not unpickle files it is handed",
        "repro:text": "not a safetensors file",
        "repro:empty": "not a safetensors file",
        "repro:no-metadata": "not a flashprobe reproducer",
        "repro:metadata-not-json": "not a flashprobe reproducer",
        "repro:other-format": "of format 'flashprobe-repro-99'",
        "repro:no-k": "missing tensors ['k']",
        "repro:q-3d": "q must have shape (B, H, N, D)",
        "repro:head-dims": "head dims of q (16) and k (12) differ",
        "repro:int-tensors": "q must be floating point",
        "repro:baseline-nosuch": "recorded baseline 'nosuch_baseline'",
        "repro:primary-nosuch": "nosuch_primary",
        "repro:mask-shape": "attn_mask of shape (3, 5) does not broadcast",
        "repro:scale-nan": "scale is nan",
    }
    for setup, phrase in crafted.items():
        cases.append(_c("replay", "{repro}", expect=phrase, setup=setup))
        cases.append(_c("fuzz", "--from", "{repro}", "--out", "out", expect=phrase, setup=setup))
    cases += [
        _c("replay", "nowhere.safetensors", expect="no such file", setup="empty"),
        _c("replay", "a_file", expect="not a safetensors file"),
        _c("replay", "", expect="", setup="empty"),
        _c("replay", "{repro}", "--kernel", "nosuch", expect="unknown kernel 'nosuch'", setup="repro:ok"),
        _c("replay", "{repro}", "--baseline", "nosuch", expect="unknown kernel 'nosuch'", setup="repro:ok"),
        _c(
            "replay",
            "{repro}",
            "--import",
            "no_such_module_xyz",
            expect="no_such_module_xyz",
            setup="repro:ok",
        ),
        _c("fuzz", "--from", "nowhere.safetensors", "--out", "out", expect="no such file", setup="empty"),
        _c("fuzz", "--from", "a_file", "--out", "out", expect="not a safetensors file"),
        _c(
            "fuzz",
            "--from",
            "{repro}",
            "--kernel",
            "nosuch",
            "--out",
            "out",
            expect="unknown kernel 'nosuch'",
            setup="repro:ok",
        ),
        _c("fuzz", "--from", "{repro}", "--out", "a_file", expect="is a file", setup="repro:ok-and-file"),
    ]
    # kernels that crash or return the wrong shape or dtype: the gate must not pass them (item 3)
    bugs = ("bug_raising", "bug_wrong_shape", "bug_wrong_dtype")
    for bug in bugs:
        from_file = ("fuzz", "--from", "{repro}", "--import", "bugs", "--kernel", bug, "--out", "out")
        cases.append(_c(*from_file, expect=f"{bug}: ERROR", code=1, setup="bugs", writes=True))
    for bug in bugs:
        cases.append(
            _c("replay", "{repro}", "--import", "bugs", "--kernel", bug, expect=bug, code=1, setup="bugs")
        )
    one_case = ("--case", "sentinel_1e4", "--dtype", "fp32", "--no-backward", "--out", "out")
    for bug in bugs[:2]:
        fuzz = ("fuzz", "--import", "bugs", "--kernel", bug, *one_case)
        cases.append(_c(*fuzz, expect=bug, code=1, setup="bugs", writes=True))
    return cases


def _fuzz_cases() -> list[Case]:
    fz = ("fuzz", "--kernel", "math")
    return [
        _c(  # not a refusal: the search runs, saying up front how long it would take
            *fz,
            "--budget",
            "1000000000",
            "--no-catalogue",
            "--out",
            "out",
            expect="/1000000000] random_000",
            code=RUNS_ON,
            setup="empty",
            writes=True,
            timeout=60,
        ),
        _c(*fz, "--seeds", "0", "--out", "out", expect="--seeds", setup="empty"),
        _c(*fz, "--profile", "nosuch", "--out", "out", expect="nosuch", setup="empty"),
        _c(*fz, "--case", "no_case_matches_*", "--out", "out", expect="no_case_matches_*", setup="empty"),
        _c(*fz, "--device", "cuda", "--out", "out", expect="cuda", setup="empty"),
        _c("fuzz", "--kernel", "tiled:block_q=0", "--out", "out", expect="block_q", setup="empty"),
        _c("fuzz", "--kernel", "tiled:nosuch=1", "--out", "out", expect="nosuch", setup="empty"),
        _c("fuzz", "--kernel", "tiled:dtype=int8", "--out", "out", expect="int8", setup="empty"),
        _c("fuzz", "--kernel", "", "--out", "out", expect="", setup="empty"),
        _c("fuzz", "--kernel", "sdpa_cudnn", "--out", "out", expect="CUDA", setup="empty", code=2),
        _c(*fz, "--out", "/etc", expect="system directory", setup="empty"),
        _c(*fz, "--out", "{home}", expect="home directory", setup="empty"),
        _c(*fz, "--out", "link_to_root", expect="system directory", setup="link-to-root"),
    ]


def _bench_cases() -> list[Case]:
    shape = ("--batch", "1", "--heads", "4", "--seq-len", "10000000", "--head-dim", "64")
    cases = []
    for sub in ("precision", "seqlen", "tiles", "speed", "bias"):
        cases += [
            _c("bench", sub, "--seq-len", "0", "--out", "out", expect="seq", setup="empty"),
            _c("bench", sub, "--device", "nosuch", "--out", "out", expect="nosuch", setup="empty"),
            _c("bench", sub, "--out", "/usr", expect="system directory", setup="empty"),
        ]
    for sub in ("tiles", "speed", "bias"):
        cases.append(_c("bench", sub, *shape, "--out", "out", expect="needs at least", setup="empty"))
    cases += [
        _c(
            "bench",
            "bias",
            "--kernel",
            "nosuch",
            "--out",
            "out",
            expect="unknown kernel 'nosuch'",
            setup="empty",
        ),
        _c("bench", "speed", "--dtype", "nosuch", "--out", "out", expect="nosuch", setup="empty"),
        _c("bench", "precision", "--device", "cuda", "--out", "out", expect="cuda", setup="empty"),
        _c(
            "bench",
            "precision",
            "--replot",
            "--out",
            "out",
            expect="precision.json",
            setup="bench-json:precision:garbage",
        ),
        _c("bench", "tiles", "--replot", "--out", "out", expect="tiles.json", setup="bench-json:tiles:list"),
        _c("bench", "seqlen", "--replot", "--out", "out", expect="", setup="empty"),
        _c("bench", "fp8", "--seq-len", "10000000", "--out", "out", expect="needs at least", setup="empty"),
        _c("bench", "fp8", "--head-dim", "0", "--out", "out", expect="head", setup="empty"),
        _c("bench", "paper", "--device", "nosuch", "--out", "out", expect="nosuch", setup="empty"),
        _c("bench", "overhead", "--steps", "0", "--out", "out", expect="steps", setup="empty"),
        _c("bench", "overhead", "--seq-len", "10000000", "--out", "out", expect="", setup="empty"),
        _c("bench", "wasserstein", "--sizes", "0", "--out", "out", expect="removed", setup="empty"),
        _c(
            "bench", "wasserstein", "--sizes", "100000000000", "--out", "out", expect="removed", setup="empty"
        ),
        _c("bench", "verdicts", "--models", "nosuch", "--out", "out", expect="nosuch", setup="empty"),
        _c("bench", "rules", "--mutants", "nosuch", "--out", "out", expect="lab.rules", setup="empty"),
    ]
    return cases


def _train_cases() -> list[Case]:
    from tests.safety._runs import SHORT

    t = ("train", *SHORT, "hydra.run.dir=run")
    return [
        _c(*t, "attention.kernel=flash_attn", expect="flash_attn", setup="empty"),
        _c(*t, "attention=flash_attn", expect="flash_attn", setup="empty"),
        _c(*t, "attention.probe.primary=sdpa_cudnn", expect="runs on CUDA devices only", setup="empty"),
        _c(*t, "attention.kernel=sdpa_flash", "trainer.accelerator=gpu", expect="", setup="empty"),
        _c(*t, "attention.probe.sites=[]", expect="sites", setup="empty"),
        _c(*t, "attention.kernel='tiled:block_q=0'", expect="block_q", setup="empty"),
        _c(*t, "attention.kernel='tiled:dtype=int8'", expect="int8", setup="empty"),
        _c(*t, "data.batch_size=1000000000", expect="data.batch_size", setup="empty"),
        _c(*t, "+trainer.nosuch=1", expect="nosuch", setup="empty"),
        _c(*t, "ckpt_path={crafted}", expect="refused", setup="crafted-ckpt"),
        _c(*t, "ckpt_path={pickle}", expect="refused", setup="crafted-ckpt"),
        _c("train", "resume={run}", expect="refused", setup="run:crafted-last"),
        _c("train", "resume={run}", expect="", setup="run:truncated-last"),
        _c("train", "resume={run}", "trainer.max_steps=1", expect="max_steps", setup="run"),
        _c("train", "resume={run}", expect="run.json", setup="run:run-json-list"),
        _c("train", "resume={run}", expect="overrides.yaml", setup="run:overrides-garbage"),
        _c("train", "resume={run}", expect="overrides.yaml", setup="run:overrides-mapping"),
        _c(
            "train", "resume={run}", expect="", code=0, writes=True, setup="run:no-checkpoints"
        ),  # trains again
        _c(  # a finished run: skipped, nothing built, its .hydra record kept (the test checks the bytes)
            "train",
            "resume={run}",
            "+callbacks.evil._target_=builtins.open",
            expect="skipping the run",
            code=0,
            setup="run",
        ),
        _c("train", "resume={run}", "trainer.max_steps=3", expect="", setup="run:linked-checkpoint"),
        _c("train", "resume={run}", "trainer.max_steps=3", expect="", setup="run:linked-manifest"),
        _c(*t[:-1], "hydra.run.dir=/", expect="system directory", setup="empty"),
        _c(*t[:-1], "hydra.run.dir=/etc/flashprobe", expect="inside the system's /etc", setup="empty"),
        _c(*t[:-1], "hydra.run.dir=link_to_root", expect="system directory", setup="link-to-root"),
        _c(*t[:-1], "hydra.run.dir={home}", expect="home directory", setup="empty"),
        # faults inside training: a clear message and exit 1, the run recording why
        _c(
            *t,
            "trainer.max_steps=3",
            "module.optimizer.lr=1e30",
            expect="training stopped",
            code=1,
            setup="empty",
            writes=True,
        ),
        _c(*t[:-1], "hydra.run.dir={disk}/run", expect="full", code=2, setup="full-disk"),
        _c(
            *t,
            "logger=default",
            expect="not writable",
            code=0,
            setup="read-only-home",
            writes=True,
            env=(("HOME", "{home_ro}"),),
        ),
        _c(*t[:-1], "hydra.run.dir={nonutf8}", expect="is not a valid override", setup="nonutf8"),
    ]


def _study_cases() -> list[Case]:
    s = ("study", "--out", "study", "--runs", "flash,baseline", *_tiny_study())
    return [
        _c("study", "--out", "study", "--runs", "", expect="form no like-for-like", setup="empty"),
        _c(*s, "study.replicates=0", expect="replicates", setup="empty"),
        _c(*s, "study.kernel=sdpa_cudnn", expect="CUDA", setup="empty"),
        _c(*s, "study.kernel=flash_attn", expect="flash_attn", setup="empty"),
        _c(*s, "attention.probe.sites=[nosuch.*]", expect="matches no module", setup="empty"),
        _c(*s, "hydra/launcher=submitit_nosuch", expect="submitit_nosuch", setup="empty"),
        _c("study", "--out", "/", "--runs", "flash,baseline", expect="system directory", setup="empty"),
        _c(
            "study",
            "--out",
            "link_to_root",
            "--runs",
            "flash,baseline",
            expect="system directory",
            setup="link-to-root",
        ),
        _c("study", "--out", "{home}", "--runs", "flash,baseline", expect="home directory", setup="empty"),
        _c("study", "--out", "users", "--runs", "flash,baseline", expect="did not write", setup="users-dir"),
        _c("study", "--out", "study", "--config-dir", "a_file", expect="not a directory"),
        _c(
            "study",
            "--out",
            "{disk}/study",
            "--runs",
            "flash,baseline",
            *_tiny_study(),
            expect="full",
            setup="full-disk",
        ),
        _c("study", "--out", "study", "--compare-only", expect="", setup="study-garbage"),
    ]


def _compare_report_cases() -> list[Case]:
    cmp = ("compare", "{a}", "{b}", "--out", "cmp", "--no-figures")
    return [
        _c(*cmp, expect="", setup="pair:tensor-names", writes=False),
        _c(*cmp, expect="", setup="pair:no-common-step"),
        _c(*cmp, expect="cannot be read", setup="pair:truncated-snapshot"),
        _c(*cmp, expect="", setup="pair:pickle-snapshot"),
        _c(*cmp, expect="", setup="pair:negative-step"),
        _c(*cmp, expect="is a link to", setup="pair:linked-snapshot"),
        _c(*cmp, expect="snapshots directory", setup="pair:linked-directory"),
        _c(*cmp, expect="", setup="pair:linked-manifest"),
        _c("compare", "{a}", "{a}", "--out", "cmp", expect="", setup="pair"),
        _c("compare", "{a}", "{b}", "--out", "/etc", expect="system directory", setup="pair"),
        _c("compare", "{a}", "{b}", "--out", "{home}", expect="home directory", setup="pair"),
        _c(
            "compare",
            "{a}",
            "{b}",
            "--out",
            "link_to_root",
            expect="system directory",
            setup="pair:link-to-root",
        ),
        _c("compare", "{a}", "{b}", "--out", "users", expect="did not write", setup="pair:users-dir"),
        _c("compare", "--pair", "x=nowhere,elsewhere", "--out", "cmp", expect="nowhere", setup="empty"),
        _c("compare", "{a}", "{b}", "--out", "{disk}/cmp", expect="full", code=1, setup="pair:full-disk"),
        _c(*cmp, expect="", code=4, setup="pair:nonutf8", writes=True),  # a seed pair alone: UNDETERMINED
        _c("report", "{study}", expect="study.json", setup="study:garbage"),
        _c("report", "{study}", expect="study.json", setup="study:list"),
        _c("report", "{study}", expect="study.json", setup="study:other-format"),
        _c("report", "{study}", expect="study.json", setup="study:no-pairs"),
        _c("report", "{study}", "--figures", expect="", setup="study:nan-distances", code=4, writes=True),
        _c("report", "{study}", expect="full", code=1, setup="study:full-disk"),
        _c("report", "{study}", expect="", code=4, setup="study:nonutf8", writes=True),  # no kernel pair
        _c("report", "{run}", expect="probe.jsonl", setup="run:probe-garbage"),
        _c("report", "{run}", expect="probe.jsonl", setup="run:probe-list-lines"),
        _c("report", "{run}", expect="", code=0, setup="run:probe-torn-last-line", writes=True),
        _c("report", "/", expect="", setup="empty"),
        _c("report", "link_to_root", expect="", setup="link-to-root"),
    ]


def _other_cases() -> list[Case]:
    return [
        _c("kernels", "--import", "no_such_module_xyz", expect="no_such_module_xyz", setup="empty"),
        _c("--version", expect="flashprobe", code=0, setup="empty"),
        _c(expect="commands:", setup="empty"),
    ]


#: A run whose kernel returns NaN from step 3 on (``tests/app/_nan_kernel.py``, a user's module).
NAN_RUN = (
    "train",
    "--import",
    "tests.app._nan_kernel",
    "experiment=smoke",
    "trainer.max_steps=8",
    "trainer.val_check_interval=1",
    "trainer.log_every_n_steps=1",
    "callbacks.weight_snapshot.every_n_steps=1",
    "attention.kernel=nan_at_step",
)

#: issue 53's config files (``conf/experiment/<name>.yaml``): what each sets, and the phrase of its refusal
CONFIG_FILES = {
    "foreign_run_dir": (
        "hydra:\n  run:\n    dir: {sentinel}\n",
        "holds files flashprobe did not write there (keep.txt)",
    ),
    "run_dir_outside": ("run_dir: {sentinel}/run\n", "not the run's directory"),
    "dirpath_outside": (
        "callbacks:\n  checkpoint:\n    dirpath: {sentinel}/checkpoints\n",
        "lies outside the run directory",
    ),
    "save_dir_outside": ("logger:\n  csv:\n    save_dir: {sentinel}/csv\n", "lies outside the run directory"),
    "syntax": ("foo: [1, 2\n", "not valid YAML"),
    "loop": (None, "includes itself"),
    "list": (None, "holds a YAML list, not settings"),
    "bytes": (None, "is not UTF-8 text"),
}

#: issue 53's links planted in a copied run (``NAME:symbolic|hard:file|directory``; the target is the
#: sentinel directory or its file): a resume must refuse them before it writes
LINKS = (
    ".flashprobe.lock:symbolic:file",
    ".flashprobe.lock:hard:file",
    ".hydra/config.yaml:symbolic:file",
    "train.log:symbolic:file",
    "train.log:hard:file",
    ".hydra:symbolic:directory",
    "csv:symbolic:directory",
    "probe.jsonl:symbolic:file",
    "probe.jsonl:hard:file",
    "snapshots:symbolic:directory",
    "checkpoints:symbolic:directory",
)

#: issue 53's recorded settings that would write outside the run (appended to .hydra/overrides.yaml)
RECORDED_PATHS = {
    "logger.csv.save_dir={sentinel}/csv": "logger.csv.save_dir (recorded in",
    "+trainer.default_root_dir={sentinel}/root": "trainer.default_root_dir (recorded in",
    "logger.csv.name=../../escaped": "logger.csv.name='../../escaped' (recorded in",
    "callbacks.weight_snapshot.dirpath={sentinel}/snapshots": "weight_snapshot.dirpath (recorded in",
}


def _issue53_cases() -> list[Case]:
    """Paths set in config files, links and recorded settings in a run, a NaN kernel, config files Hydra
    cannot use, read-only disks, another version's files, escape sequences, non-UTF-8 names."""
    src, t = "issue 53", ("train", "experiment=smoke", "trainer.max_steps=2")
    cases = []
    for name, (_, phrase) in CONFIG_FILES.items():
        run = () if name == "foreign_run_dir" else ("hydra.run.dir=run",)
        cases += [
            _c("train", f"experiment={name}", *run, expect=phrase, setup="conf", source=src),
            _c("train", "--config-dir", "mycfg", f"experiment={name}", *run, expect=phrase, setup="conf"),
            _c(
                "train",
                f"experiment={name}",
                *run,
                expect=phrase,
                setup="conf",
                source=src,
                env=(("FLASHPROBE_CONFIG_DIR", "{case}/mycfg"),),
                cwd="{case}/elsewhere",
            ),
        ]
    env_file = (("FLASHPROBE_CONFIG_DIR", "{case}/a_file"),)
    cases += [
        _c(*t, "hydra.run.dir=run", expect="is not a directory (a file)", env=env_file, source=src),
        _c("study", "--out", "s", expect="is not a directory (a file)", env=env_file, source=src),
    ]
    resume = ("train", "resume={run}", "trainer.max_steps=3")
    cases += [_c(*resume, expect=f"{link.split(':')[0]} is a", setup=f"links:{link}") for link in LINKS]
    cases += [_c(*resume, expect=phrase, setup=f"recorded-path:{s}") for s, phrase in RECORDED_PATHS.items()]
    cases += [
        _c(
            *NAN_RUN,
            "hydra.run.dir=run",
            expect="the last finite weights",
            code=1,
            writes=True,
            setup="empty",
        ),
        _c("train", "resume={run}", expect="give it again: flashprobe train --import", setup="nan-run"),
        _c(
            "train",
            "--import",
            "tests.app._nan_kernel",
            "resume={run}",
            code=0,
            writes=True,
            setup="nan-run",
            env=(("NAN_AT_STEP", "1000"),),
        ),
        _c("report", "{run}", expect="is not writable (Read-only file system)", setup="read-only-run"),
        _c(*resume, expect="is not writable (Read-only file system)", setup="read-only-run"),
        _c(*resume, expect="written by flashprobe 9.0, in format 'flashprobe.run/9'", setup="run:version-9"),
        _c(*resume, code=0, writes=True, setup="run:stale-last"),
        _c("replay", "{repro}", expect="", code=0, setup="repro:escapes"),
        _c("replay", "{repro}", expect="", code=0, setup="repro:ok-nonutf8"),
        _c("study", "--out", "{nonutf8}", expect="holds bytes that are not UTF-8", setup="nonutf8"),
        _c("study", "--out", "/proc/x", expect="inside the system's /proc", setup="empty"),
        _c(
            "train",
            "-m",
            "--config-dir",
            "mycfg",
            "experiment=foreign_run_dir",
            expect="holds files flashprobe did not write there",
            setup="conf",
        ),
    ]
    return [replace(c, source=src) for c in cases]


def all_cases() -> list[Case]:
    """The table: the tests' cases and issue 42's, each distinct (the first of equal ones kept)."""
    found: dict[tuple, Case] = {}
    for case in [
        *_test_cases(),
        *_repro_cases(),
        *_fuzz_cases(),
        *_bench_cases(),
        *_train_cases(),
        *_study_cases(),
        *_compare_report_cases(),
        *_other_cases(),
        *_issue53_cases(),
    ]:
        found.setdefault(case.key, case)
    return list(found.values())


# ---------------------------------------------------------------------------------------------------
# what the cases' directories hold


class Prepared:
    """What several cases copy, made once: a finished 2-step run (``flashprobe train``, so it records
    its overrides as a CLI run does), two snapshot-only runs and their comparison (a ``study.json``)."""

    def __init__(self, where: Path, env: dict[str, str]) -> None:
        self.where, self.env = where, env
        self._run: Path | None = None
        self._nan_run: Path | None = None
        self._study: Path | None = None

    @property
    def run(self) -> Path:
        if self._run is None:
            from tests.safety._runs import SHORT

            run = self.where / "run"
            ran = flashprobe(["train", *SHORT, f"hydra.run.dir={run}"], self.where, self.env, 600)
            if ran.returncode != 0:
                raise RuntimeError(f"the prepared run failed:\n{ran.output[-3000:]}")
            self._run = run
        return self._run

    @property
    def nan_run(self) -> Path:
        """A run of the kernel that turns NaN at step 3 (``tests/app/_nan_kernel.py``), stopped there."""
        if self._nan_run is None:
            run = self.where / "nan_run"
            ran = flashprobe([*NAN_RUN, f"hydra.run.dir={run}"], self.where, self.env, 600)
            if ran.returncode != 1:
                raise RuntimeError(f"the prepared NaN run did not stop with exit 1:\n{ran.output[-3000:]}")
            self._nan_run = run
        return self._nan_run

    @property
    def study(self) -> Path:
        if self._study is None:
            a, b = _write_pair(self.where / "pair")
            out = self.where / "study"
            ran = flashprobe(["compare", str(a), str(b), "--out", str(out)], self.where, self.env, 600)
            if ran.returncode != 4:  # two seeds, no kernel pair: UNDETERMINED, as study exits
                raise RuntimeError(f"the prepared comparison failed:\n{ran.output[-3000:]}")
            self._study = out
        return self._study


def _write_pair(where: Path, *, b_name: str = "b") -> tuple[Path, Path]:
    """Two snapshot-only runs (tests.app.test_paths' weights): ``where/a`` and ``where/<b_name>``."""
    from tests.app.test_paths import OTHER, WEIGHTS
    from tests.weights._helpers import write_run

    return write_run(where / "a", WEIGHTS, seed=0), write_run(where / b_name, OTHER, seed=1)


def _mount_tmpfs(where: Path, kib: int, *, read_only: bool = False) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={kib}k" + (",ro" if read_only else "")
    cmd = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _fill(disk: Path) -> None:
    """Fill ``disk`` to the last byte."""
    for name, chunk in (("filler", 65536), ("filler2", 1)):
        with open(disk / name, "wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * chunk)


class SkipCaseError(Exception):
    """The case cannot be set up on this machine (e.g. no tmpfs can be mounted)."""


def _yaml_str(text: str) -> str:
    from tests.safety.test_resume_is_data import _yaml_str

    return _yaml_str(text)


def _targets(d: Path) -> dict[str, Path]:
    """An attacker's payload (an .npy that creates ``marker`` when unpickled) and a file outside the run,
    as tests/safety/test_resume_is_data.py's ``targets``."""
    import numpy as np

    from tests.safety._runs import CreatesFile

    marker, outside = d / "marker", d / "outside.txt"
    outside.write_text("the user's own file\n")
    payload = d / "evil.npy"
    np.save(payload, np.array([CreatesFile(marker)], dtype=object), allow_pickle=True)
    return {"marker": marker, "outside": outside, "payload": payload}


def _copy_run(prepared: Prepared, d: Path) -> Path:
    return Path(shutil.copytree(prepared.run, d / "run", symlinks=True))


def _damage_run(run: Path, d: Path, damage: str) -> None:
    from tests.safety._runs import write_crafted_checkpoint

    last = run / "checkpoints" / "last.ckpt"
    if damage == "crafted-last":
        write_crafted_checkpoint(last, d / "marker")
    elif damage == "truncated-last":
        last.write_bytes(last.read_bytes()[:100])
    elif damage == "run-json-list":
        (run / "run.json").write_text("[1, 2]")
    elif damage == "overrides-garbage":
        (run / ".hydra" / "overrides.yaml").write_text("{{{: [\n")
    elif damage == "overrides-mapping":
        (run / ".hydra" / "overrides.yaml").write_text("a: 1\n")
    elif damage == "no-checkpoints":
        shutil.rmtree(run / "checkpoints")
    elif damage in ("linked-checkpoint", "linked-manifest"):
        path = last if damage == "linked-checkpoint" else run / "snapshots" / "manifest.json"
        outside = d / ("outside" + path.suffix)
        shutil.copyfile(path, outside)
        path.unlink()
        path.symlink_to(outside)
    elif damage == "probe-garbage":
        (run / "probe.jsonl").write_text("garbage\n")
    elif damage == "probe-list-lines":
        (run / "probe.jsonl").write_text("[1, 2]\n[3]\n")
    elif damage == "version-9":  # a record of a later flashprobe
        record = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(
            json.dumps({**record, "format": "flashprobe.run/9", "flashprobe": "9.0"})
        )
    elif damage == "stale-last":  # a copied run's last.ckpt older than its newest checkpoint
        shutil.copyfile(run / "checkpoints" / "step0000001.ckpt", run / "checkpoints" / "last.ckpt")
    elif damage == "probe-torn-last-line":
        with open(run / "probe.jsonl", "a") as fh:
            fh.write('{"step": 9, "ver')
    else:
        raise KeyError(damage)


def _write_repro(d: Path, kind: str) -> Path:
    """A reproducer, valid (``ok``) or crafted as ``kind`` says."""
    import pickle

    import torch
    from safetensors.torch import save_file

    from flashprobe.formats.reproducer import REPRO_FORMAT
    from tests.probing.test_repro_metadata import _write
    from tests.safety._runs import CreatesFile

    path = d / "call.safetensors"
    x = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(0))
    info: dict[str, Any] = {"format": REPRO_FORMAT, "is_causal": False, "primary": "math", "baseline": "math"}
    if kind in ("ok", "ok-and-file", "escapes", "ok-nonutf8"):
        if kind == "escapes":  # a crafted reproducer whose text would clear the screen and ring the bell
            info = {**info, "reason": "\x1b[2J\x1b[31mcleared\x07\r", "site": "\x9b1m"}
        if kind == "ok-nonutf8":
            path = d / os.fsdecode(b"repro\xfe") / "call.safetensors"
            path.parent.mkdir()
        _write(path, info)
        if kind == "ok-and-file":
            (d / "a_file").write_text("x")
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"q": CreatesFile(d / "marker")}))
    elif kind == "text":
        path.write_text("not a reproducer\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "no-metadata":
        save_file({"q": x, "k": x.clone(), "v": x.clone()}, str(path))
    elif kind == "metadata-not-json":
        save_file({"q": x, "k": x.clone(), "v": x.clone()}, str(path), metadata={"flashprobe": "{not json"})
    elif kind == "other-format":
        _write(path, {"format": "flashprobe-repro-99"})
    elif kind == "no-k":
        save_file({"q": x, "v": x.clone()}, str(path), metadata={"flashprobe": json.dumps(info)})
    elif kind == "q-3d":
        _write(path, info, q=torch.randn(2, 8, 16))
    elif kind == "head-dims":
        _write(path, info, k=torch.randn(1, 2, 8, 12))
    elif kind == "int-tensors":
        ints = torch.ones(1, 2, 8, 16, dtype=torch.int32)
        _write(path, info, q=ints, k=ints.clone(), v=ints.clone())
    elif kind == "baseline-nosuch":
        _write(path, {**info, "baseline": "nosuch_baseline"})
    elif kind == "primary-nosuch":
        _write(path, {**info, "primary": "nosuch_primary"})
    elif kind == "mask-shape":
        _write(path, info, attn_mask=torch.ones(3, 5, dtype=torch.bool))
    elif kind == "scale-nan":
        _write(path, {**info, "scale": float("nan")})
    else:
        raise KeyError(kind)
    return path


_BUGS = '''"""Kernels that crash or return the wrong shape or dtype (tests/fuzz/test_cli.py's), registered."""
from flashprobe import register_kernel
from tests.fuzz.test_cli import _raising, _wrong_dtype, _wrong_shape

register_kernel("bug_raising", _raising, overwrite=True)
register_kernel("bug_wrong_shape", _wrong_shape, overwrite=True)
register_kernel("bug_wrong_dtype", _wrong_dtype, overwrite=True)
'''


def _write_config_files(d: Path, sentinel: Path) -> None:
    """issue 53's config files (:data:`CONFIG_FILES`) in ``d/conf`` (found from ``d``), ``d/mycfg``
    (given with ``--config-dir`` or ``$FLASHPROBE_CONFIG_DIR``), and ``d/elsewhere`` to run from."""
    head = "# @package _global_\ndefaults:\n  - smoke\n"
    bodies = {
        "loop": b"# @package _global_\ndefaults:\n  - loop\n",
        "list": b"- a\n- b\n",
        "bytes": head.encode() + b'foo: "\xff\xfe"\n',
    }
    for root in (d / "conf", d / "mycfg"):
        (root / "experiment").mkdir(parents=True)
        for name, (text, _) in CONFIG_FILES.items():
            data = bodies.get(name) or (head + text.format(sentinel=sentinel)).encode()
            (root / "experiment" / f"{name}.yaml").write_bytes(data)
    (d / "elsewhere").mkdir()


def _plant_link(run: Path, sentinel: Path, name: str, kind: str, target: str) -> None:
    """Replace ``run/name`` by a symbolic or hard link to the sentinel directory or its file."""
    path = run / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    pointed = sentinel if target == "directory" else sentinel / "keep.txt"
    if kind == "hard":
        os.link(pointed, path)
    else:
        path.symlink_to(pointed, target_is_directory=pointed.is_dir())


def _write_pair_variant(d: Path, variant: str) -> dict[str, str]:
    import torch

    from tests.app.test_paths import OTHER, WEIGHTS
    from tests.safety._runs import CreatesFile
    from tests.weights._helpers import write_run

    b_name = os.fsdecode(b"run\xff") if variant == "nonutf8" else "b"
    a = write_run(d / "a", WEIGHTS, seed=0)
    other = {
        "tensor-names": {s: {"u": t["w"]} for s, t in OTHER.items()},
        "no-common-step": {s + 1: t for s, t in OTHER.items()},
        "shape-mismatch": {s: {"w": torch.zeros(5)} for s in OTHER},
    }.get(variant, OTHER)
    b = write_run(d / b_name, other, seed=1)
    snapshot = b / "snapshots" / "step_0000002.safetensors"
    manifest = b / "snapshots" / "manifest.json"
    if variant == "truncated-snapshot":
        snapshot.write_bytes(snapshot.read_bytes()[:100])
    elif variant == "pickle-snapshot":
        import pickle

        snapshot.write_bytes(pickle.dumps(CreatesFile(d / "marker")))
    elif variant == "negative-step":
        data = json.loads(manifest.read_text())
        data["snapshots"][0]["step"] = -1
        manifest.write_text(json.dumps(data))
    elif variant == "linked-snapshot":
        snapshot.unlink()
        snapshot.symlink_to(a / "snapshots" / "step_0000002.safetensors")
    elif variant == "linked-directory":
        (b / "snapshots").rename(d / "elsewhere")
        (b / "snapshots").symlink_to(d / "elsewhere")
    elif variant == "linked-manifest":
        shutil.copyfile(manifest, d / "manifest.json")
        manifest.unlink()
        manifest.symlink_to(d / "manifest.json")
    return {"a": str(a), "b": str(b)}


def _damage_study(study: Path, damage: str) -> None:
    path = study / "study.json"
    if damage == "garbage":
        path.write_text('{"format": "flashprobe.stu')
    elif damage == "list":
        path.write_text("[1, 2]")
    elif damage == "other-format":
        path.write_text(json.dumps({**json.loads(path.read_text()), "format": "nosuch/9"}))
    elif damage == "no-pairs":
        data = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in data.items() if k != "pairs"}))
    elif damage == "nan-distances":
        path.write_text(path.read_text().replace(": 2.0", ": NaN").replace(": 1.0", ": Infinity"))
    else:
        raise KeyError(damage)


#: every setup kind (``kind`` or ``kind:argument``) → the placeholders it fills
SETUP_KINDS: dict[str, frozenset[str]] = {
    "empty": frozenset(),
    "inputs": frozenset(),
    "link-to-root": frozenset(),
    "users-dir": frozenset(),
    "users-files": frozenset(),
    "run": frozenset({"run"}),
    "crafted-ckpt": frozenset({"crafted", "pickle"}),
    "evil": frozenset({"run"}),
    "evil-conf": frozenset({"run"}),
    "recorded": frozenset({"run"}),
    "entry": frozenset({"run"}),
    "damage": frozenset({"run"}),
    "repro-meta": frozenset({"repro"}),
    "repro-call": frozenset({"repro"}),
    "repro": frozenset({"repro"}),
    "bugs": frozenset({"repro"}),
    "bench-json": frozenset(),
    "pair": frozenset({"a", "b", "disk"}),
    "study": frozenset({"study"}),
    "study-garbage": frozenset(),
    "full-disk": frozenset({"disk"}),
    "read-only-home": frozenset({"home_ro"}),
    "nonutf8": frozenset({"nonutf8"}),
    "conf": frozenset(),
    "links": frozenset({"run"}),
    "recorded-path": frozenset({"run"}),
    "nan-run": frozenset({"run"}),
    "read-only-run": frozenset({"run"}),
}

#: placeholders every case may use: the case's own directory, the shared sentinel directory, HOME
GLOBAL_PLACEHOLDERS = frozenset({"case", "sentinel", "home"})


@contextlib.contextmanager
def setup(name: str, d: Path, prepared: Prepared, sentinel: Path) -> Iterator[dict[str, str]]:
    """Prepare the case directory ``d`` as the setup ``name`` says; yields the placeholders it fills
    (``sentinel``: the directory no case may write into, which issue 53's setups point their paths and
    links at).

    Raises:
        SkipCaseError: the setup needs what this machine does not allow (mounting a tmpfs).
    """
    kind, _, arg = name.partition(":")
    if kind not in SETUP_KINDS:
        raise KeyError(f"unknown setup {name!r}")
    values: dict[str, str] = {}
    mounts: list[Path] = []

    def disk(where: Path, kib: int = 256, *, read_only: bool = False) -> Path:
        if not _mount_tmpfs(where, kib, read_only=read_only):
            raise SkipCaseError("cannot mount a tmpfs here (not root?)")
        mounts.append(where)
        return where

    try:
        if kind == "empty":
            pass
        elif kind == "inputs":
            from tests.safety.test_bad_inputs import _inputs

            _inputs(d)
        elif kind == "link-to-root":
            (d / "link_to_root").symlink_to("/")
        elif kind == "users-dir":
            (d / "users").mkdir()
            (d / "users" / "notes.txt").write_text("keep")
        elif kind == "users-files":
            from tests.safety.test_outputs import _users_files

            _users_files(d / "proj")
        elif kind == "run":
            values["run"] = str(run := _copy_run(prepared, d))
            if arg:
                _damage_run(run, d, arg)
        elif kind == "crafted-ckpt":
            from tests.safety._runs import write_crafted_checkpoint, write_crafted_pickle

            values["crafted"] = str(write_crafted_checkpoint(d / "x.ckpt", d / "marker"))
            values["pickle"] = str(write_crafted_pickle(d / "p.ckpt", d / "marker"))
        elif kind in ("evil", "evil-conf"):
            from tests.safety.test_resume_is_data import _evil_run, _vectors

            targets = _targets(d)
            lines = _vectors(targets, d)[arg] if kind == "evil" else []
            run = _evil_run(prepared.run, d, lines)
            if kind == "evil":
                (run / "cfg" / "callbacks").mkdir(parents=True)
                (run / "cfg" / "callbacks" / "evil.yaml").write_text(
                    f"evil:\n  _target_: builtins.open\n  file: {targets['outside']}\n  mode: w\n"
                )
            else:
                (run / "conf" / "experiment").mkdir(parents=True)
                (run / "conf" / "experiment" / "smoke.yaml").write_text(
                    f"# @package _global_\ncallbacks:\n  evil:\n    _target_: builtins.open\n"
                    f"    file: {targets['outside']}\n    mode: w\n"
                )
            values["run"] = str(run)
        elif kind == "recorded":
            from tests.safety._runs import SHORT

            run = _copy_run(prepared, d)
            text = "".join(f"- {_yaml_str(o)}\n" for o in [*SHORT, arg])
            (run / ".hydra" / "overrides.yaml").write_text(text)
            values["run"] = str(run)
        elif kind == "entry":
            from tests.safety.test_manifest import _add_entry

            run = _copy_run(prepared, d)
            victim = d / "victim.txt"
            victim.write_text("the user's file")
            _add_entry(run, {"step": 999, "file": str(victim) if arg == "absolute" else arg})
            values["run"] = str(run)
        elif kind == "damage":
            from tests.safety.test_manifest import damage_run

            damage_run(run := _copy_run(prepared, d), arg)
            values["run"] = str(run)
        elif kind == "repro-meta":
            from flashprobe.formats.reproducer import REPRO_FORMAT
            from tests.probing import test_repro_metadata as t

            info, tensors, _ = _parametrized(t.test_bad_metadata_is_refused_naming_the_field)[int(arg)]
            if isinstance(info, dict):
                info = {"format": REPRO_FORMAT, **info}
            values["repro"] = str(t._write(d / "bad.safetensors", info, **tensors))
        elif kind == "repro-call":
            from tests.probing import test_repro_metadata as t

            test = t.test_tensors_that_are_not_one_attention_call_are_refused_before_any_kernel_runs
            tensors, info, _ = _parametrized(test)[int(arg)]
            info = {**t._CALL, "primary": "math", **info}
            values["repro"] = str(t._write(d / "bad.safetensors", info, **tensors))
        elif kind == "repro":
            values["repro"] = str(_write_repro(d, arg))
        elif kind == "bugs":
            (d / "bugs.py").write_text(_BUGS)
            values["repro"] = str(_write_repro(d, "ok"))
        elif kind == "bench-json":
            sub, damage = arg.split(":")
            (d / "out").mkdir()
            (d / "out" / f"{sub}.json").write_text("[1, 2]" if damage == "list" else '{"rows": [')
        elif kind == "pair":
            if arg == "full-disk":
                values.update(_write_pair_variant(d, ""))
                _fill(disk(d / "disk"))
                values["disk"] = str(d / "disk")
            elif arg == "link-to-root":
                values.update(_write_pair_variant(d, ""))
                (d / "link_to_root").symlink_to("/")
            elif arg == "users-dir":
                values.update(_write_pair_variant(d, ""))
                (d / "users").mkdir()
                (d / "users" / "notes.txt").write_text("keep")
            else:
                values.update(_write_pair_variant(d, arg))
        elif kind == "study":
            if arg == "full-disk":
                study = Path(shutil.copytree(prepared.study, disk(d / "disk", 4096) / "study"))
                (study / "report.md").unlink(missing_ok=True)
                _fill(d / "disk")
            elif arg == "nonutf8":
                study = Path(shutil.copytree(prepared.study, d / os.fsdecode(b"study\xfe")))
            else:
                study = Path(shutil.copytree(prepared.study, d / "study"))
                _damage_study(study, arg)
            values["study"] = str(study)
        elif kind == "study-garbage":
            (d / "study").mkdir()
            (d / "study" / "study.json").write_text("garbage")
        elif kind == "full-disk":
            _fill(disk(d / "disk"))
            values["disk"] = str(d / "disk")
        elif kind == "read-only-home":
            home = d / "home_ro"
            if not _mount_tmpfs(home, 64, read_only=True):
                raise SkipCaseError("cannot mount a read-only tmpfs here (not root?)")
            mounts.append(home)
            values["home_ro"] = str(home)
        elif kind == "nonutf8":
            values["nonutf8"] = str(d / os.fsdecode(b"run\xff"))
        elif kind == "conf":
            _write_config_files(d, sentinel)
        elif kind == "links":
            values["run"] = str(run := _copy_run(prepared, d))
            _plant_link(run, sentinel, *arg.split(":"))
        elif kind == "recorded-path":
            values["run"] = str(run := _copy_run(prepared, d))
            with (run / ".hydra" / "overrides.yaml").open("a") as fh:
                fh.write(f"- {_yaml_str(arg.format(sentinel=sentinel))}\n")
        elif kind == "nan-run":
            values["run"] = str(shutil.copytree(prepared.nan_run, d / "run"))
        else:  # read-only-run: a run on a disk mounted read-only
            disk(d / "disk", 16 * 1024)
            run = Path(shutil.copytree(prepared.run, d / "disk" / "run"))
            (run / "probe.png").unlink()
            remount = ["mount", "-o", "remount,ro", str(d / "disk")]
            if subprocess.run(remount, capture_output=True).returncode != 0:
                raise SkipCaseError("cannot remount a tmpfs read-only here")
            values["run"] = str(run)
        yield values
    finally:
        for mount in reversed(mounts):
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fingerprint(directory: Path) -> dict[str, tuple]:
    """Every path under ``directory`` (links not followed, mounts included) → (mode, size, mtime, link
    target); a directory by its mode alone (a file made and removed again leaves no trace)."""
    found: dict[str, tuple] = {}
    if not directory.exists():
        return found
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            target = os.readlink(path) if os.path.islink(path) else ""
            if os.path.isdir(path) and not target:  # a directory changes with what it holds (listed)
                found[os.path.relpath(path, directory)] = (st.st_mode, 0, 0, "")
                continue
            found[os.path.relpath(path, directory)] = (st.st_mode, st.st_size, st.st_mtime_ns, target)
    return found


def _changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    return sorted(
        [f"+{p}" for p in after.keys() - before.keys()]
        + [f"-{p}" for p in before.keys() - after.keys()]
        + [f"~{p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    )


def _message(output: str, phrase: str) -> str:
    """The line of the output that holds ``phrase``, else its first error-looking line, else its first."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if phrase and phrase in line:
            return line
    for line in lines:
        if "error" in line.lower() or "refused" in line.lower():
            return line
    return lines[0] if lines else ""


def classify(
    case: Case, returncode: int | None, output: str, inside: Sequence[str], outside: Sequence[str] = ()
) -> tuple[str, str]:
    """The class of one outcome (:data:`CLASSES`) and why."""
    if outside:
        return "writes-outside", f"wrote outside its directory: {', '.join(outside[:3])}"
    if returncode is None:
        if case.code == RUNS_ON and case.expect and case.expect in output:
            return "clean", ""
        return "late", f"still running after {case.timeout:.0f} s (stopped)"
    if "Traceback (most recent call last)" in output or "Error executing job" in output:
        return "traceback", "a traceback"
    refuse = case.code != 0
    if refuse and returncode == 0:
        return "silent", "exit 0 where it should refuse"
    if refuse and not output.strip():
        return "silent", f"exit {returncode} with no message"
    if refuse and not case.writes:
        if inside:
            return "late", f"refused after writing {', '.join(inside[:3])}"
        started = [m for m in TRAINING_STARTED if m in output]
        if started:
            return "late", f"refused after training started ({started[0]!r} in the output)"
    if returncode != case.code:
        return "mismatch", f"exit {returncode}, expected {case.code}"
    if case.expect and case.expect not in output:
        return "mismatch", f"no {case.expect!r} in the message"
    if "\x1b" in output:
        return "mismatch", "a raw escape sequence in the output (text from a file acting on the terminal)"
    return "clean", ""


@dataclass
class Ran:
    """One command's exit code (``None``: stopped at its time limit) and its output (stderr, stdout)."""

    returncode: int | None
    output: str


def flashprobe(args: Sequence[str], cwd: Path, env: dict[str, str], timeout: float) -> Ran:
    """``python -m flashprobe.cli ARGS`` in ``cwd`` as a new process would run it (forked from a process
    that has imported torch and Lightning: :mod:`tests._zygote`), stopped after ``timeout`` seconds."""
    from tests import _zygote as zygote

    cmd = [sys.executable, "-m", "flashprobe.cli", *args]
    try:
        proc = zygote.run(cmd, cwd=cwd, env=env, timeout=timeout, merge_stderr=True)
    except subprocess.TimeoutExpired:
        return Ran(None, "")
    return Ran(proc.returncode, proc.stdout)


def flashprobe_until(args: Sequence[str], cwd: Path, env: dict[str, str], timeout: float) -> Ran:
    """As :func:`flashprobe`, in a process group of its own, keeping what it printed before it was
    stopped (a command that runs on until its limit: what it said by then is the result)."""
    cmd = [sys.executable, "-m", "flashprobe.cli", *args]
    with subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            code = None
    return Ran(code, out.decode("utf-8", "backslashreplace"))
