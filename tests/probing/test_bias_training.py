"""The probe's signed bias (flashprobe.bias) in bf16 training, both ways: a kernel that rounds its
output to bf16 by truncation (the suite's ``output_truncated``) passes every call yet reads
``biased`` (site, summary, verdict); torch's kernels, ``tiled`` fa2 and ``math`` do not, over
several seeds. The on-device sums equal a :class:`BiasStats` fed the same tensors directly, survive
:meth:`reset`, and compose across intervals as sums do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe import register_kernel
from flashprobe.bias import BIAS_Z_LIMIT, BiasStats
from flashprobe.callbacks.attention_probe import verdict_line
from flashprobe.kernels import get_kernel
from flashprobe.kernels.math import golden_attention
from flashprobe.probing import probe
from flashprobe.probing.summary import ProbeSummary, bias_words, summarize, summary_scalars
from lab.mutants import output_truncated, register_mutants

WIDTH, HEADS, TOKENS = 32, 2, 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(h.transpose(1, 2).reshape(b, n, WIDTH))


def train(primary: str, seed: int, steps: int, bias=None, **probe_args):  # type: ignore[no-untyped-def]
    """A two-block causal model in bf16, trained ``steps`` AdamW steps on random data under the probe
    (restored from the ``bias`` sums of :meth:`ShadowAttention.bias_state` where given)."""
    torch.manual_seed(seed)
    model = nn.Sequential(_Block(), _Block()).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    p = probe(model, primary=primary, on_failure="ignore", **probe_args)
    if bias is not None:
        p.shadow.restore_bias(bias)
    try:
        for step in range(steps):
            p.set_step(step)
            x = torch.randn(2, TOKENS, WIDTH, generator=gen).to(torch.bfloat16)
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()
    finally:
        p.detach()
    return p


@pytest.fixture
def truncating() -> str:
    register_mutants()  # unregistered after the test by the autouse fixture of tests/conftest.py
    return "bug_output_truncated"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_truncating_kernel_is_reported_biased_without_failing_a_call(truncating: str, seed: int) -> None:
    p = train(truncating, seed=seed, steps=50, backward=True)
    stats = p.stats()
    for site, entry in stats.items():
        out = entry["forward"]["out"]
        assert out["failed_calls"] == 0 and out["first_failure"] is None  # every call passes
        assert out["bias"]["verdict"] == "biased", (site, out["bias"])
        assert out["bias"]["component"] == "magnitude" and out["bias"]["z"] < -BIAS_Z_LIMIT  # toward zero
        assert entry["verdict"] == "fail" and entry["verdict_reason"].startswith("biased: out z=-")
    summary = p.summary()
    assert summary.verdict == "fail", summary.verdict_reason
    assert "biased at" in summary.verdict_reason and "(limit 5)" in summary.verdict_reason
    assert summary.max_bias_z < -BIAS_Z_LIMIT
    assert {(b["site"], b["direction"]) for b in summary.biased} >= {(s, "out") for s in stats}
    assert summary.failures == []  # a bias is not a per-call failure
    # in words (the callback's last line, probe.png's title) and as a logged scalar
    z = summary.max_bias_z
    assert bias_words(summary).startswith(
        f"biased: out of {summary.max_bias_site.split(':')[0]} z={z:.3g}"
    )
    assert "biased: out of" in verdict_line(summary)
    assert summary_scalars(summary)["probe/max_bias_z"] == z


@pytest.mark.parametrize("kernel", ["sdpa_flash", "sdpa_math", "tiled:preset=fa2", "math"])
def test_correct_kernels_are_not_biased_over_seeds(kernel: str) -> None:
    for seed in range(5):
        p = train(kernel, seed=seed, steps=50, backward=True)
        summary = p.summary()
        assert summary.biased == [], (kernel, seed, summary.biased)
        assert abs(summary.max_bias_z) < BIAS_Z_LIMIT
        assert summary.verdict == "pass", (kernel, seed, summary.verdict_reason)
        within = summary.max_bias_z == 0  # no mean above the tolerance
        assert bias_words(summary).startswith("bias within tolerance" if within else "bias |z| ≤ ")


def _bare(**values: object) -> ProbeSummary:
    """A summary of no site with ``values`` set."""
    return dataclasses.replace(summarize({}), **values)


def test_bias_in_words_says_within_tolerance_where_no_mean_exceeds_it() -> None:
    assert bias_words(_bare(max_bias_z=None)) == ""
    assert bias_words(_bare(max_bias_z=-1.93)) == "bias |z| ≤ 1.9 (limit 5)"
    assert bias_words(_bare(max_bias_z=0.0)) == (
        "bias within tolerance: every mean ≤ 0.1 of the baseline's error RMS"
    )


def test_the_on_device_sums_equal_bias_stats_fed_directly_and_survive_reset(truncating: str) -> None:
    """The probe's bias of the output against an oracle: BiasStats fed the primary, the golden and
    the baseline (math in bf16) of the very calls the probe saw, recorded with a hook."""
    seen: list[tuple[torch.Tensor, ...]] = []

    def recording(q, k, v, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((q.detach().clone(), k.detach().clone(), v.detach().clone(), kwargs))
        return output_truncated(q, k, v, **kwargs)

    register_kernel("bias_recording", recording, overwrite=True)
    torch.manual_seed(3)
    block = _Block().to(torch.bfloat16)
    p = probe(block, primary="bias_recording")
    gen = torch.Generator().manual_seed(4)
    try:
        for _ in range(4):
            with torch.no_grad():
                block(torch.randn(2, TOKENS, WIDTH, generator=gen).to(torch.bfloat16))
            p.stats()
            p.reset()  # an interval ends: the bias is the run's, kept
    finally:
        p.detach()
    (site,) = p.stats()
    oracle = BiasStats(("out",))
    baseline = get_kernel("math")
    for q, k, v, kwargs in seen:
        primary = output_truncated(q, k, v, **kwargs)
        oracle.add("out", primary, golden_attention(q, k, v, **kwargs), baseline(q, k, v, **kwargs))
    got = p.stats()[site]["forward"]["out"]["bias"]
    want = oracle.as_dict()["out"]
    assert got["replicates"] == want["replicates"] == 4 * 2 * HEADS
    for c in ("offset", "magnitude"):
        assert got[c]["z"] == pytest.approx(want[c]["z"], rel=1e-9)
        assert got[c]["mean"] == pytest.approx(want[c]["mean"], rel=1e-9)
    assert p.stats()[site]["forward"]["calls"] == 0  # the interval's own statistics were reset


def test_summarize_reads_the_bias_of_stats_it_is_given() -> None:
    """Intervals and ranks compose by adding the sums: two halves read as the whole."""
    from flashprobe.probing.stats import DeviationStats

    whole, first, second = DeviationStats("cpu"), DeviationStats("cpu"), DeviationStats("cpu")
    gen = torch.Generator().manual_seed(0)
    for i in range(8):
        q, k, v = (torch.randn(1, 2, 8, 4, generator=gen).to(torch.bfloat16) for _ in range(3))
        args = (output_truncated(q, k, v), golden_attention(q, k, v), get_kernel("math")(q, k, v))
        whole.bias.add("out", *args)
        (first if i < 4 else second).bias.add("out", *args)
    merged = DeviationStats("cpu")
    merged.values += first.values + second.values
    a, b = whole.as_dict()["forward"]["out"]["bias"], merged.as_dict()["forward"]["out"]["bias"]
    for c in ("offset", "magnitude"):
        assert a[c] == pytest.approx(b[c], rel=1e-12)
    assert a["replicates"] == b["replicates"] == 16 and a["verdict"] == b["verdict"]
    assert summarize({"s": {**whole.as_dict(), "shadow_errors": 0}}).max_bias_z == pytest.approx(a["z"])


def test_bias_state_restores_into_a_new_probe(truncating: str) -> None:
    """A probe restored from another's :meth:`bias_state`, then fed the same calls again, holds
    twice the sums: one probe over both runs."""
    state = train(truncating, seed=5, steps=2).shadow.bias_state()
    assert len(state) == 2 and all(sums[0] > 0 for sums in state.values())
    again = train(truncating, seed=5, steps=2, bias=state)
    for site, sums in again.shadow.bias_state().items():
        assert sums == pytest.approx([2 * x for x in state[site]], rel=1e-12)
    with pytest.raises(ValueError, match="bias sums, expected 24"):
        again.shadow.restore_bias({"x": [0.0]})
