"""``flashprobe --help``: what the tool is and its Python entry point, before the command list; the bench
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
