"""Every ``flashprobe bench`` command checks ``--out`` before any work (exit code 2, one line)."""

from __future__ import annotations

import errno
import importlib
import os
from pathlib import Path

import pytest

SMALL = ["--batch", "1", "--heads", "1", "--seq-len", "16", "--head-dim", "8", "--dtype", "fp32"]


def _precision(argv: list[str]) -> int:
    from flashprobe.bench import precision

    return precision.main([*SMALL, "--repeats", "1", *argv])


def test_out_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    out.write_text("not a directory")
    assert _precision(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"flashprobe bench precision: error: --out {out} is a file; give a directory path\n"
    assert out.read_text() == "not a directory"


def test_out_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "sub"
    assert _precision(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashprobe bench precision: error:")
    assert f"--out {out} lies under {tmp_path / 'file'}, which is a file" in err
    assert err.count("\n") == 1


def test_out_that_is_not_writable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "read_only"
    out.mkdir()
    out.chmod(0o500)
    if os.geteuid() == 0:  # root writes anyway: make the write check fail as it would for a user
        real_touch = Path.touch

        def touch(self: Path, *args, **kwargs) -> None:
            if self.parent == out:
                raise PermissionError(errno.EACCES, "Permission denied")
            real_touch(self, *args, **kwargs)

        monkeypatch.setattr(Path, "touch", touch)
    try:
        assert _precision(["--out", str(out)]) == 2
    finally:
        out.chmod(0o700)
    err = capsys.readouterr().err
    assert err == (
        f"flashprobe bench precision: error: --out {out} is not writable (Permission denied); "
        "give a directory you can write to\n"
    )
    assert list(out.iterdir()) == []


@pytest.mark.timeout(60)  # with the check missing, the default settings would measure for minutes
@pytest.mark.parametrize(
    "command", ["precision", "seqlen", "tiles", "paper", "speed", "overhead", "bias"]
)
def test_every_command_checks_out_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    out = tmp_path / "taken"
    out.write_text("x")
    main = importlib.import_module(f"flashprobe.bench.{command}").main
    assert main(["--out", str(out)]) == 2  # default settings: the check comes before any work
    captured = capsys.readouterr()
    message = f"flashprobe bench {command}: error: --out {out} is a file; give a directory path\n"
    assert captured.err == message
    assert captured.out == ""


@pytest.mark.parametrize("command", ["precision", "seqlen"])
def test_a_shape_too_large_for_memory_is_refused_with_the_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """10^7 tokens: 8 float64 tensors of 1x4x10^7x64 are 152.6 GiB before the reference block (8 GiB
    available here, whatever the machine)."""
    from flashprobe.kernels import reference

    monkeypatch.setattr(reference, "_available_bytes", lambda device: 8 << 30)
    module = importlib.import_module(f"flashprobe.bench.{command}")
    shape = ["--batch", "1", "--heads", "4", "--seq-len", "10000000", "--head-dim", "64"]
    assert module.main([*shape, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    refused = f"flashprobe bench {command}: error: --seq-len 10000000 with --batch 1 --heads 4 --head-dim 64 "
    assert refused in err
    assert "needs at least 155 GiB (8 float64 tensors of 1x4x10000000x64 and a 2 GiB reference block)" in err
    assert "but cpu has 8 GiB available" in err and not (tmp_path / "out").exists()


def test_overhead_refuses_a_sequence_whose_mask_alone_cannot_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench overhead --seq-len 100000`` would allocate a 37.3 GiB causal mask (10^10 fp32) when the
    model is built (issue 42's table); refused first with the estimate (8 GiB available here)."""
    from flashprobe.bench import overhead
    from flashprobe.kernels import reference

    monkeypatch.setattr(reference, "_available_bytes", lambda device: 8 << 30)
    assert overhead.main(["--seq-len", "100000", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error: --seq-len 100000 with --batch 2 --d-model 256 --heads 4 needs at least 42.3 GiB" in err
    assert "(a 37.3 GiB causal mask and 3.05 GiB of float64 attention tensors)" in err
    assert "but cpu has 8 GiB available" in err and not (tmp_path / "out").exists()
