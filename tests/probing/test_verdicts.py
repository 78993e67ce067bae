"""The probe's verdict in training: buggy kernels of real bug classes fail at the site, direction and
step their bug first fires, their reproducers replay to a failure (and pass with a correct kernel);
correct kernels pass over many seeds.

The loop trains a two-site model whose shapes change at known steps (:data:`SCHEDULE`): a causal
self-attention ``attn0`` and a non-causal one with an explicit scale and, at the last step, a
padding mask that fully masks the padded queries (``attn1``). The head dim is 80 (> 64), q/k/v are
transposed views of ``(B, N, H, D)`` projections, training is fp32. The expected first failures
follow from each bug's trigger (lab/mutants.py), which are checked in
tests/probing/test_buggy_kernels.py against an FP64 oracle.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.cli import main as cli_main
from flashprobe.probing import ProbeFailureError, ProbeWarning, probe
from flashprobe.probing.repro import load_reproducer, replay
from lab.mutants import register_mutants

#: ``(batch, tokens, padded)`` per step: the shape each step's calls have.
SCHEDULE: tuple[tuple[int, int, bool], ...] = (
    (1, 64, False),  # 0: multiples of 64: quiet for every length-dependent bug but N_k % 128 == 64
    (2, 64, False),  # 1: a second batch entry (batch mix-ups)
    (2, 40, False),  # 2: a partial last key tile of 32 (40 % 32 = 8)
    (2, 48, False),  # 3: N % 32 == 16 (NaN rows)
    (2, 96, False),  # 4: keys beyond 64
    (2, 64, True),  # 5: padding: attn1's padded queries are fully masked
)
D_HEAD, HEADS = 80, 2

BOTH = ("attn0", "attn1")
#: bug -> the first failures the verdict must report: ``{site: (direction, step)}`` (no other site
#: fails, and nothing fails at a site before that step).
EXPECTED: dict[str, dict[str, tuple[str, int]]] = {
    "scale_ignored": {"attn1": ("out", 0)},  # only attn1 passes an explicit scale
    "head_dim_truncated": {s: ("out", 0) for s in BOTH},
    "causal_off_by_one": {"attn0": ("out", 0)},  # only attn0 is causal
    "keys_truncated": {s: ("out", 4) for s in BOTH},
    "nan_rows": {"attn0": ("out", 3)},  # attn1 gets attn0's NaN as input: its golden is NaN too
    "batch_kv_mixup": {s: ("out", 1) for s in BOTH},
    "strides_ignored": {s: ("out", 0) for s in BOTH},
    "fp32_bf16_scores": {s: ("out", 0) for s in BOTH},
    "mask_sentinel": {"attn1": ("out", 5)},
    "dq_unscaled": {s: ("dq", 0) for s in BOTH},
    "dk_partial_tile": {s: ("dk", 2) for s in BOTH},
    "dq_nan": {"attn1": ("dq", 0)},  # the backward reaches attn1 first; attn0 then gets a NaN gradient
    "ds_bf16": {s: ("dq", 0) for s in BOTH},
    "dv_unmasked": {"attn0": ("dv", 0), "attn1": ("dv", 5)},
}


class Attention(nn.Module):
    """Self-attention with q/k/v as transposed views of one ``(B, N, 3, H, D)`` projection."""

    def __init__(self, *, causal: bool, scale: float | None) -> None:
        super().__init__()
        self.causal, self.scale = causal, scale
        self.qkv = nn.Linear(HEADS * D_HEAD, 3 * HEADS * D_HEAD)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, D_HEAD).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=self.causal,
            scale=self.scale,
        )
        return x + y.transpose(1, 2).reshape(b, n, -1)


class TwoSites(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, HEADS * D_HEAD)
        self.attn0 = Attention(causal=True, scale=None)
        self.attn1 = Attention(causal=False, scale=1.0 / D_HEAD)  # explicit, not 1/sqrt(D)
        self.head = nn.Linear(HEADS * D_HEAD, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.head(self.attn1(self.attn0(self.inp(x), None), mask))


def _padding_mask(b: int, n: int) -> torch.Tensor:
    """``(B, 1, N, N)`` bool: entry ``i`` has its last ``8 i`` tokens padded, as queries and keys."""
    valid = torch.arange(n)[None, :] < (n - 8 * torch.arange(b))[:, None]  # (B, N)
    return (valid[:, None, :, None] & valid[:, None, None, :]).contiguous()


def train(primary: str | None, *, seed: int = 0, autocast: bool = False, **probe_args):
    """The scheduled loop under ``probe(model, primary, backward=True)``; returns the probe."""
    torch.manual_seed(seed)
    model = TwoSites()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    p = probe(model, primary=primary, backward=True, **probe_args)
    try:
        for step, (b, n, padded) in enumerate(SCHEDULE):
            p.set_step(step)
            x = torch.randn(b, n, 4, generator=gen)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x, _padding_mask(b, n) if padded else None)
            out.float().square().mean().backward()
            opt.step()
    finally:
        p.detach()
    return p


@pytest.fixture
def bugs() -> None:
    register_mutants()  # unregistered after the test by the autouse fixture of tests/conftest.py


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_a_buggy_kernel_fails_where_and_when_its_bug_fires(bug: str, bugs: None, tmp_path: Path) -> None:
    p = train(f"bug_{bug}", repro_dir=tmp_path, on_failure="ignore")
    summary = p.summary()
    assert summary.verdict == "fail"
    failures = p.failures
    first_step = {}
    for f in failures:
        first_step[f.site] = min(first_step.get(f.site, f.step), f.step)
    assert first_step == {site: step for site, (_, step) in EXPECTED[bug].items()}, failures
    for site, (direction, step) in EXPECTED[bug].items():
        failure = next(f for f in failures if (f.site, f.direction) == (site, direction))
        assert failure.step == step, failure
        # far beyond the criterion's limit: the rule's margin on this side (docs/calibration.md)
        assert failure.kind == "nonfinite" or failure.value > 10 * failure.limit, failure
    stats = p.stats()
    for site in set(BOTH) - set(EXPECTED[bug]):  # a site fed another site's NaN is not blamed
        assert stats[site]["verdict"] == "pass", stats[site]["verdict_reason"]
    # The reproducer of the named failure replays to a failure, and passes with correct kernels.
    site, (direction, step) = next(iter(EXPECTED[bug].items()))
    failure = next(f for f in failures if (f.site, f.direction) == (site, direction))
    call = load_reproducer(failure.repro)
    assert (call.meta["site"], call.meta["direction"], call.meta["step"]) == (site, direction, step)
    assert call.grad_out is not None  # the call had a backward: one file holds every direction
    results = replay(call, [f"bug_{bug}", "bug_none", "sdpa_math"])
    assert results[f"bug_{bug}"]["verdict"] == "fail", results
    assert results["bug_none"]["verdict"] == "pass", results
    assert results["sdpa_math"]["verdict"] == "pass", results


@pytest.mark.parametrize("primary", [None, "sdpa_math", "tiled", "bug_none"])
@pytest.mark.parametrize("seed", range(5))
def test_correct_kernels_pass_the_same_loop(primary: str | None, seed: int, bugs: None) -> None:
    p = train(primary, seed=seed, on_failure="raise")
    summary = p.summary()
    assert summary.verdict == "pass", summary.verdict_reason
    assert summary.failures == []
    assert summary.forward_calls == 2 * len(SCHEDULE) and summary.backward_calls == 2 * len(SCHEDULE)


@pytest.mark.parametrize("primary", [None, "bug_none"])
def test_correct_kernels_pass_under_bf16_autocast(primary: str | None, bugs: None) -> None:
    p = train(primary, autocast=True, on_failure="raise")
    assert p.summary().verdict == "pass"


def test_on_failure_raise_stops_at_the_failing_call(bugs: None, tmp_path: Path) -> None:
    # With backward=True a call is judged in its backward, which reaches attn1 first.
    with pytest.raises(ProbeFailureError, match=r"site 'attn1', out, step 1: relative L2 error") as info:
        train("bug_batch_kv_mixup", on_failure="raise", repro_dir=tmp_path)
    assert info.value.failure.step == 1
    assert Path(info.value.failure.repro).is_file()


def test_on_failure_warn_says_site_direction_step_and_reproducer(bugs: None, tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train("bug_dk_partial_tile", repro_dir=tmp_path)
    lines = [str(w.message) for w in caught if issubclass(w.category, ProbeWarning)]
    lines = [line for line in lines if "FAIL" in line]
    # one line per first failure of each site and direction (dk first; dq, dv follow through the model)
    assert any("site 'attn0', dk, step 2" in line and "flashprobe replay" in line for line in lines), lines
    assert len(lines) == len({line.split(":")[1] for line in lines})


def test_reproducers_are_bounded_and_replay_from_the_command_line(bugs: None, tmp_path: Path) -> None:
    p = train("bug_dq_unscaled", repro_dir=tmp_path, max_reproducers=1, on_failure="ignore")
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and len(p.failures) > 1  # the rest are recorded without a file
    assert files[0].with_suffix(".py").is_file()
    assert cli_main(["replay", str(files[0]), "--kernel", "bug_dq_unscaled"]) == 1
    assert cli_main(["replay", str(files[0]), "--kernel", "bug_none", "--kernel", "sdpa_math"]) == 0


def test_replay_refuses_what_is_not_a_reproducer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(SystemExit) as info:
        cli_main(["replay", str(bad), "--kernel", "math"])
    assert info.value.code == 2
    assert "not a safetensors file" in capsys.readouterr().err


@pytest.mark.parametrize("bug", ["dk_partial_tile", "batch_kv_mixup", "causal_off_by_one"])
def test_a_reproducer_shrinks_to_a_smaller_failing_call(bug: str, bugs: None, tmp_path: Path) -> None:
    from flashprobe.probing.repro import shrink_reproducer

    p = train(f"bug_{bug}", repro_dir=tmp_path, on_failure="ignore")
    call = load_reproducer(p.failures[0].repro)
    small, tries = shrink_reproducer(call, f"bug_{bug}")
    assert small.q.numel() < call.q.numel() and tries > 1
    assert replay(small, [f"bug_{bug}"])[f"bug_{bug}"]["verdict"] == "fail"
    assert replay(small, ["bug_none"])["bug_none"]["verdict"] == "pass"
    if bug == "batch_kv_mixup":  # needs a second batch entry to fire: the shrinker keeps two
        assert small.q.shape[0] == 2


def test_fuzz_from_a_training_reproducer_shrinks_it(bugs: None, tmp_path: Path, capsys) -> None:
    p = train("bug_keys_truncated", repro_dir=tmp_path / "repro", on_failure="ignore")
    repro = p.failures[0].repro
    capsys.readouterr()
    assert cli_main(["fuzz", "--from", repro, "--out", str(tmp_path / "fuzz")]) == 1  # the recorded primary
    out = capsys.readouterr().out
    assert "bug_keys_truncated: FAIL" in out and "shrunk B x H x N_q x N_k" in out
    (shrunk,) = (tmp_path / "fuzz").glob("*.shrunk.safetensors")
    small = load_reproducer(shrunk)
    assert (
        small.k.shape[2] > 64 and small.q.numel() < load_reproducer(repro).q.numel()
    )  # the bug needs N_k > 64
    assert (
        cli_main(["replay", str(shrunk)]) == 1
        and cli_main(["replay", str(shrunk), "--kernel", "bug_none"]) == 0
    )
    assert cli_main(["fuzz", "--from", repro, "--kernel", "bug_none", "--out", str(tmp_path / "fuzz")]) == 0
