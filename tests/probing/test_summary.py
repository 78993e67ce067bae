"""The summary over sites: worst values, their sites, and every non-finite value counted."""

from __future__ import annotations

import math

import torch

from flashprobe.probing import FIELDS, ShadowAttention, stats_dict, summarize


def _entry(**fields: float) -> dict:
    values = torch.zeros(len(FIELDS), dtype=torch.float64)
    for name, value in fields.items():
        values[FIELDS.index(name.replace("__", "."))] = value
    entry = stats_dict(values.tolist())
    entry["shadow_errors"], entry["dropout_calls"] = 0, 0
    return entry


def test_summarize_finds_the_worst_sites_and_counts_nonfinite() -> None:
    stats = {
        "a": _entry(
            out__calls=2,
            out__primary_golden__max_abs=3.0,
            out__baseline_golden__max_abs=1.0,
            out__primary_baseline__max_abs=0.5,
            dk__calls=1,
            dk__primary_golden__max_abs=1.0,
            dk__baseline_golden__max_abs=1.0,
            nonfinite_inputs__q=2,
        ),
        "b": _entry(
            out__calls=1,
            out__primary_golden__max_abs=1.0,
            out__baseline_golden__max_abs=1.0,
            out__primary_baseline__max_abs=2.0,
            dv__calls=1,
            dv__primary_golden__max_abs=4.0,
            dv__baseline_golden__max_abs=1.0,
            dv__baseline_golden__nonfinite=5,
        ),
        "c": _entry(),
    }
    stats["b"]["shadow_errors"] = 1
    summary = summarize(stats)
    assert summary.sites == 3 and summary.forward_calls == 3 and summary.backward_calls == 2
    assert (summary.max_error_ratio, summary.max_error_ratio_site) == (3.0, "a")
    assert (summary.max_backward_error_ratio, summary.max_backward_error_ratio_site) == (4.0, "b:dv")
    assert summary.max_abs == {"primary_baseline": 2.0, "primary_golden": 3.0, "baseline_golden": 1.0}
    assert summary.nonfinite == 7 and summary.nonfinite_sites == ["a", "b"]
    assert summary.shadow_errors == 1


def test_summarize_of_nothing_and_the_shadow_summary_agree() -> None:
    assert summarize({}).max_error_ratio is None
    shadow = ShadowAttention()
    q = torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    shadow(q, q, q)
    assert shadow.summary() == summarize(shadow.stats())
    assert not math.isnan(shadow.summary().max_error_ratio)
