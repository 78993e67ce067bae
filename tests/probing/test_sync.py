"""No host synchronisation per attention call: the probe adds no host reads to a training step
on a device (one statistics path for the CPU and a GPU); on the CPU, where a host read is free
(``flashprobe.deviation.FREE_READS``), it reads each compared call's verdict and the finiteness
checks that let the statistics skip masking (one per compared tensor and slice, one per counted
input)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest
import torch

from flashprobe.probing import probe

from ._models import TinyTransformer

deviation_module = sys.modules["flashprobe.deviation"]  # (the package's `deviation` is the function)

# Tensor methods that copy a value to the host (a device synchronisation on CUDA).
_SYNCING = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__float__", "__int__", "__index__")


def _count_host_reads(monkeypatch: pytest.MonkeyPatch, fn) -> dict[str, int]:
    counts = dict.fromkeys(_SYNCING, 0)
    for name in _SYNCING:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    fn()
    monkeypatch.undo()
    return counts


@contextlib.contextmanager
def _reads(free: bool) -> Iterator[None]:
    """Host reads free on the CPU (as they are) or not (as on a device)."""
    original = deviation_module.FREE_READS
    deviation_module.FREE_READS = frozenset({"cpu"} if free else ())
    try:
        yield
    finally:
        deviation_module.FREE_READS = original


@pytest.mark.parametrize("free", [False, True])
def test_probe_adds_no_host_reads(monkeypatch: pytest.MonkeyPatch, free: bool) -> None:
    """A probed training step (forward, backward, golden) reads exactly what the plain step reads,
    as on a device; where reads are free (the CPU), per compared call one ``tolist`` (its verdict)
    and one ``item`` per compared tensor (out, dq, dk, dv: one slice each here) and per counted
    input (q, k, v, grad_out)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randn(2, 6, 4)

    def step() -> None:
        model(x).sum().backward()

    step()  # warm-up
    plain = _count_host_reads(monkeypatch, step)
    with _reads(free), probe(model, backward=True, golden=True) as p:
        step()  # warm-up (plans the reference blocks, reads the free memory once)
        probed = _count_host_reads(monkeypatch, step)
        stats = p.stats()  # reading is one host copy, outside the step
        sites = p.sites
    compared = 2  # two sites, one call each, forward and backward judged together
    extra = {"tolist": compared, "item": compared * (4 + 4)} if free else {}
    assert probed == {k: plain[k] + extra.get(k, 0) for k in plain}
    assert len(sites) == 2  # one call each: out, dq, dk, dv compared
    assert stats["block"]["backward"]["calls"] == 2  # the probe did run, forward and backward


@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA device")
def test_probe_step_has_no_cuda_sync() -> None:
    torch.manual_seed(0)
    model = TinyTransformer().cuda()
    x = torch.randn(2, 6, 4, device="cuda")
    with probe(model, backward=True, golden=True) as p:
        model(x).sum().backward()  # warm-up (lazy CUDA init may sync)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert p.stats()["block"]["forward"]["calls"] == 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_probe_adds_no_host_reads(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyTransformer()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 6, 4)

    def step() -> None:
        compiled(x).sum().backward()

    step()  # warm-up: compiles without the probe
    plain = _count_host_reads(monkeypatch, step)
    with _reads(False), probe(model, backward=True, golden=True) as p:  # as on a device
        step()  # warm-up: recompiles with the probe's ops
        probed = _count_host_reads(monkeypatch, step)
        stats = p.stats()
    assert probed == plain
    assert stats["block"]["backward"]["calls"] == 2
