"""The C kernel of the CPU statistics (flashprobe.probe.native): its value against the tensor ops
and numpy, the bits it promises to keep, its build cache and its fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from flashprobe.probe import native
from flashprobe.probe.stats import StatsWorkspace, _masked_pair_sums

needs_kernel = pytest.mark.skipif("not native.available()", reason="no C kernel on this machine")

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


def _triple(shape, dtype, seed=0, nonfinite=False):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    p = (g + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    b = (g + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    if nonfinite:
        p.view(-1)[[0, 7, 100]] = float("nan")
        b.view(-1)[[7, 8]] = float("inf")
        g.view(-1)[[50, 101]] = float("-inf")
    return p, b, g


def _oracle(p, b, g):
    """The (7, P) rows from numpy float64, independently of both implementations."""
    pairs = [(p, b)] if g is None else [(p, b), (p, g), (b, g)]
    out = np.zeros((7, len(pairs)))
    for j, (x, y) in enumerate(pairs):
        x64, y64 = x.double().numpy().ravel(), y.double().numpy().ravel()
        with np.errstate(invalid="ignore", over="ignore"):
            d = x64 - y64
        fin = np.isfinite(d)
        ad, ref = np.abs(np.where(fin, d, 0.0)), np.abs(np.where(fin, y64, 0.0))
        out[:, j] = [
            ad.max(initial=0),
            ad.sum(),
            (ad**2).sum(),
            (ref**2).sum(),
            (~fin).sum(),
            fin.sum(),
            ref.max(initial=0),
        ]
    return out


@needs_kernel
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_numpy_and_the_masked_tensor_ops(dtype, nonfinite) -> None:
    p, b, g = _triple((3, 5, 4099), dtype, nonfinite=nonfinite)  # several chunks, a ragged tail
    for golden in (g, None):
        got = native.pair_sums(p, b, golden)
        want = _oracle(p, b, golden)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=0)
        masked = _masked_pair_sums(
            p.reshape(-1), b.reshape(-1), None if golden is None else golden.reshape(-1), StatsWorkspace()
        )
        assert torch.equal(got[[0, 4, 5, 6]], masked[[0, 4, 5, 6]])  # maxima and counts: exact


def _layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same values of a (2, 4, 24, 16) tensor in other memory layouts (none contiguous)."""
    return {
        "heads_inner": t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3),  # (B, N, H, D) memory
        "transposed": t.transpose(2, 3).contiguous().transpose(2, 3),  # column-major rows
        "every_other": torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0],  # last-dim stride 2
        "window": torch.cat([t, t], dim=2)[:, :, 24:],  # a slice of a larger tensor
    }


@needs_kernel
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_give_the_bits_of_their_contiguous_copies(dtype, nonfinite, monkeypatch) -> None:
    monkeypatch.setattr(native, "CHUNK", 1000)  # chunk boundaries inside rows
    p, b, g = _triple((2, 4, 24, 16), dtype, seed=1, nonfinite=nonfinite)
    want = native.pair_sums(p, b, g)
    lp, lb, lg = _layouts(p), _layouts(b), _layouts(g)
    for name in lp:
        for combo in ((lp[name], b, g), (p, lb[name], lg[name]), (lp[name], lb[name], lg[name])):
            assert not all(t.is_contiguous() for t in combo)
            assert torch.equal(native.pair_sums(*combo), want), name
            assert torch.equal(native.pair_sums(*combo[:2], None), native.pair_sums(p, b, None)), name


@needs_kernel
def test_more_than_four_strided_dimensions_and_unequal_shapes() -> None:
    p, b, g = _triple((2, 3, 2, 5, 7), torch.float32, seed=2)
    p5 = p.permute(4, 3, 2, 1, 0).contiguous().permute(4, 3, 2, 1, 0)  # 5 dimensions that do not merge
    np.testing.assert_allclose(native.pair_sums(p5, b, g).numpy(), _oracle(p, b, g), rtol=1e-12)
    flat = native.pair_sums(p.reshape(-1), b.reshape(30, 14), g.reshape(2, 210))  # same elements
    np.testing.assert_allclose(flat.numpy(), _oracle(p, b, g), rtol=1e-12)
    empty = native.pair_sums(torch.empty(0, 3), torch.empty(0, 3), torch.empty(0, 3, dtype=torch.float64))
    assert empty.shape == (7, 3) and not empty.any()


