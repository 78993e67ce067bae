"""Fig 8 draws every comparison, including one whose distance is 0 at every step."""

from __future__ import annotations

from flashprobe.report.weights_figures import wasserstein_curves_figure


def _pair(values: list[float]) -> dict:
    return {"steps": [0, 10, 20], "model": {"wasserstein": values, "max_abs": values}}


def test_a_pair_at_zero_is_a_dashed_line_below_every_other_curve() -> None:
    fig = wasserstein_curves_figure(
        {"flash_vs_baseline": _pair([0.0, 1e-8, 1e-6]), "identical": _pair([0.0, 0.0, 0.0])}
    )
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"flash_vs_baseline", "identical: 0 at every step (drawn low)"}
    flash, zero = lines["flash_vs_baseline"], lines["identical: 0 at every step (drawn low)"]
    assert list(flash.get_xdata()) == [10, 20]  # the 0 at step 0 has no place on the log axis
    assert zero.get_linestyle() == "--"
    floor = zero.get_ydata()[0]
    assert ax.get_ylim()[0] < floor < min(flash.get_ydata())  # visible, below the data


def test_only_zero_pairs_still_draw() -> None:
    ax = wasserstein_curves_figure({"identical": _pair([0.0, 0.0, 0.0])}).axes[0]
    (zero,) = ax.get_lines()
    assert ax.get_ylim()[0] < zero.get_ydata()[0] < ax.get_ylim()[1]


def test_a_comparison_at_several_replicates_is_its_median_in_a_band_from_lowest_to_highest() -> None:
    replicates = {  # three seeds of one comparison, and a one-replicate comparison beside it
        "flash_vs_baseline": _pair([0.0, 2e-7, 2e-6]),
        "flash_vs_baseline_seed2": _pair([0.0, 1e-7, 3e-6]),
        "flash_vs_baseline_seed4": _pair([0.0, 4e-7, 1e-6]),
        "seed1_vs_seed0": _pair([1e-4, 2e-4, 3e-4]),
    }
    groups = {"flash_vs_baseline": list(replicates)[:3], "seed1_vs_seed0": ["seed1_vs_seed0"]}
    ax = wasserstein_curves_figure(replicates, groups).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"flash_vs_baseline (3 replicates)", "seed1_vs_seed0"}
    median = lines["flash_vs_baseline (3 replicates)"]
    assert list(median.get_xdata()) == [10, 20] and list(median.get_ydata()) == [2e-7, 2e-6]
    (band,) = ax.collections  # fill_between: the lowest to the highest replicate at each step
    ys = {}
    for x, y in band.get_paths()[0].vertices:
        ys.setdefault(round(x), set()).add(float(y))
    assert min(ys[10]) == 1e-7 and max(ys[10]) == 4e-7 and min(ys[20]) == 1e-6 and max(ys[20]) == 3e-6
    assert "band: lowest to highest replicate" in ax.get_title()


def test_curves_that_overlap_are_said_to_overlap() -> None:
    """Two comparisons with the same distances at every step draw one line on the other: the legend
    says so (and the later one is dashed), as it does for several comparisons at 0."""
    pairs = {
        "tiled_vs_sdpa": _pair([0.0, 1e-6, 2e-6]),
        "seed": _pair([1e-3, 2e-3, 3e-3]),
        "named_vs_unnamed": _pair([0.0, 1e-6, 2e-6]),
        "identical": _pair([0.0, 0.0, 0.0]),
        "repeat": _pair([0.0, 0.0, 0.0]),
    }
    lines = {line.get_label(): line for line in wasserstein_curves_figure(pairs).axes[0].get_lines()}
    assert set(lines) == {
        "tiled_vs_sdpa",
        "seed",
        "named_vs_unnamed — the same curve as tiled_vs_sdpa (they overlap)",
        "identical: 0 at every step (drawn low; overlaps repeat)",
        "repeat: 0 at every step (drawn low; overlaps identical)",
    }
    assert lines["named_vs_unnamed — the same curve as tiled_vs_sdpa (they overlap)"].get_linestyle() == "--"
    assert lines["tiled_vs_sdpa"].get_linestyle() == "-"
