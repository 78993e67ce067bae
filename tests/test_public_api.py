"""The library API's top-level names are functions and classes, not modules, and are listed in
``flashprobe.__all__`` (``probe`` is imported from ``flashprobe.probing``: the package of that name)."""

from __future__ import annotations

import inspect

import flashprobe


def test_the_library_api_imports_from_flashprobe() -> None:
    from flashprobe import ProbeConfig, check_kernel, compare_runs, save_snapshot
    from flashprobe.probing import probe

    assert inspect.isclass(ProbeConfig)
    assert all(inspect.isfunction(f) for f in (check_kernel, compare_runs, save_snapshot, probe))
    assert {"ProbeConfig", "check_kernel", "compare_runs", "save_snapshot"} <= set(flashprobe.__all__)
