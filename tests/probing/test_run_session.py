"""ProbeSession, driven by hand as a trainer would (no training framework): records at the logging
steps, the typed summary they hold, stop on failures and non-finite weights, checkpoints and resume,
the arguments both training callbacks share, and one kernel resolution per attach."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import sys
import warnings
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashprobe.kernels.registry as registry
from flashprobe.formats.probe_log import read_probe_log
from flashprobe.probing import Failure, ProbeConfig, ProbeFailureError, ProbeSummary, probe
from flashprobe.probing.run_session import ProbeSession


class _Attention(nn.Module):
    """One SDPA call per forward (the site ``attn``), with one trainable weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x * self.w, x, x)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def _train(session: ProbeSession, model: nn.Module, steps: range, *, last: int, **end: object) -> list:
    """What a trainer does around ``steps`` (forward, backward, a step each); the StepResults."""
    x = torch.randn(2, 2, 8, 4, generator=torch.Generator().manual_seed(0))
    results = []
    for step in steps:
        session.begin_step(step)
        model(x).square().mean().backward()
        results.append(session.end_step(step + 1, last=step + 1 == last, **end))
        if results[-1].stop:
            break
    return results


def test_records_at_logging_steps_hold_the_typed_summary_and_a_resumed_run_continues(tmp_path: Path) -> None:
    session = ProbeSession(who="Trainer", log_every_n_steps=2, backward=True, plot=False, console=False)
    model = _Model()
    session.attach(model, root=tmp_path)
    results = _train(session, model, range(5), last=5)
    session.finish(5)
    assert [r.flushed for r in results] == [False, True, False, True, True]  # steps 2, 4 and the last
    records = read_probe_log(tmp_path / "probe.jsonl").records
    assert [r["step"] for r in records] == [2, 4, 5]
    # one site, one call per step: two calls per record, one in the last
    assert [r["summary"]["forward_calls"] for r in records] == [2, 2, 1]
    assert [r["summary"]["backward_calls"] for r in records] == [2, 2, 1]
    for record in records:  # the JSON record is the typed summary's to_dict, key for key and in order
        summary = record["summary"]
        assert list(ProbeSummary.from_dict(summary).to_dict()) == list(summary)
        assert summary["verdict"] == "pass" and summary["run_nonfinite"] == 0
    assert session.probe is None and session.sites_seen == ["attn"]
    # A checkpoint taken after step 2, resumed: the records after it are dropped, then written again.
    checkpoint = {**json.loads(json.dumps(session.state_dict())), "last_logged_step": 2, "records": 1}
    resumed = ProbeSession(who="Trainer", log_every_n_steps=2, backward=True, plot=False, console=False)
    resumed.load_state_dict(checkpoint)
    resumed.attach(model, root=tmp_path)
    _train(resumed, model, range(2, 4), last=5)
    resumed.detach()
    assert [r["step"] for r in read_probe_log(tmp_path / "probe.jsonl").records] == [2, 4]
    assert resumed.records == 2 and resumed.last_logged_step == 4


def test_a_failing_primary_stops_with_its_record_and_raise_raises(tmp_path: Path) -> None:
    from lab.mutants import register_mutants

    register_mutants()
    stop = ProbeSession(primary="bug_batch_kv_mixup", on_failure="stop", log_every_n_steps=10, plot=False)
    stop.attach(_Model(), root=tmp_path / "stop")
    with pytest.warns(UserWarning, match=r"FAIL at site 'attn', out, step 0"):
        results = _train(stop, stop.probe.model, range(5), last=5, every=10)
    assert len(results) == 1 and results[0].stop and results[0].summary.verdict == "fail"
    stop.detach()
    (record,) = read_probe_log(tmp_path / "stop" / "probe.jsonl").records
    assert record["step"] == 1 and record["summary"]["failures"][0]["site"] == "attn"
    raising = ProbeSession(primary="bug_batch_kv_mixup", on_failure="raise", plot=False)
    raising.attach(_Model(), root=tmp_path / "raise")
    with pytest.raises(ProbeFailureError, match="out, step 0"):
        _train(raising, raising.probe.model, range(5), last=5)
    raising.detach()


def test_nonfinite_weights_stop_training_and_the_record_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    session = ProbeSession(who="Trainer", log_every_n_steps=10, plot=False)
    model = _Model()
    session.attach(model, root=tmp_path)
    # the weights go bad after step 2 (the trainer's check says which)
    checks = iter([None, None, "1 of 1 values of the weight attn.w"])
    results = _train(session, model, range(5), last=5, weights=lambda: next(checks))
    assert [r.stop for r in results] == [False, False, True]
    assert session.stopped.startswith("1 of 1 values of the weight attn.w are non-finite after step 2")
    session.finish(3)
    (record,) = read_probe_log(tmp_path / "probe.jsonl").records
    assert record["step"] == 3 and record["summary"]["stopped"] == session.stopped
    out = capsys.readouterr().out
    assert "Trainer: verdict PASS" in out and "training stopped: 1 of 1 values of the weight" in out
    # on_nonfinite="continue": recorded, not stopped
    going = ProbeSession(on_nonfinite="continue", plot=False, console=False)
    going.attach(_Model(), root=tmp_path / "continue")
    results = _train(going, going.probe.model, range(3), last=3, weights=lambda: "everything")
    going.detach()
    assert not any(r.stop for r in results) and going.stopped is None