@needs_kernel
def test_value_does_not_depend_on_the_thread_count(monkeypatch) -> None:
    monkeypatch.setattr(native, "CHUNK", 777)
    p, b, g = _triple((4, 8, 300), torch.float32, seed=3)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(native.pair_sums(p, b, g))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_kernel
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86-64 baseline vs native build")
def test_baseline_and_native_builds_give_the_same_bits(tmp_path: Path) -> None:
    """The lanes fix the order of every sum, so the vector width the compiler picks (SSE2 for the
    x86-64 baseline, the CPU's widest with -march=native) changes no bit."""
    compiler = native._compiler()
    libs = []
    for arch in ((), native._ARCH):
        path = tmp_path / f"k{len(libs)}.so"
        native._compile(compiler, arch, path)
        libs.append(native._open(path))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for nonfinite in (False, True):
            p, b, g = _triple((3, 4, 1001), dtype, seed=4, nonfinite=nonfinite)
            p = p.transpose(1, 2).contiguous().transpose(1, 2)
            got = []
            for lib in libs:
                size, strides = native._layout((p, b, g))
                out = torch.zeros(1, 7, 3, dtype=torch.float64)
                kernel = getattr(lib, native._KERNELS[dtype])
                kernel(
                    p.data_ptr(), b.data_ptr(), g.data_ptr(), size, strides, p.numel(), 0, 1, out.data_ptr()
                )
                got.append(out)
            assert torch.equal(got[0], got[1]), (dtype, nonfinite)


def _python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip()


_STATUS_AND_VALUE = (
    "import torch; from flashprobe.probe import native; from flashprobe.probe.stats import pair_sums; "
    "g = torch.linspace(-1, 1, 1000, dtype=torch.float64); p = (g + 1e-3).float(); b = g.float(); "
    "print(native.status()); print(pair_sums(p, b, g)[2].tolist())"
)


def test_fallback_to_tensor_ops_when_switched_off_or_the_compiler_fails(tmp_path: Path) -> None:
    off = _python(_STATUS_AND_VALUE, {"FLASHPROBE_NATIVE": "0", "FLASHPROBE_CACHE_DIR": str(tmp_path / "a")})
    broken = _python(_STATUS_AND_VALUE, {"CC": "false", "FLASHPROBE_CACHE_DIR": str(tmp_path / "b")})
    assert off.splitlines()[0] == "tensor ops (FLASHPROBE_NATIVE=0)"
    assert broken.splitlines()[0].startswith("tensor ops (") and "false" in broken.splitlines()[0]
    g = torch.linspace(-1, 1, 1000, dtype=torch.float64).numpy()  # the subprocess's values
    p, b = (g + 1e-3).astype(np.float32).astype(np.float64), g.astype(np.float32).astype(np.float64)
    want = [((p - b) ** 2).sum(), ((p - g) ** 2).sum(), ((b - g) ** 2).sum()]
    for out in (off, broken):
        np.testing.assert_allclose(eval(out.splitlines()[1]), want, rtol=1e-12)


