"""``flashprobe report DIR`` of a comparison: it rewrites report.md (and the figures when asked)
and names the files it wrote, not their contents."""

from __future__ import annotations

import json
from pathlib import Path

from flashprobe.report.cli import report_main


def _comparison_dir(tmp_path: Path) -> Path:
    pair = {
        "run_a": "a",
        "run_b": "b",
        "steps": [0, 10],
        "model": {"wasserstein": [0.0, 1e-6], "max_abs": [0.0, 1e-4]},
    }
    (tmp_path / "study.json").write_text(
        json.dumps({"format": "flashprobe.compare/1", "pairs": {"a_vs_b": pair}})
    )
    return tmp_path


def _wrote(printed: str) -> list[str]:
    """The ``wrote PATH`` lines ``report`` printed, checked to come last, after the verdict and a blank
    line."""
    lines = printed.splitlines()
    wrote = [line for line in lines if line.startswith("wrote ")]
    assert wrote and lines[-len(wrote) :] == wrote and lines[-len(wrote) - 1] == "", printed
    return wrote


def test_report_prints_the_verdict_and_names_the_files_it_wrote(tmp_path: Path, capsys) -> None:
    """The verdict first, as ``flashprobe study`` prints it, with its exit code; then the files written
    (not their contents: the report is in the file). These runs recorded nothing they differ in, so no
    pair is a kernel pair: UNDETERMINED, exit code 4."""
    out = _comparison_dir(tmp_path)
    assert report_main([str(out)]) == 4
    printed = capsys.readouterr().out
    assert printed.startswith("UNDETERMINED: no pair's runs differ in the attention")
    assert _wrote(printed) == [f"wrote {out / 'report.md'}"]
    assert (out / "report.md").read_text().startswith("# ")


def test_report_with_figures_names_each_figure(tmp_path: Path, capsys) -> None:
    out = _comparison_dir(tmp_path)
    assert report_main([str(out), "--figures"]) == 4
    lines = _wrote(capsys.readouterr().out)
    written = [Path(line.removeprefix("wrote ")) for line in lines]
    assert all(line.startswith("wrote ") for line in lines) and written[0] == out / "report.md"
    figures = written[1:]
    assert figures and all(f.suffix == ".png" and f.is_file() and f.parent == out for f in figures)
    assert {f.name for f in figures} == {f.name for f in out.glob("*.png")}


def test_report_and_compare_on_a_full_disk_end_in_one_line_and_keep_what_was_there(
    tmp_path: Path, capsys
) -> None:
    import torch

    from flashprobe.report.cli import compare_main
    from tests._disk import fill, tiny_disk
    from tests.weights._helpers import write_run

    with tiny_disk(tmp_path / "disk", 1024) as disk:
        (disk / "study").mkdir()
        out = _comparison_dir(disk / "study")
        assert report_main([str(out)]) == 4  # UNDETERMINED: no kernel pair
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        fill(disk, 0)
        capsys.readouterr()
        assert report_main([str(out), "--figures"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert err.startswith(f"flashprobe report: error: the disk holding {out} is full (")
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no figure, no temporary file
        (disk / "filler").unlink()

        weights = {0: {"w": torch.zeros(4)}, 2: {"w": torch.ones(4)}}
        runs = [write_run(tmp_path / name, weights, seed=seed) for name, seed in (("a", 0), ("b", 1))]
        fill(disk, 0)
        assert compare_main([*map(str, runs), "--out", str(disk / "compare")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("flashprobe compare: error: the disk holding ")
        assert not [p for p in disk.rglob("*") if p.name.endswith(".tmp")]
