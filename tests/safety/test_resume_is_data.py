"""``resume=RUN`` reads the run's recorded overrides as data: nothing in a run directory is run.

Each vector below ran code or wrote outside the run before (issue 42, item 1): a recorded
``_target_`` of ``numpy.load`` with ``allow_pickle`` unpickled a payload, one of ``builtins.open``
truncated a file outside the run. Each is refused before any work, with the file and line named;
the payload's marker never appears and the file outside keeps its bytes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from flashprobe.app.overrides import RecordedOverrideError, recorded_overrides
from flashprobe.app.train import cli_main, command_line, compose, train
from tests.safety._runs import SHORT, CreatesFile

#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("safety/test_resume_is_data")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-step run with checkpoints, recorded as a CLI run records its overrides: resumable."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(compose(SHORT, run_dir=run))
    (run / ".hydra").mkdir()
    return run


def _evil_run(finished: Path, root: Path, lines: list[str]) -> Path:
    """A copy of a real run as a colleague might hand it over, recording ``lines`` after its own overrides."""
    run = Path(shutil.copytree(finished, root / "run"))
    text = "".join(f"- {_yaml_str(o)}\n" for o in [*SHORT, *lines])
    (run / ".hydra" / "overrides.yaml").write_text(text)
    return run


def _yaml_str(text: str) -> str:
    """``text`` as a YAML double-quoted scalar (Hydra writes overrides as plain strings)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.fixture
def targets(tmp_path: Path) -> dict[str, Path]:
    """The attacker's payload (an .npy that creates ``marker`` when unpickled) and a file outside the run."""
    marker, outside = tmp_path / "marker", tmp_path / "outside.txt"
    outside.write_text("the user's own file\n")
    payload = tmp_path / "evil.npy"
    np.save(payload, np.array([CreatesFile(marker)], dtype=object), allow_pickle=True)
    return {"marker": marker, "outside": outside, "payload": payload}


def test_the_payload_really_runs_when_loaded_unsafely(targets: dict[str, Path]) -> None:
    """The control: numpy.load(allow_pickle=True) of the payload does create the marker."""
    np.load(targets["payload"], allow_pickle=True)
    assert targets["marker"].exists()


def _vectors(t: dict[str, Path], run_root: Path) -> dict[str, list[str]]:
    cfg = run_root / "run" / "cfg"
    return {
        "numpy.load": [
            "+callbacks.evil._target_=numpy.load",
            f"+callbacks.evil._args_=['{t['payload']}']",
            "+callbacks.evil.allow_pickle=true",
        ],
        "builtins.open": [
            "+callbacks.evil._target_=builtins.open",
            f"+callbacks.evil._args_=['{t['outside']}','w']",
        ],
        "a mapping": [
            f"+callbacks.evil={{_target_: numpy.load, file: '{t['payload']}', allow_pickle: true}}"
        ],
        "a resolver": [
            "+callbacks.evil=\"${oc.decode:'{_target_: builtins.open, file: "
            + str(t["outside"])
            + ", mode: w}'}\""
        ],
        "Hydra's search path": [f"hydra.searchpath=[file://{cfg}]", "+callbacks=evil"],
        "a path as a group option": [f"+callbacks=../../../../../../../../..{cfg}/callbacks/evil"],
        "a package override": ["callbacks@module.optimizer=default"],
    }


VECTORS = [
    "numpy.load",
    "builtins.open",
    "a mapping",
    "a resolver",
    "Hydra's search path",
    "a path as a group option",
    "a package override",
]


