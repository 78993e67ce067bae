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
