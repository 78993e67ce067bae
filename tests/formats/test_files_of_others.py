"""Files a user is handed are data: text in them never acts on the terminal, and a file of another
flashprobe version is refused naming the version that wrote it and the one that reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flashprobe import __version__
from flashprobe.formats.reproducer import REPRO_FORMAT, load_reproducer
from tests.app._study import flashprobe_cli

#: an escape sequence that clears the screen, a bell, a carriage return and a C1 control (CSI)
ESCAPES = "\x1b[2J\x07\rX\x9b31m"


def _reproducer(path: Path, info: dict) -> Path:
    x = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(0))
    save_file({"q": x, "k": x.clone(), "v": x.clone()}, str(path), metadata={"flashprobe": json.dumps(info)})
    return path


def test_a_reproducers_text_is_escaped_when_loaded_and_when_replayed(tmp_path: Path) -> None:
    info = {
        "format": REPRO_FORMAT,
        "primary": "math",
        "baseline": "math",
        "reason": f"bad{ESCAPES}",
        "site": ESCAPES,
    }
    path = _reproducer(tmp_path / "call.safetensors", info)
    meta = load_reproducer(path).meta
    assert meta["reason"] == "bad\\x1b[2J\\x07\\x0dX\\x9b31m" and "\x1b" not in json.dumps(
        meta, ensure_ascii=False
    )
    replayed = flashprobe_cli("replay", str(path))
    output = replayed.stdout + replayed.stderr
    assert replayed.returncode in (0, 1), output[-2000:]
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", output.replace("\r\n", "\n")), output[-2000:]


def test_another_versions_files_are_refused_naming_both_versions(tmp_path: Path) -> None:
    from flashprobe.formats.study_file import read_study
    from flashprobe.weights.store import SnapshotError, read_manifest

    (tmp_path / "study.json").write_text(json.dumps({"format": "flashprobe.compare/2", "flashprobe": "9.0"}))
    with pytest.raises(
        ValueError,
        match=rf"written by flashprobe 9\.0, in format 'flashprobe\.compare/2'; this "
        rf"flashprobe \({re.escape(__version__)}\) reads format 'flashprobe\.compare/1'",
    ):
        read_study(tmp_path)
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    (snapshots / "manifest.json").write_text(
        json.dumps({"format": "flashprobe.snapshots/7", "snapshots": []})
    )
    with pytest.raises(
        SnapshotError, match=r"written by another flashprobe version, in format 'flashprobe\.snap"
    ):
        read_manifest(snapshots)
