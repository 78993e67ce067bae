"""Put the user's experiments in front of flashprobe's packaged configs.

flashprobe's configs ship inside the package (``flashprobe/conf``). A user's experiments live in a
``conf/`` directory of their own — ``./conf`` where ``flashprobe train``/``study`` runs, and the
directory named by ``$FLASHPROBE_CONFIG_DIR`` (``flashprobe study --config-dir DIR`` sets it;
``flashprobe train --config-dir DIR`` is Hydra's own flag and does the same). This plugin prepends
them to Hydra's search path, so a user's ``conf/attention/flash.yaml`` overrides the packaged one
and a new ``conf/experiment/mine.yaml`` adds an experiment, without touching the package. It acts
only on flashprobe's own app (a search path that holds ``flashprobe/conf``), so other Hydra apps
in the same environment are left alone (for them it imports nothing heavy; for flashprobe's app
it also registers the structured schema of ``attention.probe``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

#: The environment variable naming an extra config directory (highest precedence).
CONFIG_DIR_ENV = "FLASHPROBE_CONFIG_DIR"


def user_config_dirs() -> list[Path]:
    """The user's config directories that exist, resolved: ``./conf``, then ``$FLASHPROBE_CONFIG_DIR``."""
    candidates = [Path("conf"), Path(os.environ.get(CONFIG_DIR_ENV, "") or "conf")]
    return [d for d in dict.fromkeys(p.resolve() for p in candidates) if d.is_dir()]


def _packaged_conf() -> Path | None:
    spec = importlib.util.find_spec("flashprobe")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "conf"


def _is_flashprobe(search_path: ConfigSearchPath, packaged: Path) -> bool:
    for element in search_path.get_path():
        path = element.path or ""
        if path in ("pkg://flashprobe.conf", "pkg://flashprobe/conf"):  # flashprobe.app.train's @hydra.main
            return True
        if "://" in path and not path.startswith("file://"):
            continue  # pkg://, structured://
        if Path(path.removeprefix("file://")).resolve() == packaged:
            return True
    return False


class FlashprobeSearchPathPlugin(SearchPathPlugin):
    """Prepends ``./conf`` and ``$FLASHPROBE_CONFIG_DIR`` to flashprobe's search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        packaged = _packaged_conf()
        if packaged is None or not _is_flashprobe(search_path, packaged):
            return
        # The schema of attention.probe (flashprobe.probing.ProbeConfig's settings), which the packaged
        # attention configs extend; flashprobe's own app imports torch anyway.
        from flashprobe.probing.config import register_schema

        register_schema()
        for directory in user_config_dirs():  # prepended in turn: the env dir ends up first
            if directory != packaged:
                search_path.prepend(provider="flashprobe-user", path=f"file://{directory}")
