"""``--import MODULE`` and ``--config-dir DIR``, read by ``flashprobe train`` and ``study`` before Hydra.

The imported modules are named in ``$FLASHPROBE_IMPORT`` for the processes a run starts (DDP ranks,
launcher jobs) and recorded in ``run.json``; ``--config-dir`` sets ``$FLASHPROBE_CONFIG_DIR``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

__all__ = ["IMPORT_ENV", "command_options", "import_modules", "imported_modules"]

#: The modules given with ``--import``, comma-separated, for the processes a run starts.
IMPORT_ENV = "FLASHPROBE_IMPORT"

_VALUED = {"--import": "import", "--config-dir": "config-dir", "-cd": "config-dir"}


def imported_modules() -> list[str]:
    """The modules this command was given with ``--import`` (``$FLASHPROBE_IMPORT``)."""
    return [m for m in os.environ.get(IMPORT_ENV, "").split(",") if m]


def import_modules(modules: Iterable[str]) -> None:
    """Import the modules that register kernels (:func:`flashprobe.kernels.import_kernel_modules`).

    Raises:
        KernelSpecError: a module is not a module name, cannot be imported, or raises as it is imported.
    """
    from flashprobe.kernels import import_kernel_modules

    import_kernel_modules(list(modules))


@contextlib.contextmanager
def command_options(args: Sequence[str]) -> Iterator[list[str]]:
    """Apply ``--import MODULE`` and ``--config-dir DIR`` (``-cd``, ``--opt=value`` too) of ``args`` for
    the ``with`` block; yields the other (Hydra's) arguments.

    Raises:
        ValueError: an option without its value, ``--config-dir`` not naming a directory, or Hydra's
            ``--config-path`` (which would replace flashprobe's packaged configs).
        KernelSpecError: a module given with ``--import`` cannot be imported.
    """
    from flashprobe.app.compose import check_config_dirs
    from hydra_plugins.flashprobe_searchpath.flashprobe_searchpath import CONFIG_DIR_ENV

    rest, found = [], {"import": [], "config-dir": []}
    items = iter(args)
    for arg in items:
        flag, _, value = arg.partition("=")
        if flag in ("-cp", "--config-path"):
            raise ValueError(
                f"{flag} would replace flashprobe's packaged configs; give your configs with --config-dir "
                "DIR (searched first) instead"
            )
        if flag not in _VALUED:
            rest.append(arg)
            continue
        if not value:
            value = next(items, "")
        if not value.strip():
            example = "mykernels" if flag == "--import" else "conf"
            raise ValueError(f"{flag} needs a value, e.g. {flag} {example}")
        found[_VALUED[flag]].append(value)
    for directory in found["config-dir"][-1:]:
        if not Path(directory).is_dir():
            what = "a file" if Path(directory).exists() else "it does not exist"
            raise ValueError(
                f"--config-dir {directory} is not a directory ({what}); give a directory of your configs"
            )
    saved = {name: os.environ.get(name) for name in (CONFIG_DIR_ENV, IMPORT_ENV)}
    try:
        for directory in found["config-dir"][-1:]:
            os.environ[CONFIG_DIR_ENV] = str(Path(directory).resolve())  # read by the search path plugin
        check_config_dirs()
        if found["import"]:
            modules = list(dict.fromkeys([*imported_modules(), *found["import"]]))
            import_modules(modules)
            os.environ[IMPORT_ENV] = ",".join(modules)
        yield rest
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
