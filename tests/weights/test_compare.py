"""compare_pair / compare_runs / ``flashprobe compare`` on real training runs, scipy as the oracle."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
from matplotlib.image import imread
from safetensors.torch import save_file

from flashprobe.cli import main as cli_main
from flashprobe.formats.study_file import read_study
from flashprobe.weights import SnapshotMismatchError, SnapshotStore, compare_pair, compare_runs, group_of

from ._helpers import train_run, write_run

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:.*(does not have many workers|is smaller than the logging interval).*",
        "ignore:.*isinstance.treespec, LeafSpec.*",
    ),
    # one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
    pytest.mark.xdist_group("weights/test_compare"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three real runs (4 steps, snapshots at 0, 2, 4): two with seed 0, one with seed 1."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "base": train_run(root / "base", seed=0),
        "same": train_run(root / "same", seed=0),
        "seed1": train_run(root / "seed1", seed=1),
    }


def _flat(store: SnapshotStore, step: int, names: list[str]) -> np.ndarray:
    return np.concatenate([store.tensor(step, n).double().numpy().ravel() for n in names])


def test_group_of() -> None:
    assert group_of("blocks.0.attn.qkv.weight", 2) == "blocks.0"
    assert group_of("blocks.0.attn.qkv.weight", 1) == "blocks"
    assert group_of("blocks.0.attn.qkv.weight", 9) == "blocks.0.attn.qkv"
    assert group_of("head.weight", 2) == "head"
    assert group_of("pos_embed", 2) == "pos_embed"


def test_identical_runs_are_at_distance_zero_everywhere(runs: dict[str, Path]) -> None:
    result = compare_pair(runs["base"], runs["same"], name="identical")
    assert result.steps == [0, 2, 4]
    assert set(result.groups) == {"embed", "blocks.0", "blocks.1", "head", "scale"}
    for series in [result.model, *result.groups.values(), *result.tensors.values()]:
        assert [(d.wasserstein, d.max_abs) for d in series] == [(0.0, 0.0)] * 3


def test_other_seed_matches_scipy_at_every_level(runs: dict[str, Path]) -> None:
    result = compare_pair(runs["base"], runs["seed1"], name="seed")
    a, b = SnapshotStore(runs["base"]), SnapshotStore(runs["seed1"])
    names = a.names()
    for i, step in enumerate(result.steps):
        fa, fb = _flat(a, step, names), _flat(b, step, names)
        model = result.model[i]
        assert model.wasserstein > 0
        assert model.wasserstein == pytest.approx(scipy.stats.wasserstein_distance(fa, fb), rel=1e-12)
        assert model.max_abs == np.max(np.abs(fa - fb))
        assert model.numel == fa.size
        members = [n for n in names if n.startswith("blocks.1.")]
        ga, gb = _flat(a, step, members), _flat(b, step, members)
        assert result.groups["blocks.1"][i].wasserstein == pytest.approx(
            scipy.stats.wasserstein_distance(ga, gb), rel=1e-12
        )
        ta, tb = _flat(a, step, ["head.weight"]), _flat(b, step, ["head.weight"])
        assert result.tensors["head.weight"][i].wasserstein == pytest.approx(
            scipy.stats.wasserstein_distance(ta, tb), rel=1e-12
        )
        assert result.tensors["head.weight"][i].max_abs == np.max(np.abs(ta - tb))
    assert result.curve("wasserstein") == [d.wasserstein for d in result.model]
    assert result.curve("max_abs", "group", "head") == [d.max_abs for d in result.groups["head"]]


def _weights(**shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def test_mismatched_parameter_names_name_the_first_one(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {0: _weights(**{"x.weight": (2, 2), "y.weight": (3,), "z.weight": (1,)})})
    b = write_run(tmp_path / "b", {0: _weights(**{"x.weight": (2, 2), "y2.weight": (3,), "z2.weight": (1,)})})
    with pytest.raises(SnapshotMismatchError, match=r"parameter 'y\.weight' of .*a is missing from .*b"):
        compare_pair(a, b)
    with pytest.raises(SnapshotMismatchError, match=r"parameter 'y2\.weight' of .*b is missing from .*a"):
        compare_pair(b, a)


def test_mismatched_shapes_name_the_parameter_and_shapes(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {0: _weights(**{"x.weight": (2, 2), "y.weight": (3,)})})
    b = write_run(tmp_path / "b", {0: _weights(**{"x.weight": (2, 2), "y.weight": (4,)})})
    with pytest.raises(SnapshotMismatchError, match=r"parameter 'y\.weight' has shape \[3\] in .* but \[4\]"):
        compare_pair(a, b)


def test_different_steps_are_compared_on_common_steps_with_a_warning(tmp_path: Path) -> None:
    w = _weights(**{"x.weight": (4, 4)})
    shifted = {"x.weight": w["x.weight"] + 0.25}
    a = write_run(tmp_path / "a", {0: w, 2: w, 4: w, 6: w})
    b = write_run(tmp_path / "b", {0: w, 3: shifted, 4: shifted})
    with pytest.warns(UserWarning, match=r"on the 2 steps both runs saved.*\[2, 6\].*\[3\]"):
        result = compare_pair(a, b)
    assert (result.steps, result.steps_only_a, result.steps_only_b) == ([0, 4], [2, 6], [3])
    assert [d.wasserstein for d in result.model] == [0.0, pytest.approx(0.25)]
    c = write_run(tmp_path / "c", {1: w})
    with pytest.raises(SnapshotMismatchError, match="no snapshot step in common"):
        compare_pair(a, c)


def test_non_finite_weights_are_counted_and_give_nan(tmp_path: Path) -> None:
    w = _weights(**{"x.weight": (4,), "y.weight": (3,)})
    bad = {"x.weight": torch.tensor([1.0, math.nan, math.inf, 0.0]), "y.weight": w["y.weight"]}
    a = write_run(tmp_path / "a", {0: w})
    b = write_run(tmp_path / "b", {0: w})  # flashprobe writes no snapshot of non-finite weights ...
    save_file(bad, b / "snapshots" / "step_0000000.safetensors")  # ... an older one or another tool's
    with pytest.warns(UserWarning, match=r"non-finite weights at step 0 in 'x\.weight' \(0 in A, 2 in B\)"):
        result = compare_pair(a, b, group_depth=1)
    assert math.isnan(result.tensors["x.weight"][0].wasserstein)
    assert result.tensors["x.weight"][0].nonfinite_b == 2
    assert result.tensors["y.weight"][0].wasserstein == 0.0
    assert math.isnan(result.model[0].wasserstein) and result.model[0].nonfinite_b == 2
    with pytest.warns(UserWarning, match="non-finite"):
        data = compare_runs({"nan": (a, b)}, tmp_path / "out").as_dict()
    assert math.isnan(data["pairs"]["nan"]["model"]["wasserstein"][0])
    written = json.loads((tmp_path / "out" / "study.json").read_text())["pairs"]["nan"]["model"]
    assert written["wasserstein"] == ["nan"] and written["nonfinite_b"] == [2]  # the JSON convention
    assert math.isnan(read_study(tmp_path / "out")["pairs"]["nan"]["model"]["wasserstein"][0])


def test_what_a_pair_differs_in_comes_from_the_manifests(tmp_path: Path, capsys) -> None:
    """attention, precision and seed of both manifests: ``flashprobe compare`` names the differences
    and warns when a pair differs in more than one; a manifest without ``attention`` (written before it
    was recorded) still loads, with that fact unknown (so its pair is not shown to be like for like)."""
    w = {0: _weights(**{"x.weight": (4,)})}
    base = write_run(tmp_path / "base", w, attention="math", precision="bf16-mixed", seed=0)
    flash = write_run(tmp_path / "flash", w, attention="sdpa_flash", precision="bf16-mixed", seed=0)
    both = write_run(tmp_path / "both", w, attention="sdpa_flash", precision="32-true", seed=0)
    old = write_run(tmp_path / "old", w, precision="bf16-mixed", seed=1)  # no "attention" key at all
    assert "attention" not in json.loads((old / "snapshots" / "manifest.json").read_text())
    assert SnapshotStore(old).attention is None
    assert compare_pair(flash, base).differs == {"attention": ["sdpa_flash", "math"]}
    assert compare_pair(both, base).differs == {
        "attention": ["sdpa_flash", "math"],
        "precision": ["32-true", "bf16-mixed"],
    }
    old_pair = compare_pair(old, base)
    assert (old_pair.differs, old_pair.unrecorded) == ({"seed": [1, 0]}, ["attention"])
    pairs = [f"{n}={tmp_path / n},{base}" for n in ("flash", "both", "old")]
    code = cli_main(["compare", *(a for p in pairs for a in ("--pair", p)), "--out", str(tmp_path / "o")])
    assert code == 4  # a kernel pair (flash) but no seed or low-precision pair: UNDETERMINED
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.split("\n\n")[0].splitlines()}  # the table, not the verdict
    assert rows["pair"].endswith("differs in")
    assert rows["flash"].endswith("attention (sdpa_flash vs math)")
    assert rows["both"].endswith("attention (sdpa_flash vs math), precision (32-true vs bf16-mixed)")
    assert "seed (1 vs 0)" in rows["old"] and "attention not recorded" in rows["old"]
    warning = rows["warning:"]
    assert "both differs in attention" in warning and "old differs in seed" in warning
    assert "flash differs" not in warning


def test_cli_writes_study_json_csv_and_figures(runs: dict[str, Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = cli_main(
        [
            "compare",
            "--pair",
            f"flash_vs_baseline={runs['base']},{runs['seed1']}",
            "--pair",
            f"identical={runs['base']},{runs['same']}",
            "--out",
            str(out),
        ]
    )
    assert code == 4  # whatever the names, no pair differs in the attention: UNDETERMINED
    printed = capsys.readouterr().out
    assert "flash_vs_baseline" in printed and "wrote" in printed
    data = json.loads((out / "study.json").read_text())
    assert data["format"] == "flashprobe.compare/1"
    assert list(data["pairs"]) == ["flash_vs_baseline", "identical"]
    pair = data["pairs"]["flash_vs_baseline"]
    expected = compare_pair(runs["base"], runs["seed1"])
    assert pair["steps"] == [0, 2, 4]
    assert pair["model"]["wasserstein"] == [d.wasserstein for d in expected.model]
    assert pair["runs"]["a"]["seed"] == 0 and pair["runs"]["b"]["seed"] == 1
    with open(out / "study.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    per_step = 1 + len(pair["groups"]) + len(pair["tensors"])  # model + groups + tensors
    assert len(rows) == 2 * 3 * per_step
    model_rows = [r for r in rows if r["pair"] == "flash_vs_baseline" and r["level"] == "model"]
    assert [float(r["wasserstein"]) for r in model_rows] == pair["model"]["wasserstein"]
    for name in ("fig7_flash_vs_baseline.png", "fig8_wasserstein.png"):
        image = imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300


def test_cli_all_pairs_of_several_runs(runs: dict[str, Path], tmp_path: Path) -> None:
    code = cli_main(["compare", *map(str, runs.values()), "--out", str(tmp_path), "--no-figures"])
    assert code == 4  # no kernel pair among them: UNDETERMINED
    data = json.loads((tmp_path / "study.json").read_text())
    assert list(data["pairs"]) == ["base_vs_same", "base_vs_seed1", "same_vs_seed1"]
    assert not list(tmp_path.glob("*.png"))


def test_cli_bad_input(runs: dict[str, Path], tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["compare", str(runs["base"])])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        cli_main(["compare", "--pair", "oops"])
    assert "NAME=RUN_A,RUN_B" in capsys.readouterr().err
    assert cli_main(["compare", str(runs["base"]), str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert "no snapshot manifest" in capsys.readouterr().err
    assert not (tmp_path / "study.json").exists()


@pytest.mark.parametrize("name", ["../../../x", "a/b", ".hidden"])
def test_cli_refuses_pair_names_that_leave_the_output_directory(
    runs: dict[str, Path], tmp_path: Path, capsys, name: str
) -> None:
    out = tmp_path / "deep" / "out"
    with pytest.raises(SystemExit) as exit_:
        cli_main(["compare", "--pair", f"{name}={runs['base']},{runs['same']}", "--out", str(out)])
    assert exit_.value.code == 2
    assert "cannot be used in a file name" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.png")) and not out.exists()


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_cli_refuses_an_unusable_out_before_any_work(
    runs: dict[str, Path], tmp_path: Path, capsys, where: str
) -> None:
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" if where == "file" else tmp_path / "f" / "out"
    assert cli_main(["compare", str(runs["base"]), str(runs["same"]), "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err


def test_each_run_is_sorted_once_per_step_for_all_its_pairs(
    runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three pairs share the run `base`: it is read and sorted once per step, not once per pair."""
    import flashprobe.weights.compare as compare

    calls: list[int] = []
    real = compare.sorted_values
    monkeypatch.setattr(compare, "sorted_values", lambda x: calls.append(x.numel()) or real(x))
    pairs = {
        "same": (runs["base"], runs["same"]),
        "seed": (runs["base"], runs["seed1"]),
        "back": (runs["seed1"], runs["base"]),
    }
    result = compare.compare_runs(pairs)
    names = SnapshotStore(runs["base"]).names("parameter")
    distributions = {(n,) for n in names} | {tuple(names)}  # each tensor, the whole model, each group:
    distributions |= {tuple(n for n in names if group_of(n, 2) == g) for g in result.pairs["same"].groups}
    # (a group of one tensor is that tensor's distribution, sorted once)
    assert len(calls) == 3 * len(distributions) * len(result.pairs["same"].steps)  # 3 runs, not 6 sides
    for name, (a, b) in pairs.items():  # and the distances are those of each pair alone
        alone = compare_pair(a, b, name=name)
        assert [d.wasserstein for d in result.pairs[name].model] == [d.wasserstein for d in alone.model]