def test_a_model_without_attention_and_patterns_matching_nothing_fail_after_the_first_step(
    tmp_path: Path,
) -> None:
    session = ProbeSession(who="Trainer")
    session.attach(nn.Linear(4, 4), root=tmp_path)
    with pytest.raises(RuntimeError, match=r"Trainer: Linear made no torch\.nn\.functional\.scaled_dot"):
        session.end_step(1)
    assert session.probe is None  # detached
    session = ProbeSession(who="Trainer", sites="blocks.*")
    session.attach(_Model(), root=tmp_path)
    with pytest.raises(ValueError, match=r"sites=\['blocks\.\*'\] matches none .* \(attn\)"):
        _train(session, session.probe.model, range(1), last=1)


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("on_failure", "halt", "on_failure='halt' must be 'warn', 'raise' or 'stop'"),
        ("on_nonfinite", "ignore", "on_nonfinite='ignore' must be one of stop, continue"),
        ("max_reproducers", -1, "max_reproducers=-1 must be an int >= 0"),
        ("max_reproducers", True, "max_reproducers=True must be an int >= 0"),
        ("log_every_n_steps", 0, "log_every_n_steps=0 must be a positive int"),
        ("log_every_n_steps", 2.0, "log_every_n_steps=2.0 must be a positive int"),
        ("filename", "logs/probe.jsonl", "filename='logs/probe.jsonl' must be a plain file name inside"),
        ("filename", "..", "filename='..' must be a plain file name inside"),
    ],
)
def test_bad_arguments_are_named_before_any_work(argument: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"^Who: {re.escape(message)}"):
        ProbeSession(who="Who", **{argument: value})


def test_kernel_specs_resolve_once_when_the_session_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's config is validated and its kernel specs resolved once, when the session is
    built; attaching (once per fit) resolves none again, whichever module would ask."""
    resolved: list[str] = []
    original = registry.get_kernel

    def counting(spec):
        if isinstance(spec, str):  # a spec to parse and build (a Kernel object is handed back as is)
            resolved.append(spec)
        return original(spec)

    for name, module in list(sys.modules.items()):
        if name.startswith("flashprobe") and getattr(module, "get_kernel", None) is original:
            monkeypatch.setattr(module, "get_kernel", counting)
    session = ProbeSession(primary="tiled:block_k=8", plot=False, console=False)
    assert collections.Counter(resolved) == {"tiled:block_k=8": 1, "math": 1}
    assert session.config.backward == "auto"
    built = []
    check = ProbeConfig.__post_init__
    monkeypatch.setattr(ProbeConfig, "__post_init__", lambda self: (built.append(self), check(self)))
    resolved.clear()
    model = _Model()
    session.attach(model, root=tmp_path)
    assert resolved == []
    assert len(built) == 1 and built[0].backward is True  # "auto" decided for the CPU, kernels reused
    assert built[0].primary_kernel is session.config.primary_kernel
    resolved.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(session, model, range(3), last=3)  # steps re-attach the probe: nothing resolved again
    session.finish(3)
    assert resolved == []


def test_the_typed_summary_documents_every_field_and_rejects_what_is_not_one() -> None:
    documented = set(re.findall(r"^ {8}(\w+): ", ProbeSummary.__doc__ or "", flags=re.M))
    assert documented == {f.name for f in fields(ProbeSummary)}
    x = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(1))
    with probe(_Model(), backward=False) as p:
        p.model(x)
    typed = p.summary()
    summary = typed.to_dict()
    assert typed.forward_calls == 1 and typed.step == 0
    assert ProbeSummary.from_dict(summary) == typed
    typed_only = r"ProbeSummary is typed: read .verdict \(or .to_dict\(\)\['verdict'\]\)"
    with pytest.raises(TypeError, match=typed_only):
        typed["verdict"]
    with pytest.raises(AttributeError, match=r"is now Probe.summary\(\), which returns the ProbeSummary"):
        p.typed_summary()
    failure = Failure(site="a", direction="dq", step=3, kind="relative", value=2.0, limit=1.0, reason="r")
    assert failure.to_dict() == {
        "site": "a", "direction": "dq", "step": 3, "kind": "relative", "value": 2.0, "limit": 1.0,
        "reason": "r", "repro": None,
    }  # fmt: skip
    assert Failure.from_dict({**failure.to_dict(), "worst": True}) == dataclasses.replace(failure, worst=True)
    # a bare summary over sites has neither the probe's nor the run's fields
    bare = p.shadow.summary().to_dict()
    assert set(summary) - set(bare) == {"step", "dropout_calls", "fallbacks", "notes"}
    assert ProbeSummary.from_dict(bare).to_dict() == bare
    with pytest.raises(ValueError, match="unknown keys colour; missing keys sites"):
        ProbeSummary.from_dict({**{k: v for k, v in bare.items() if k != "sites"}, "colour": 1})
