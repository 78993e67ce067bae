"""The sample-grid PNG (flashprobe.report.grid): content, layout, atomic writes, errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.image import imread

from flashprobe.report.grid import save_sample_grid


def solid(colours: list[tuple[float, float, float]], size: int = 8) -> torch.Tensor:
    """``(N, 3, size, size)`` images of one colour each, in [-1, 1]."""
    return torch.tensor(colours).view(-1, 3, 1, 1).expand(-1, -1, size, size) * 2 - 1


def pixels_of(png: np.ndarray, rgb: tuple[float, float, float]) -> int:
    return int((np.abs(png[..., :3] - np.array(rgb)).max(axis=-1) < 0.02).sum())


def test_grid_shows_each_image_and_grows_with_rows(tmp_path: Path) -> None:
    images = solid([(1, 0, 0), (0, 0, 1), (0, 1, 0)])
    path = save_sample_grid(images, ["red", "blue", "green"], tmp_path / "a" / "grid.png", ncols=3, title="t")
    png = imread(path)
    assert path == tmp_path / "a" / "grid.png" and png.ndim == 3
    for rgb in [(1, 0, 0), (0, 0, 1), (0, 1, 0)]:
        assert pixels_of(png, rgb) > 1000  # each image is drawn large (about 1.4 in at 100 dpi)
    one_row = png.shape
    png2 = imread(save_sample_grid(images, ["a", "b", "c"], tmp_path / "b.png", ncols=1))
    assert png2.shape[0] > 2 * one_row[0] and png2.shape[1] < one_row[1]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["grid.png"]  # no temp files left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not the temp file's private mode


def test_grey_and_value_range(tmp_path: Path) -> None:
    grey = torch.zeros(2, 1, 8, 8)  # one channel, value 0 in [-1, 1] is mid-grey
    png = imread(save_sample_grid(grey, ["", ""], tmp_path / "g.png"))
    assert pixels_of(png, (0.5, 0.5, 0.5)) > 1000
    unit = torch.ones(1, 3, 8, 8)  # 1.0 is white in [0, 1] and in [-1, 1]; 0.5 differs
    half = imread(save_sample_grid(unit * 0.5, ["x"], tmp_path / "h.png", value_range=(0.0, 1.0)))
    assert pixels_of(half, (0.5, 0.5, 0.5)) > 1000


def test_failed_write_leaves_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_sample_grid(solid([(1, 0, 0)]), ["red"], tmp_path / "grid.png")
    before = path.read_bytes()

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        save_sample_grid(solid([(0, 0, 1)]), ["blue"], path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["grid.png"]


def test_bad_input_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        save_sample_grid(solid([(1, 0, 0), (0, 1, 0)]), ["one"], tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"\(N, C, H, W\) with C = 1 or 3"):
        save_sample_grid(torch.zeros(2, 8, 8), ["a", "b"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="high > low"):
        save_sample_grid(solid([(1, 0, 0)]), ["a"], tmp_path / "x.png", value_range=(1.0, 1.0))