@needs_kernel
def test_build_is_cached_and_concurrent_first_uses_are_safe(tmp_path: Path) -> None:
    env = {"FLASHPROBE_CACHE_DIR": str(tmp_path)}
    code = _STATUS_AND_VALUE
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert outs[0] == outs[1] and outs[0].startswith("C kernel (")
    built = sorted(tmp_path.glob("native_stats-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob(".*.tmp"))
    stamp = built[0].stat().st_mtime_ns
    assert _python(code, env) == outs[0].strip()  # a later process loads the cached build
    assert built[0].stat().st_mtime_ns == stamp


def test_a_build_that_fails_its_self_check_is_not_used(tmp_path: Path, monkeypatch) -> None:
    source = native._SOURCE.read_text()
    wrong = source.replace("row[5] = (double)n - row[4];", "row[5] = (double)n;")  # counts NaNs as compared
    assert wrong != source
    (tmp_path / "native_stats.c").write_text(wrong)
    monkeypatch.setattr(native, "_SOURCE", tmp_path / "native_stats.c")
    monkeypatch.setattr(native, "_state", native._Native())
    monkeypatch.setenv("FLASHPROBE_CACHE_DIR", str(tmp_path / "cache"))
    if not native.available() and "self-check" not in native.status():
        pytest.skip(f"no C compiler here: {native.status()}")
    assert not native.available()
    assert "self-check failed" in native.status()
    assert native.pair_sums(torch.zeros(3), torch.zeros(3), None) is None  # the caller uses tensor ops


@needs_kernel
def test_an_unusable_cache_directory_builds_into_a_private_temporary_one(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = _python(_STATUS_AND_VALUE, {"FLASHPROBE_CACHE_DIR": str(blocker / "cache")})
    status = out.splitlines()[0]
    assert status == f"C kernel (built for this process: {blocker / 'cache'} is not a writable directory)"
    assert not list(Path(tempfile.gettempdir()).glob("flashprobe-native-*"))  # removed once loaded


@needs_kernel
def test_threads_that_cannot_start_leave_the_work_to_the_caller(monkeypatch) -> None:
    """A range whose thread cannot be started (e.g. at interpreter shutdown) runs in the calling
    thread, and the call returns only once every started range is done."""
    monkeypatch.setattr(native, "CHUNK", 500)
    p, b, g = _triple((4, 1000), torch.float32, seed=6)
    want = native.pair_sums(p, b, g)
    pool = native._pool(2)
    real_submit, submitted = pool.submit, []

    def flaky_submit(fn, *args):
        if submitted:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        submitted.append(1)
        return real_submit(fn, *args)

    monkeypatch.setattr(pool, "submit", flaky_submit)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(native.pair_sums(p, b, g), want)
    finally:
        torch.set_num_threads(threads)
    assert submitted == [1]


_FORK_INPUTS: list[torch.Tensor] = []


def _in_forked_child(queue) -> None:
    # Inputs made by the parent: torch's own OpenMP threads are not usable in a forked child
    # either, so the child runs no parallel torch op, only the kernel's threads.
    torch.set_num_threads(2)
    queue.put(native.pair_sums(*_FORK_INPUTS).tolist())


@needs_kernel
@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_gets_threads_of_its_own() -> None:
    """The parent's worker threads do not exist in a forked child (fork-based multiprocessing):
    the child must start its own instead of waiting for them forever."""
    import multiprocessing

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _FORK_INPUTS[:] = _triple((4, 70000), torch.float32, seed=7)
        want = native.pair_sums(*_FORK_INPUTS).tolist()  # the parent's pool now exists
        assert native._state.pool is not None
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_in_forked_child, args=(queue,))
        child.start()
        got = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        torch.set_num_threads(threads)
        _FORK_INPUTS.clear()
    assert got == want and child.exitcode == 0


@needs_kernel
def test_a_cached_build_is_readable_by_others_sharing_the_cache() -> None:
    path = Path(native.status().removeprefix("C kernel (").removesuffix(")"))
    if not path.is_file():
        pytest.skip(f"not loaded from a cache file: {native.status()}")
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # the umask's mode, as every file written


@needs_kernel
def test_a_kernel_failure_falls_back_to_tensor_ops_once_and_says_so(monkeypatch, caplog) -> None:
    import flashprobe.probe.stats as stats_module

    calls = []

    def broken(*args):
        calls.append(1)
        raise ValueError("boom")

    state = native._Native()  # this process's kernel, loaded afresh, then failing
    monkeypatch.setattr(native, "_state", state)
    monkeypatch.setattr(native, "_run_chunks", broken)
    p, b, g = _triple((3, 50), torch.float32, seed=8)
    with caplog.at_level("WARNING"):
        first = stats_module.pair_sums(p, b, g)
        second = stats_module.pair_sums(p, b, g)
    np.testing.assert_allclose(first.numpy(), _oracle(p, b, g), rtol=1e-12)
    assert torch.equal(first, second) and calls == [1]  # not tried again
    assert native.status() == "tensor ops (the kernel failed and was switched off: ValueError('boom'))"
    assert [r.message for r in caplog.records if "switched off" in r.message]