@pytest.mark.parametrize("vector", VECTORS)
def test_resume_refuses_a_recorded_override_that_would_run_code(
    finished: Path, tmp_path: Path, targets: dict[str, Path], cli, vector: str
) -> None:
    lines = _vectors(targets, tmp_path)[vector]
    run = _evil_run(finished, tmp_path, lines)
    before = (run / "run.json").read_bytes()
    callbacks = run / "cfg" / "callbacks"  # the config a search-path or path vector would load
    callbacks.mkdir(parents=True)
    (callbacks / "evil.yaml").write_text(
        f"evil:\n  _target_: builtins.open\n  file: {targets['outside']}\n  mode: w\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    result = cli("train", f"resume={run}", cwd=work)
    assert result.returncode == 2, result.stderr
    line = len(SHORT) + 1
    assert f"overrides.yaml, line {line}" in result.stderr
    assert "data, never instructions" in result.stderr
    assert "Traceback" not in result.stderr
    assert not targets["marker"].exists()
    assert targets["outside"].read_text() == "the user's own file\n"
    assert (run / "run.json").read_bytes() == before  # nothing started


def test_a_config_directory_inside_the_run_is_refused(
    finished: Path, tmp_path: Path, targets: dict[str, Path], cli
) -> None:
    """Run from inside a handed-over run, its ``conf/`` would be on Hydra's search path: refused."""
    run = _evil_run(finished, tmp_path, [])
    experiment = run / "conf" / "experiment"
    experiment.mkdir(parents=True)
    (experiment / "smoke.yaml").write_text(
        f"# @package _global_\ncallbacks:\n  evil:\n    _target_: builtins.open\n"
        f"    file: {targets['outside']}\n    mode: w\n"
    )
    result = cli("train", "resume=.", cwd=run)
    assert result.returncode == 2, result.stderr
    assert "lies inside the run directory" in result.stderr
    assert targets["outside"].read_text() == "the user's own file\n"


def test_plain_settings_group_options_and_deletions_are_read(tmp_path: Path) -> None:
    lines = [
        "experiment=smoke",
        "attention.kernel='tiled:block_q=32,block_k=64'",
        "run_name=x-${seed}",
        "study_run=null",
        "~callbacks.weight_snapshot",
        "seed=3",
    ]
    path = tmp_path / "overrides.yaml"
    path.write_text("".join(f"- {_yaml_str(o)}\n" for o in lines))
    assert recorded_overrides(path, {"experiment", "study_run", "callbacks"}) == lines


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("module._target_=os.system", "makes Hydra import and build an object"),
        ("+x._partial_=true", "makes Hydra import and build an object"),
        ("+x={a: [1, {_args_: [2]}]}", "holds the key _args_"),
        ("run_name=${oc.env:HOME}", "calls a resolver"),
        ("hydra/launcher=joblib", "sets Hydra's own configuration"),
        ("seed=1,2", "is a sweep"),
        ("experiment=/etc/passwd", "not an option name"),
        ("experiment@x=smoke", "moves a config group"),
    ],
)
def test_each_refusal_says_what_the_override_would_do(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "overrides.yaml"
    path.write_text(f"- experiment=smoke\n- {_yaml_str(line)}\n")
    with pytest.raises(RecordedOverrideError, match=rf"overrides.yaml, line 2: .*{reason}"):
        recorded_overrides(path, {"experiment"})


def test_the_escape_hatch_named_in_the_message_reads_nothing_recorded(finished: Path, tmp_path: Path) -> None:
    """``hydra.run.dir=RUN resume=auto`` uses only the overrides given now, as the refusal advises."""
    run = _evil_run(finished, tmp_path, ["+callbacks.evil._target_=builtins.open"])
    args = ["hydra.run.dir=" + str(run), "resume=auto", *SHORT]
    assert command_line(args) == args


def test_a_recorded_override_the_command_replaces_is_not_read(tmp_path: Path) -> None:
    """A user's own ``+callbacks.x._target_`` is recorded; ``~callbacks.x`` given now drops it unread."""
    path = tmp_path / "overrides.yaml"
    lines = ["experiment=smoke", "+callbacks.x._target_=my.Callback", "+callbacks.x.step=3", "seed=2"]
    path.write_text("".join(f"- {_yaml_str(o)}\n" for o in lines))
    with pytest.raises(
        RecordedOverrideError,
        match=r"line 2: .*flashprobe train hydra.run.dir=RUN resume=auto "
        r"\+callbacks.x._target_=my.Callback ...; or drop it: resume=RUN ~callbacks.x$",
    ):
        recorded_overrides(path, {"experiment"})
    # ~callbacks.x only undid what the run added: nothing is left to delete, so it goes too
    kept = recorded_overrides(path, {"experiment"}, ["~callbacks.x", "seed=4"])
    assert kept == ["experiment=smoke", "seed=4"]
    assert recorded_overrides(path, {"experiment"}, ["callbacks.x._target_=other.Callback"], ["seed"]) == [
        "experiment=smoke",
        "+callbacks.x.step=3",
        "callbacks.x._target_=other.Callback",
    ]
    path.write_text("- callbacks.weight_snapshot.every_n_steps=1\n- seed=2\n")  # not added by the run
    kept = recorded_overrides(path, set(), ["~callbacks.weight_snapshot"])
    assert kept == ["seed=2", "~callbacks.weight_snapshot"]


def test_a_finished_run_resumed_with_an_object_to_build_builds_nothing_and_keeps_its_record(
    finished: Path, tmp_path: Path
) -> None:
    """``resume=RUN +callbacks.x._target_=builtins.open`` on a finished run: skipped (exit 0), nothing
    built, and the run's record unchanged — Hydra's rewrite of ``.hydra/`` would put the line into what
    the run's next ``resume=`` reads."""
    run = _evil_run(finished, tmp_path, [])
    before = {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()}
    marker = tmp_path / "built"
    args = [f"resume={run}", "+callbacks.evil._target_=builtins.open", f"+callbacks.evil.file={marker}"]
    assert cli_main(args) == 0
    assert {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()} == before
    assert not marker.exists()


def test_a_resume_of_a_finished_run_leaves_its_record_as_it_was(finished: Path, tmp_path: Path) -> None:
    """A finished run resumed with a setting is skipped; Hydra's rewrite of the run's ``.hydra/`` (what
    the next ``resume=`` replays) is undone."""
    run = _evil_run(finished, tmp_path, [])
    before = {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()}
    assert cli_main([f"resume={run}", "trainer.log_every_n_steps=2"]) == 0
    assert {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()} == before
