"""The library API's top-level names are functions and classes, not modules, and are listed in
``flashprobe.__all__``: ``from flashprobe import probe, ProbeConfig, check_kernel, save_snapshot,
compare_runs``. The probe's package moved from ``flashprobe.probe`` to ``flashprobe.probing``; the old
paths import the same objects with a ``DeprecationWarning`` (checked in a fresh interpreter, where
nothing is imported yet)."""

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


def test_old_probe_paths_import_the_same_objects_with_a_deprecation_warning() -> None:
    done = _fresh(
        """
        import inspect, sys, warnings
        import flashprobe
        from flashprobe import probe
        import flashprobe.probing.config as config, flashprobe.probing.stats as stats

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from flashprobe.probe import ProbeConfig, probe as old_probe
            from flashprobe.probe.config import ProbeConfig as deep
            from flashprobe.probe.stats import DeviationStats
            import flashprobe.probe.shadow
        assert ProbeConfig is deep is config.ProbeConfig and DeviationStats is stats.DeviationStats
        assert old_probe is probe
        assert sys.modules["flashprobe.probe.shadow"] is sys.modules["flashprobe.probing.shadow"]
        assert sys.modules["flashprobe.probe.config"].__spec__.name == "flashprobe.probing.config"
        old = [str(w.message) for w in caught if w.category is DeprecationWarning]
        assert len(old) == 4 and all("flashprobe.probing" in m for m in old), old
        assert all(w.filename == "<string>" for w in caught)  # the warning names the importing line
        # importing the old package did not hide the function behind it
        assert flashprobe.probe is probe and inspect.isfunction(flashprobe.probe)
        from flashprobe import probe as again
        assert again is probe
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_new_paths_import_without_a_warning() -> None:
    done = _fresh("from flashprobe import probe\nfrom flashprobe.probing.config import ProbeConfig")
    assert done.returncode == 0, done.stderr[-3000:]
