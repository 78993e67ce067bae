"""The probe's statistics on the CPU in one pass: a small C kernel, compiled at first use.

:func:`flashprobe.probe.stats.pair_sums` needs, for three pairs of outputs, seven statistics over
every element. As tensor ops that is some thirty passes over float64 scratch rows; on the CPU the
kernel in ``native_stats.c`` reads each input once instead (measured side by side in
docs/probe.md "Overhead"). It is plain C11 with no dependency, built with the system C compiler
(``$CC``, else ``cc``, ``gcc`` or ``clang``: what ``torch.compile`` needs on the CPU too) into a
cache directory, ``$FLASHPROBE_CACHE_DIR`` or ``~/.cache/flashprobe`` (``$XDG_CACHE_HOME``
respected), under a name that hashes the source, the compiler, the flags and the CPU, so a
shared home directory across different machines gets one build per CPU. The build is written to
a temporary file and renamed, so concurrent first uses are safe.

Where there is no compiler, the build fails, its self-check disagrees with a hand-computed
result, or ``FLASHPROBE_NATIVE=0``, the statistics run as tensor ops (the same numbers up to
float64 rounding); :func:`status` says which path runs and why.

The value does not depend on the thread count: elements are summed in fixed chunks of
:data:`CHUNK` (eight lanes each) and the chunks folded in order, whichever threads computed them.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from flashprobe.formats.atomic import atomic_write_file

__all__ = ["CHUNK", "available", "pair_sums", "status"]

_log = logging.getLogger(__name__)

#: Elements summed per chunk (the value depends on it, not on the threads that compute chunks).
CHUNK = 1 << 16
_SOURCE = Path(__file__).with_name("native_stats.c")
_ABI = 2
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-std=c11", "-fPIC", "-shared")
#: ``-march=native`` lets the compiler use the CPU's vector width; dropped if the compiler refuses.
_ARCH = ("-march=native",)
_KERNELS = {
    torch.float32: "fp_pair_sums_f32",
    torch.float64: "fp_pair_sums_f64",
    torch.bfloat16: "fp_pair_sums_bf16",
}


class _Native:
    """The loaded library (or why there is none); built once per process."""

    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.reason = "not loaded yet"
        self.lock = threading.Lock()
        self.loaded = False
        self.pool: ThreadPoolExecutor | None = None
        self.pool_size = 0
        self.pool_pid = 0


_state = _Native()


def available() -> bool:
    """Whether the C kernel is loaded (built or taken from the cache on the first call)."""
    _load()
    return _state.lib is not None


def status() -> str:
    """Which path the CPU statistics take, and why: ``"C kernel (PATH)"`` or ``"tensor ops (REASON)"``."""
    _load()
    return f"C kernel ({_state.reason})" if _state.lib is not None else f"tensor ops ({_state.reason})"


def _load() -> None:
    if _state.loaded:
        return
    with _state.lock:
        if _state.loaded:
            return
        try:
            _state.lib, _state.reason = _build_and_load()
        except _UnavailableError as err:
            _state.lib, _state.reason = None, str(err)
            _log.info("flashprobe: CPU statistics run as tensor ops: %s", err)
        except Exception as err:  # a faster path must never break the probe
            _state.lib, _state.reason = None, f"{type(err).__name__}: {err}"
            _log.warning("flashprobe: CPU statistics run as tensor ops: %s", _state.reason)
        _state.loaded = True


class _UnavailableError(RuntimeError):
    """Why the C kernel cannot be used here."""


def _build_and_load() -> tuple[ctypes.CDLL, str]:
    if os.environ.get("FLASHPROBE_NATIVE", "1").strip().lower() in ("0", "off", "false", "no"):
        raise _UnavailableError("FLASHPROBE_NATIVE=0")
    compiler = _compiler()
    try:
        source = _SOURCE.read_bytes()
    except OSError as err:
        raise _UnavailableError(f"cannot read the kernel's source: {err}") from err
    version = _run([*compiler, "--version"]).splitlines()[0]
    build = [source, " ".join(compiler).encode(), version.encode(), _cpu_id()]  # what a build depends on
    cache, private = _cache_dir()
    errors: list[str] = []
    try:
        for arch in (_ARCH, ()):
            key = hashlib.sha256(b"\0".join([*build, " ".join(_FLAGS + arch).encode()])).hexdigest()[:20]
            path = cache / f"native_stats-{key}.so"
            try:
                if not path.exists():
                    _compile(compiler, arch, path)
                lib = _open(path)
            except _UnavailableError as err:
                errors.append(str(err))
                if private or not path.exists():
                    continue
                # A cached build this process cannot use (another user's, or one that fails its
                # check here): build a copy of its own instead.
                lib = _private_build(compiler, arch, path.name, errors)
                if lib is None:
                    continue
                return lib, f"built for this process: {path} cannot be used"
            if private:
                return lib, f"built for this process: {_cache_hint()} is not a writable directory"
            return lib, str(path)
    finally:
        if private:  # loaded or failed: the file is no longer needed (where the system lets it go)
            shutil.rmtree(cache, ignore_errors=True)
    raise _UnavailableError("; ".join(errors))


def _private_build(
    compiler: list[str], arch: tuple[str, ...], name: str, errors: list[str]
) -> ctypes.CDLL | None:
    """Build and load the kernel in a temporary directory removed once loaded; None (the reason
    appended to ``errors``) if that fails too."""
    private = Path(tempfile.mkdtemp(prefix="flashprobe-native-"))
    try:
        _compile(compiler, arch, private / name)
        return _open(private / name)
    except _UnavailableError as err:
        errors.append(str(err))
        return None
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _compiler() -> list[str]:
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise _UnavailableError("no C compiler found (install gcc or clang, or set CC)")


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        raise _UnavailableError(f"{shlex.join(cmd)} failed: {err}") from err
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise _UnavailableError(f"{shlex.join(cmd)} exited with {done.returncode}: {' / '.join(tail)}")
    return done.stdout or " "


def _cache_hint() -> Path:
    """The cache directory: ``$FLASHPROBE_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashprobe`` or
    ``~/.cache/flashprobe``."""
    root = os.environ.get("FLASHPROBE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashprobe"


def _cache_dir() -> tuple[Path, bool]:
    """The cache directory, created if needed, or a private temporary one when it cannot be
    written (then True: the caller removes it)."""
    base = _cache_hint()
    try:
        base.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=base, prefix=".write-test-"):
            pass
        return base, False
    except OSError:
        return Path(tempfile.mkdtemp(prefix="flashprobe-native-")), True


def _cpu_id() -> bytes:
    """What ``-march=native`` depends on: the machine and, on Linux, the CPU's model and flags."""
    parts = [platform.machine(), platform.processor()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part"):
                parts.append(line)
                if len(parts) > 6:
                    break
    except OSError:
        pass
    return "\n".join(parts).encode()


def _compile(compiler: list[str], arch: tuple[str, ...], path: Path) -> None:
    """Build into a temporary file renamed over ``path`` (the project's atomic writer: the umask's
    permissions, so others sharing the cache can load it; a concurrent build of the same key writes
    the same file)."""
    command = [*compiler, *_FLAGS, *arch, str(_SOURCE), "-lm", "-o"]
    atomic_write_file(path, lambda tmp: _run([*command, str(tmp)]))


def _open(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise _UnavailableError(f"cannot load {path}: {err}") from err
    lib.fp_abi_version.restype = ctypes.c_int64
    if lib.fp_abi_version() != _ABI:
        raise _UnavailableError(f"{path}: interface version {lib.fp_abi_version()}, expected {_ABI}")
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in _KERNELS.values():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, i64, i64, pointer]
    lib.fp_fold.restype = None
    lib.fp_fold.argtypes = [pointer, i64, i64, pointer]
    _self_check(lib, path)
    return lib


def _self_check(lib: ctypes.CDLL, path: Path) -> None:
    """Refuse a build whose result differs from a hand-computed one (e.g. a compiler that
    reassociates or flushes by default): p = [1, 2, nan, 4], b = [0.5, 2, 1, inf], g = [1, 1.5, 1, 3]."""
    p = torch.tensor([1.0, 2.0, float("nan"), 4.0], dtype=torch.float64)
    b = torch.tensor([0.5, 2.0, 1.0, float("inf")], dtype=torch.float64)
    g = torch.tensor([1.0, 1.5, 1.0, 3.0], dtype=torch.float64)
    out = torch.empty(7, 3, dtype=torch.float64)
    partials = torch.empty(2, 7, 3, dtype=torch.float64)  # two chunks of two elements
    size, strides = _layout((p, b, g))  # type: ignore[misc]
    lib.fp_pair_sums_f64(
        p.data_ptr(), b.data_ptr(), g.data_ptr(), size, strides, 2, 0, 2, partials.data_ptr()
    )
    lib.fp_fold(partials.data_ptr(), 2, 3, out.data_ptr())
    # pairs (p,b): d = .5, 0 | (p,g): 0, .5, 1 | (b,g): -.5, .5, 0 (inf - 3 is not finite)
    want = torch.tensor(
        [
            [0.5, 1.0, 0.5],  # max |d|
            [0.5, 1.5, 1.0],  # sum |d|
            [0.25, 1.25, 0.5],  # sum d^2
            [4.25, 12.25, 4.25],  # sum r^2 over finite pairs
            [2.0, 1.0, 1.0],  # non-finite
            [2.0, 3.0, 3.0],  # count
            [2.0, 3.0, 1.5],  # max |r|
        ],
        dtype=torch.float64,
    )
    if not torch.equal(out, want):
        raise _UnavailableError(f"{path}: self-check failed (got {out.tolist()})")


def pair_sums(p: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`flashprobe.probe.stats.pair_sums` of CPU tensors by the C kernel; None when it is not
    available (then the caller computes them as tensor ops).

    Args:
        p: primary, any shape, any floating dtype.
        b: baseline, same number of elements.
        g: golden (cast to float64 if it is not), same number of elements, or None.

    Returns:
        ``(7, P)`` float64, ``P`` = 3 with ``g``, else 1 (rows as in ``pair_sums``), or None. A
        call that fails switches the kernel off for the process (logged once, and :func:`status`
        says why): a faster path must never break the probe.
    """
    if not available():
        return None
    lib = _state.lib
    assert lib is not None
    try:
        return _pair_sums(lib, p, b, g)
    except Exception as err:
        _state.lib, _state.reason = None, f"the kernel failed and was switched off: {err!r}"
        _log.warning("flashprobe: CPU statistics run as tensor ops: %s", _state.reason)
        return None


def _pair_sums(lib: ctypes.CDLL, p: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    p, b = p.resolve_neg(), b.resolve_neg()  # the kernel reads memory: no lazy negation
    if g is not None:
        g = g.resolve_neg()
    if p.dtype != b.dtype or p.dtype not in _KERNELS:
        # Mixed or other dtypes (float16): compare in float64, exactly.
        p, b = p.to(torch.float64), b.to(torch.float64)
    if g is not None and g.dtype != torch.float64:
        g = g.to(torch.float64)
    tensors = (p, b) if g is None else (p, b, g)
    layout = _layout(tensors)
    if layout is None:  # shapes differ (same number of elements) or too many strided dimensions
        p, b, g = (None if t is None else t.contiguous().view(-1) for t in (p, b, g))
        layout = _layout((p, b) if g is None else (p, b, g))
        assert layout is not None
    size, strides = layout
    pairs, n = (1 if g is None else 3), p.numel()
    kernel = getattr(lib, _KERNELS[p.dtype])
    chunks = max(1, -(-n // CHUNK))
    partials = torch.zeros(chunks, 7, pairs, dtype=torch.float64)
    args = (p.data_ptr(), b.data_ptr(), None if g is None else g.data_ptr(), size, strides, CHUNK)
    if n:
        _run_chunks(kernel, args, chunks, partials)
    if chunks == 1:
        return partials[0]
    out = torch.empty(7, pairs, dtype=torch.float64)
    lib.fp_fold(partials.data_ptr(), chunks, pairs, out.data_ptr())
    return out


_Sizes = ctypes.c_int64 * 4
_Strides = ctypes.c_int64 * 12


def _layout(tensors: tuple[torch.Tensor, ...]) -> tuple[ctypes.Array, ctypes.Array] | None:
    """The tensors' common shape as 4 sizes and each one's strides (12, missing ones 0), after
    dropping size-1 dimensions and merging dimensions that are contiguous in every tensor; None
    when the shapes differ or more than 4 dimensions remain."""
    shape = tensors[0].shape
    if any(t.shape != shape for t in tensors):
        return None
    dims: list[tuple[int, list[int]]] = []
    for i, size in enumerate(shape):
        if size == 1:
            continue
        strides = [t.stride(i) for t in tensors]
        if dims and all(outer == inner * size for outer, inner in zip(dims[-1][1], strides, strict=True)):
            dims[-1] = (dims[-1][0] * size, strides)
        else:
            dims.append((size, strides))
    if len(dims) > 4:
        return None
    dims = [(1, [0] * len(tensors))] * (4 - len(dims)) + dims
    strides = [0] * 12
    for j in range(len(tensors)):
        for d, (_, s) in enumerate(dims):
            strides[4 * j + d] = s[j]
    return _Sizes(*(size for size, _ in dims)), _Strides(*strides)


def _run_chunks(kernel: Any, args: tuple[Any, ...], chunks: int, partials: torch.Tensor) -> None:
    """Chunks ``[0, chunks)`` into ``partials``: in ranges on torch's thread count (ctypes releases
    the GIL), else here. Returns only once no thread is still writing (``partials`` and the inputs
    must outlive every call); a range that cannot get a thread runs in this one."""
    workers = min(torch.get_num_threads(), chunks)
    if workers <= 1:
        kernel(*args, 0, chunks, partials.data_ptr())
        return
    bounds = [chunks * w // workers for w in range(workers + 1)]
    pool = _pool(workers)
    jobs: list[Future[None]] = []
    try:
        for c0, c1 in itertools.pairwise(bounds):
            try:
                jobs.append(pool.submit(kernel, *args, c0, c1, partials[c0].data_ptr()))
            except RuntimeError:  # no new threads (e.g. the interpreter is shutting down)
                kernel(*args, c0, c1, partials[c0].data_ptr())
    finally:
        wait(jobs)
    for job in jobs:
        job.result()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The worker threads, at least ``workers``; a new pool after a fork (the parent's threads do
    not exist in the child)."""
    with _state.lock:
        stale = _state.pool is not None and _state.pool_pid != os.getpid()
        if _state.pool is None or stale or _state.pool_size < workers:
            if _state.pool is not None and not stale:
                _state.pool.shutdown(wait=False)
            _state.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flashprobe-stats")
            _state.pool_size, _state.pool_pid = workers, os.getpid()
        return _state.pool
