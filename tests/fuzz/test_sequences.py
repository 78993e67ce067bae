"""Sequences (flashprobe.fuzz.sequences): kernels that keep state between calls fail on the call their
cache key misses, their controls pass, and a failing sequence is one reproducer that replays every call.

Independent oracle: each bug's failing call is re-run here after the same earlier calls and compared
with a float64 softmax written in this file; the same call in a fresh process (state forgotten) is right.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashprobe.formats.reproducer import ReproducerError
from flashprobe.fuzz import CHECKS, SEQUENCES, replay_sequence, select_checks
from flashprobe.fuzz.cli import main
from flashprobe.fuzz.invariants import run_checks
from flashprobe.fuzz.sequences import Builder, Step, _call, _in_place, _layout, _Storage, run_steps
from flashprobe.kernels import get_kernel
from flashprobe.probing.replay_cli import main as replay_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def planted():
    """The planted kernels of lab.sequence_mutants and the held-out ones, state forgotten."""
    import lab.sequence_mutants as m

    m.register()
    m.register_heldout()
    return m


def softmax64(q, k, v, mask=None, causal=False, scale=None) -> torch.Tensor:
    """Attention in float64 from the definition: ``softmax(q kᵀ · scale) v`` over visible keys."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def run(kernel: str, check: str, dtype=torch.bfloat16, seed: int = 0):
    return CHECKS[check].run(get_kernel(kernel), dtype, seed, "math", True, "cpu")


# (bug, the sequence that shows it, its control); bugs of lab.sequence_mutants and of lab.heldout
STATEFUL = [
    ("plant_plan_no_scale", "seq_scale", "plant_plan_full"),
    ("plant_plan_no_strides", "seq_layout", "plant_plan_full"),
    ("plant_plan_no_mask", "seq_mask", "plant_plan_full"),
    ("plant_plan_no_dtype", "seq_dtype", "plant_plan_full"),
    ("plant_memo_pointer", "seq_in_place", "plant_memo_versioned"),
    ("plant_stale_dout", "seq_dout", "plant_fresh_dout"),
    ("plant_scratch_stale", "seq_grow", "plant_scratch_exact"),
    ("plant_pages_gathered", "seq_pages", "plant_pages_keyed"),
    ("heldout_fa2_plan_key_no_scale", "seq_scale", "heldout_fa2_planned"),
    ("heldout_fa2_plan_key_no_strides", "seq_layout", "heldout_fa2_planned"),
    ("heldout_fa2_stale_dout_backward", "seq_dout", "heldout_fa2_handwritten_backward"),
    ("heldout_fa2_kvcache_reused_scratch", "seq_grow", "heldout_fa2_kvcache_splitkv"),
]


@pytest.mark.parametrize(("bug", "check", "control"), STATEFUL, ids=[b for b, _, _ in STATEFUL])
def test_stateful_bug_fails_its_sequence_and_control_passes(planted, bug, check, control) -> None:
    found = run(bug, check)
    assert found.verdict == "fail", found.reason
    assert "sequence: 1." in found.reason and found.saved is not None
    planted.register_heldout()  # fresh state for the control
    planted.reset()
    assert run(control, check).verdict == "pass"


@pytest.mark.parametrize(
    ("bug", "check"),
    [("heldout_fa2_plan_key_no_scale", "seq_scale"), ("heldout_fa2_plan_key_no_strides", "seq_layout"),
     ("heldout_fa2_kvcache_reused_scratch", "seq_grow"), ("plant_memo_pointer", "seq_in_place")],
)  # fmt: skip
def test_failing_call_is_wrong_only_after_the_earlier_calls(planted, bug, check) -> None:
    """The oracle of this file: the failing call alone (state forgotten) is right; after the calls
    before it, its output is far from a float64 softmax of its own inputs."""
    from lab.heldout.stateful import reset_state

    found = run(bug, check)
    steps, tensors = found.saved
    i = int(found.reason.split("call ")[1].split(" of")[0]) - 1
    kernel = get_kernel(bug)

    def last_error(calls: list[Step]) -> float:
        """Relative error of the last call's output after ``calls``, made here in a fresh state."""
        reset_state()
        planted.reset()
        storage = _Storage()
        for step in calls:
            bufs = [storage.put(f"{step.slot}.{r}", tensors[n], step.layout)
                    for r, n in zip("qkv", (step.q, step.k, step.v), strict=True)]  # fmt: skip
            mask = tensors[step.mask] if step.mask else None
            out = kernel.run(_call(kernel, step, *bufs, mask)).out
        if step.k_lens:
            n_k = tensors[step.k].shape[2]
            mask = (torch.arange(n_k) < torch.tensor(step.k_lens)[:, None])[:, None, None, :]
        ref = softmax64(tensors[step.q], tensors[step.k], tensors[step.v], mask, step.causal, step.scale)
        return ((out.double() - ref).norm() / ref.norm()).item()

    assert last_error([steps[i]]) < 0.02  # alone: right (bf16 rounding)
    assert last_error(steps[: i + 1]) > 0.2  # after the earlier calls: wrong


