"""``flashprobe --help``: what the tool is and its Python entry point, before the command list; a
flashprobe error from any command is one line (exit code 2), a bug keeps its traceback; the bench
commands that left the package answer with one line naming their replacement."""

from __future__ import annotations

import pytest

from flashprobe.cli import main


def test_help_says_what_the_tool_is_and_points_at_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    about, commands = out.split("commands:\n", 1)
    assert "is this attention kernel numerically safe to train with?" in about
    assert "from flashprobe import probe" in about and "with probe(model) as p:" in about
    assert all(f"  {name} " in commands for name in ("train", "fuzz", "replay", "bench"))


@pytest.mark.parametrize(
    ("name", "replacement"),
    [("rules", "python -m lab.rules"), ("wasserstein", "scipy.stats.wasserstein_distance")],
)
def test_a_bench_command_that_left_names_its_replacement(
    name: str, replacement: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", name, "--out", "never-written"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flashprobe bench {name}: error: ") and replacement in err[0]
    assert main(["bench", "--help"]) == 0
    assert f"  {name} " not in capsys.readouterr().out


def _refuses(argv: list[str]) -> int:
    """A command whose work raises a user's subclass of a flashprobe error (a kernel refusing a call)."""
    from flashprobe.kernels import KernelUnsupportedError

    class MyKernelRefusalError(KernelUnsupportedError):
        pass

    raise MyKernelRefusalError("mykernel: head dim 59\nis not supported; choose math")


def _bug(argv: list[str]) -> int:
    raise RuntimeError("a bug")


def test_a_flashprobe_error_from_any_command_is_one_line_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Recognised by its class (``FlashprobeError``), not by the module that defines it; any other
    exception is a bug and keeps its traceback."""
    from flashprobe import cli

    monkeypatch.setitem(cli.COMMANDS, "refuses", ("tests.test_cli:_refuses", "raises a refusal"))
    monkeypatch.setitem(cli.COMMANDS, "bug", ("tests.test_cli:_bug", "raises a bug"))
    assert main(["refuses"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["flashprobe refuses: error: mykernel: head dim 59 is not supported; choose math"]
    with pytest.raises(RuntimeError, match="a bug"):
        main(["bug"])
