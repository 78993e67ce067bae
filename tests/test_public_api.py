"""The library API's top-level names are functions and classes, not modules, listed by task in
``flashprobe.__all__``: ``from flashprobe import probe, ProbeConfig, check_kernel, save_snapshot,
compare_runs``. ``import flashprobe`` imports none of them (nor torch) until one is used, checked in a
fresh interpreter, where nothing is imported yet."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import flashprobe


def test_the_five_names_import_from_flashprobe() -> None:
    from flashprobe import ProbeConfig, check_kernel, compare_runs, probe, save_snapshot
    from flashprobe.probing import probe as probe_function

    assert inspect.isclass(ProbeConfig)
    assert all(inspect.isfunction(f) for f in (check_kernel, compare_runs, save_snapshot, probe))
    assert probe is probe_function and flashprobe.probe is probe
    five = {"ProbeConfig", "check_kernel", "compare_runs", "probe", "save_snapshot"}
    assert five <= set(flashprobe.__all__)
    public = [getattr(flashprobe, name) for name in flashprobe.__all__ if name != "__version__"]
    assert all(inspect.isclass(v) or inspect.isfunction(v) for v in public)


def test_flashprobe_deviation_is_the_module_and_its_function_is_inside() -> None:
    import flashprobe.deviation as module
    from flashprobe import deviation

    assert deviation is module is flashprobe.deviation and inspect.isfunction(deviation.deviation)
    assert "deviation" not in flashprobe.__all__


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_flashprobe_imports_no_task_until_one_is_used() -> None:
    done = _fresh(
        """
        import sys
        import flashprobe
        assert "torch" not in sys.modules and "flashprobe.probing" not in sys.modules, sorted(sys.modules)
        probe = flashprobe.probe
        assert "flashprobe.probing" in sys.modules and "flashprobe.fuzz" not in sys.modules
        assert flashprobe.probe is probe and "probe" in dir(flashprobe)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_old_probe_package_path_is_gone() -> None:
    """``flashprobe.probe`` is the function; the probe's package is ``flashprobe.probing``."""
    done = _fresh("import flashprobe.probe.config")
    assert done.returncode == 1 and "No module named 'flashprobe.probe'" in done.stderr, done.stderr


def test_new_paths_import_without_a_warning() -> None:
    done = _fresh("from flashprobe import probe\nfrom flashprobe.probing.config import ProbeConfig")
    assert done.returncode == 0, done.stderr[-3000:]


def _package_modules() -> list[str]:
    """Every module of the installed package, by dotted name."""
    import pkgutil

    names = ["flashprobe"]
    for info in pkgutil.walk_packages(flashprobe.__path__, "flashprobe."):
        names.append(info.name)
    return names


def test_every_error_of_flashprobe_derives_from_flashprobe_error_and_keeps_its_builtin_class() -> None:
    """One family: each exception class the package defines is a ``FlashprobeError`` (caught by type,
    never by module name) and still the built-in class it was (``except ValueError`` keeps working)."""
    import importlib

    from flashprobe import FlashprobeError, errors

    assert FlashprobeError is errors.FlashprobeError and "FlashprobeError" in flashprobe.__all__
    errors = {}
    for name in _package_modules():
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # a module for an optional package (flash-attn, triton) not installed
            assert not (err.name or "").startswith("flashprobe"), err
            continue
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)
                and value.__module__ == name
            ):
                errors[f"{name}.{value.__qualname__}"] = value
    assert len(errors) >= 20, sorted(errors)  # the errors of kernels, probing, weights, formats, app, ...
    outside = sorted(name for name, cls in errors.items() if not issubclass(cls, FlashprobeError))
    assert not outside, f"exception classes outside the FlashprobeError family: {outside}"
    from flashprobe.formats.atomic import DiskFullError
    from flashprobe.kernels import KernelSpecError, KernelUnsupportedError
    from flashprobe.probing.shadow import ProbeFailureError

    assert issubclass(KernelSpecError, ValueError) and issubclass(DiskFullError, OSError)
    assert issubclass(KernelUnsupportedError, RuntimeError) and issubclass(ProbeFailureError, RuntimeError)