def test_stale_dout_is_wrong_in_dq_dk_not_dv(planted) -> None:
    """The oracle: float64 autograd through the definition gives dq, dk, dv for the second dO; the
    stale-dO kernel's dq and dk are far from them, its dv right."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.float32) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = get_kernel("plant_stale_dout")(*leaves)
    d1, d2 = torch.randn_like(out), torch.randn_like(out)
    torch.autograd.grad(out, leaves, d1, retain_graph=True)
    found = torch.autograd.grad(out, leaves, d2)
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(softmax64(*wide), wide, d2.double())
    rel = [((f.double() - w).norm() / w.norm()).item() for f, w in zip(found, want, strict=True)]
    assert rel[0] > 0.1 and rel[1] > 0.1 and rel[2] < 1e-5
    assert run("plant_stale_dout", "seq_dout", torch.float32).failure.startswith(("dq", "dk"))


def test_cli_saves_one_reproducer_that_replays_every_call(planted, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["--import", "lab.sequence_mutants", "--kernel", "heldout_fa2_plan_key_no_scale",
            "--case", "seq_*", "--dtype", "bf16", "--out", str(out)]  # fmt: skip
    assert main(argv) == 1
    printed = capsys.readouterr().out
    assert "FAIL  heldout_fa2_plan_key_no_scale | seq_scale | bf16: call 2 of 3" in printed
    repros = sorted(out.glob("repro_seq_scale_*.safetensors"))
    assert len(repros) == 1
    data = json.loads((out / "fuzz.json").read_text())
    rows = [r for r in data["rows"] if r["case"] == "seq_scale"]
    assert rows[0]["verdict"] == "fail" and rows[0]["repro"] == str(repros[0])
    # replayed: every call in order, the second fails as it did; the control passes them all
    assert replay_main([str(repros[0])]) == 1
    printed = capsys.readouterr().out
    assert "a sequence of 3 calls" in printed and "call 2 (same tensors, scale" in printed
    assert replay_main([str(repros[0]), "--kernel", "heldout_fa2_planned"]) == 0
    results = replay_sequence(repros[0])["heldout_fa2_plan_key_no_scale"]
    assert [c[:3] for c in results["calls"]] == [
        (1, "out", "pass"),
        (1, "backward 1", "pass"),
        (2, "out", "fail"),
    ]
    # the script beside it, in a fresh process: it imports the module that registered the kernel
    script = repros[0].with_suffix(".py")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""})  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "heldout_fa2_plan_key_no_scale: FAIL" in done.stdout


def test_sequence_reproducer_is_read_as_data(tmp_path) -> None:
    tensors = {"q": torch.zeros(1, 1, 2, 4)}
    ok = {"q": "q", "k": "q", "v": "q", "note": "n"}
    assert Step.from_dict(ok, tensors).layout == "bhnd"
    for bad in ({**ok, "layout": "nhd"}, {**ok, "k": "missing"}, {**ok, "causal": "yes"}, {**ok, "evil": 1},
                {**ok, "grads": [["q"]]}, {**ok, "k_lens": [-1]}, ["q"]):  # fmt: skip
        with pytest.raises(ReproducerError):
            Step.from_dict(bad, tensors)
    plain = tmp_path / "x.safetensors"
    plain.write_bytes(b"not a file")
    with pytest.raises(ReproducerError, match="not a safetensors reproducer"):
        replay_sequence(plain)


def test_steps_share_storage_by_slot_and_run_in_order() -> None:
    """Steps of one slot write into the same memory: the kernel sees the same pointers."""
    seen = []

    def spy(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        seen.append((q.data_ptr(), q.stride()))
        return softmax64(q, k, v, attn_mask, is_causal, scale).to(q.dtype)

    from flashprobe import register_kernel

    register_kernel("spy_seq", spy, overwrite=True)
    b = Builder(
        get_kernel("spy_seq"), torch.float32, torch.Generator().manual_seed(0), False, torch.device("cpu")
    )
    steps = SEQUENCES["seq_in_place"]  # three calls of one slot
    judged = run_steps(get_kernel("spy_seq"), _in_place(b), b.tensors, backward=False)
    assert [v.verdict for _, _, v in judged] == ["pass"] * 3
    assert len({p for p, _ in seen}) == 1  # the same memory, new values
    seen.clear()
    run_steps(get_kernel("spy_seq"), _layout(b), b.tensors, backward=False)
    assert seen[0][1] != seen[1][1] and seen[0] == seen[2]  # NHD views between two BHND calls
    assert steps.property.startswith("sequence")


def test_correct_kernels_pass_every_sequence() -> None:
    """No false alarm: built-in kernels computed differently pass (or are not applicable to) every
    sequence at every dtype (more seeds: the slow test below)."""
    for kernel in ("sdpa_math", "tiled", "math"):
        for dtype in (torch.bfloat16, torch.float32):
            for name in SEQUENCES:
                found = run(kernel, name, dtype, seed=1)
                assert found.verdict in ("pass", "unsupported"), (kernel, name, found.reason)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_correct_kernels_pass_every_sequence_over_seeds(seed) -> None:
    import lab.contracts as contracts

    contracts.register_controls()
    for kernel in ("sdpa_math", "sdpa_flash", "tiled", "math", *contracts.CONTROLS):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for name in SEQUENCES:
                found = run(kernel, name, dtype, seed)
                assert found.verdict in ("pass", "unsupported"), (kernel, name, found.reason)


def test_select_checks_by_case_patterns() -> None:
    checks, rest = select_checks(None)
    assert {c.name for c in checks} >= {"seq_scale", "inv_unit_values"} and rest == []
    checks, rest = select_checks(["seq_*"])
    assert {c.name for c in checks} == {n for n, c in SEQUENCES.items() if "default" in c.profiles}
    assert rest is None  # no catalogue case wanted
    assert {c.name for c in select_checks(["seq_*"], profile="full")[0]} == set(SEQUENCES)
    assert [c.name for c in select_checks(["seq_mask"])[0]] == ["seq_mask"]  # named: whatever its profile
    assert {"seq_scale", "seq_layout", "seq_dout", "seq_grow"} <= {c.name for c in select_checks(None)[0]}
    checks, rest = select_checks(["sentinel_*"])
    assert checks == [] and rest == ["sentinel_*"]
    checks, rest = select_checks(["!seq_*", "!inv_*"])
    assert checks == [] and rest == ["!seq_*", "!inv_*"]


def test_a_kernel_refusing_a_call_at_run_time_is_unsupported_not_failed(register, tmp_path, capsys) -> None:
    """A kernel that raises KernelInputError (its refusal, as a decode kernel refuses N_q > 1) makes a
    sequence or invariant row ``unsupported`` naming the refusal, as the catalogue does; any other
    exception still fails. The refusing kernel's output, where it computes, is the float64 softmax;
    its replay of a sequence reproducer exits 2 (refused), not 1 (failed)."""
    from flashprobe.kernels import KernelInputError

    def one_query(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        if q.shape[-2] != 1:
            raise KernelInputError(f"a decode kernel: one query per sequence, not N_q={q.shape[-2]}")
        return softmax64(q, k, v, attn_mask, is_causal, scale).to(q.dtype)

    def crashing(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        raise RuntimeError("an illegal memory access")

    register("one_query", one_query)
    register("crashing", crashing)
    checks = [CHECKS[n] for n in ("seq_scale", "seq_layout", "inv_unit_values", "inv_value_scaling")]
    rows = run_checks(["one_query", "crashing"], [torch.float32], checks)
    assert len(rows) == 8
    for row in rows:
        if row.kernel == "one_query":
            assert row.verdict == "unsupported", (row.case, row.reason)
            assert "refused: KernelInputError: a decode kernel" in row.reason, row.reason
        else:
            assert row.verdict == "fail", (row.case, row.reason)
    out = tmp_path / "out"
    argv = ["--import", "lab.sequence_mutants", "--kernel", "plant_plan_no_scale", "--case", "seq_scale",
            "--dtype", "fp32", "--out", str(out)]  # fmt: skip
    import lab.sequence_mutants as m

    m.register()
    assert main(argv) == 1
    (repro,) = out.glob("repro_seq_scale_*.safetensors")
    capsys.readouterr()
    assert replay_main([str(repro), "--kernel", "one_query"]) == 2
    assert "one_query: UNSUPPORTED" in capsys.readouterr().out
    assert replay_main([str(repro), "--kernel", "crashing"]) == 1
