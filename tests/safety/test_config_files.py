"""A path is checked wherever it was set: in an experiment file under ``./conf``, ``--config-dir`` or
``$FLASHPROBE_CONFIG_DIR`` as on the command line; the refusal names the file and the key. A config file
Hydra cannot use is one line naming it. Everything here happens in the test's own directory: the
directory a config file sends the run to is someone else's (a non-empty directory), never ``/``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.safety._runs import fingerprint

EXPERIMENT = "# @package _global_\ndefaults:\n  - smoke\n"


def _conf(root: Path, name: str, text: str) -> Path:
    path = root / "experiment" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text)
    return root


@pytest.fixture
def theirs(tmp_path: Path) -> Path:
    """A directory of someone else's, with a file in it."""
    directory = tmp_path / "theirs"
    directory.mkdir()
    (directory / "notes.txt").write_text("keep")
    return directory


@pytest.mark.parametrize("where", ["--config-dir", "$FLASHPROBE_CONFIG_DIR", "./conf"])
@pytest.mark.parametrize(
    ("setting", "phrase"),
    [
        (
            "hydra:\n  run:\n    dir: {theirs}\n",
            "hydra.run.dir (set in {file}) {theirs} holds files flashprobe did not",
        ),
        ("run_dir: {theirs}\n", "run_dir (set in {file}) is {theirs}, not the run's directory"),
        (
            "callbacks:\n  checkpoint:\n    dirpath: {theirs}\n",
            "callbacks.checkpoint.dirpath (set in {file}) {theirs} lies outside the run directory",
        ),
        (
            "logger:\n  csv:\n    save_dir: {theirs}\n",
            "logger.csv.save_dir (set in {file}) {theirs} lies outside the run directory",
        ),
    ],
    ids=["hydra.run.dir", "run_dir", "dirpath", "save_dir"],
)
def test_a_path_set_in_a_config_file_is_checked_and_named(
    tmp_path: Path, theirs: Path, cli, monkeypatch, where: str, setting: str, phrase: str
) -> None:
    conf = _conf(
        tmp_path / ("conf" if where == "./conf" else "mine"),
        "paths",
        EXPERIMENT + setting.format(theirs=theirs),
    )
    file = conf / "experiment" / "paths.yaml"
    args = (
        ["train", "experiment=paths", "hydra.run.dir=run"]
        if "hydra" not in setting
        else ["train", "experiment=paths"]
    )
    if where == "--config-dir":
        args[1:1] = ["--config-dir", str(conf)]
    elif where == "$FLASHPROBE_CONFIG_DIR":
        monkeypatch.setenv("FLASHPROBE_CONFIG_DIR", str(conf))
    before = fingerprint(tmp_path)
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert phrase.format(theirs=theirs, file=file.resolve()) in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and fingerprint(tmp_path) == before


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        (EXPERIMENT + "foo: [1, 2\n", "paths.yaml, line 5: not valid YAML"),
        ("# @package _global_\ndefaults:\n  - paths\n", "the defaults list of {file} includes itself"),
        ("- a\n- b\n", "{file} holds a YAML list, not settings"),
        (EXPERIMENT + 'foo: "\xff\xfe"\n', "{file} (byte 46) is not UTF-8 text"),
    ],
    ids=["syntax", "self-including", "list", "not-utf8"],
)
def test_a_config_file_hydra_cannot_use_is_one_line_naming_it(tmp_path: Path, cli, text, phrase) -> None:
    conf = _conf(tmp_path / "conf", "paths", text.encode("latin-1") if "\xff" in text else text)
    before = fingerprint(tmp_path)
    result = cli("train", "experiment=paths", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert phrase.format(file=(conf / "experiment" / "paths.yaml").resolve()) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and fingerprint(tmp_path) == before


def test_flashprobe_config_dir_naming_a_file_is_refused(tmp_path: Path, cli, monkeypatch) -> None:
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setenv("FLASHPROBE_CONFIG_DIR", str(tmp_path / "a_file"))
    for args in (["train", "experiment=smoke", "hydra.run.dir=run"], ["study", "--out", "s"]):
        result = cli(*args, cwd=tmp_path)
        assert result.returncode == 2 and "FLASHPROBE_CONFIG_DIR" in result.stderr, result.stderr[-2000:]
        assert "is not a directory (a file)" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_the_check_refuses_system_directories_set_in_a_config_file_without_writing(tmp_path: Path) -> None:
    """``output_root: /``, ``hydra.run.dir: /etc`` set in a config file: the check alone (no run starts)."""
    from flashprobe.app.compose import check_paths, compose_with_sources
    from flashprobe.formats import OutputPathError

    conf = _conf(
        tmp_path / "conf", "root", EXPERIMENT + "output_root: /\nhydra:\n  sweep:\n    dir: /etc/x\n"
    )
    import os

    os.environ["FLASHPROBE_CONFIG_DIR"] = str(conf)
    try:
        cfg, sources = compose_with_sources(["experiment=root", "hydra.run.dir=/tmp/x/run"], hydra=True)
    finally:
        del os.environ["FLASHPROBE_CONFIG_DIR"]
    file = (conf / "experiment" / "root.yaml").resolve()
    with pytest.raises(
        OutputPathError, match=rf"^output_root \(set in {file}\) / is a system directory \(/\)"
    ):
        check_paths(cfg, "/tmp/x/run", sources)
    cfg.output_root = "out"
    with pytest.raises(
        OutputPathError, match=rf"^hydra\.sweep\.dir \(set in {file}\) /etc/x is inside the system"
    ):
        check_paths(cfg, "/tmp/x/run", sources)
