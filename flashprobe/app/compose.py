"""A run's config composed as Hydra composes it (:func:`compose`, with the user's config directories
from :mod:`hydra_plugins.flashprobe_searchpath`), and the one check of every path it writes
(:func:`check_paths`). A user's file Hydra cannot use, or a refused path, is named in one line, with
where its value came from (:class:`ConfigSources`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashprobe.app.overrides import override_key

__all__ = [
    "CONF_DIR",
    "ConfigSources",
    "check_config_dirs",
    "check_paths",
    "compose",
    "compose_with_sources",
    "lazy_sources",
]

#: The packaged Hydra configs, and their module.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
CONF_MODULE = "flashprobe.conf"

#: Keys (the last part) whose value is a directory a callback, logger or the Trainer writes into.
PATH_KEYS = ("dirpath", "save_dir", "default_root_dir", "dir", "log_dir", "root_dir", "output_dir")
#: Keys (the last part) whose value becomes a file or directory name below such a directory.
NAME_KEYS = ("filename", "name", "version", "sub_dir")
#: The groups whose objects write files.
WRITING_GROUPS = ("callbacks", "logger", "trainer")


def check_config_dirs() -> None:
    """Refuse ``$FLASHPROBE_CONFIG_DIR`` naming something that is not a directory (it was ignored).

    Raises:
        ValueError: naming the variable, its value and the fix.
    """
    from hydra_plugins.flashprobe_searchpath.flashprobe_searchpath import CONFIG_DIR_ENV

    given = os.environ.get(CONFIG_DIR_ENV)
    if given and not Path(given).is_dir():
        what = "a file" if Path(given).exists() else "it does not exist"
        raise ValueError(
            f"${CONFIG_DIR_ENV}={given} is not a directory ({what}); it must name a directory of your "
            f"configs (a conf/ with experiment/*.yaml, ...): fix it, or unset it (unset {CONFIG_DIR_ENV})"
        )


@dataclass
class ConfigSources:
    """Where each value of a composed config came from: the overrides (given now, or recorded by a
    run), and the config files in merge order."""

    overrides: Sequence[str] = ()
    recorded: Mapping[str, str] = field(default_factory=dict)
    """An override taken from a run's record → that record, e.g. ``RUN/.hydra/overrides.yaml``."""
    files: list[tuple[str, Path, Any]] = field(default_factory=list)
    """``(package, file, its config)`` of every config file, in merge order."""

    def __call__(self, key: str) -> str:
        """Where ``key``'s value was set, in words: ``set in FILE``, ``given on the command line``, ..."""
        for override in reversed(list(self.overrides)):
            name = override_key(override).split("@", 1)[0]
            if "=" in override and (key == name or key.startswith(name + ".")):
                where = self.recorded.get(override)
                return f"recorded in {where}" if where else "given on the command line"
        for package, path, config in reversed(self.files):
            inside = not package or key.startswith(package + ".")
            relative = key[len(package) + 1 :] if package else key
            if inside and _sets(config, relative):
                return f"set in {path}"
        return "flashprobe's default"


def lazy_sources(overrides: Sequence[str]) -> Callable[[str], str]:
    """:class:`ConfigSources` of a run composed with ``overrides``, composed only when first asked."""
    found: list[ConfigSources] = []

    def source(key: str) -> str:
        if not found:
            found.append(compose_with_sources(overrides)[1])
        return found[0](key)

    return source


def _sets(config: Any, key: str) -> bool:
    """Whether the config file's own ``config`` (a DictConfig) sets ``key``."""
    from omegaconf import DictConfig, OmegaConf

    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(config, parent, default=None) if parent else config
    return isinstance(config, DictConfig) and isinstance(node, DictConfig) and last in node


def compose(
    overrides: Sequence[str] = (), run_dir: str | Path | None = None, *, hydra: bool = False
) -> Any:
    """Compose the packaged and user configs with Hydra overrides, outside a Hydra app.

    Args:
        overrides: Hydra overrides such as ``["attention=math", "trainer.max_steps=5"]``.
        run_dir: set as ``run_dir`` when given.
        hydra: keep Hydra's own section (``hydra.run.dir``, ...).

    Returns:
        The composed ``DictConfig``.

    Raises:
        ValueError: a config file of the user's cannot be used (named, with the problem and the fix).
    """
    return compose_with_sources(overrides, run_dir, hydra=hydra)[0]


def compose_with_sources(
    overrides: Sequence[str] = (),
    run_dir: str | Path | None = None,
    *,
    hydra: bool = False,
    recorded: Mapping[str, str] | None = None,
) -> tuple[Any, ConfigSources]:
    """:func:`compose`, and where each value came from; ``recorded``: overrides taken from a run's
    record, each → the file that recorded it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import ListConfig, open_dict

    check_config_dirs()
    sources = ConfigSources(list(overrides), dict(recorded or {}))
    # the packaged configs as the train app's @hydra.main finds them (pkg://flashprobe.conf), its name
    with _users_files_named(), initialize_config_module(CONF_MODULE, version_base="1.3", job_name="train"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)
        loader = GlobalHydra.instance().config_loader()
        run_mode = RunMode.RUN
        for default in loader.compute_defaults_list("config", list(overrides), run_mode).defaults:
            found = loader.repository.load_config(default.config_path) if default.config_path else None
            scheme, _, where = found.path.partition("://") if found is not None else ("", "", "")
            if scheme not in ("file", "pkg") or (scheme == "pkg" and where != CONF_MODULE):
                continue  # Hydra's own configs
            directory = CONF_DIR if scheme == "pkg" else Path(where)
            path = directory / f"{default.config_path}.yaml"
            if isinstance(found.config, ListConfig):
                raise ValueError(
                    f"{path} holds a YAML list, not settings: a config file is a mapping of keys to values "
                    "(e.g. 'trainer:\\n  max_steps: 10', with '# @package _global_' as its first line to set "
                    "top-level keys); rewrite it as one"
                )
            sources.files.append((default.package or "", path, found.config))
    if run_dir is not None:
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    return cfg, sources


@contextlib.contextmanager
def _users_files_named() -> Iterator[None]:
    """Turn what Hydra raises on a user's config file it cannot read into one line naming the file."""
    import yaml

    try:
        yield
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}" if mark is not None else "a config file"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}: not valid YAML ({problem}); fix the file") from None
    except UnicodeDecodeError:
        found = next(_non_utf8_files(), None)
        where = f"{found[0]} (byte {found[1]})" if found else "a config file of yours"
        raise ValueError(
            f"{where} is not UTF-8 text (a config file must be UTF-8); save it as UTF-8 or remove it"
        ) from None
    except RecursionError:
        loops = list(_self_including_files())
        where = ", ".join(str(p) for p in loops) or "your config files"
        raise ValueError(
            f"the defaults list of {where} includes itself (directly or through another file), so "
            "composing it never ends; remove that entry"
        ) from None


def _user_files() -> Iterator[tuple[Path, Path]]:
    """``(config directory, file)`` of every YAML file in the user's config directories."""
    from hydra_plugins.flashprobe_searchpath.flashprobe_searchpath import user_config_dirs

    for directory in user_config_dirs():
        for path in sorted(directory.rglob("*.yaml")):
            yield directory, path


def _non_utf8_files() -> Iterator[tuple[Path, int]]:
    for _, path in _user_files():
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            yield path, err.start
        except OSError:
            continue


def _self_including_files() -> Iterator[Path]:
    """The user's config files whose defaults list names the file itself."""
    import yaml

    for directory, path in _user_files():
        group, name = str(path.parent.relative_to(directory)), path.stem
        try:
            defaults = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("defaults") or []
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            continue
        for entry in defaults if isinstance(defaults, list) else []:
            text = entry if isinstance(entry, str) else next(iter(entry.items()), ("", ""))
            if isinstance(text, tuple):
                text = f"/{str(text[0]).split()[-1].lstrip('/')}/{text[1]}"
            if text in (name, f"/{group}/{name}", f"{group}/{name}"):
                yield path
                break


def check_paths(cfg: Any, run_dir: str | Path | None, source: Callable[[str], str] | None = None) -> None:
    """The one check of every path a composed run config writes (nothing is created).

    ``hydra.run.dir``: no system directory or other's directory; ``run_dir``, ``output_root``,
    ``hydra.sweep.dir``: no system directory; ``hydra.output_subdir``: unset (flashprobe writes
    ``.hydra/`` itself); :data:`PATH_KEYS` of :data:`WRITING_GROUPS`: inside ``run_dir``;
    :data:`NAME_KEYS`: relative names without ``..``.

    Args:
        cfg: the composed config (with Hydra's section, or without).
        run_dir: the run directory (``None``: only the checks that need none).
        source: where a key's value came from (:class:`ConfigSources`), for the message.

    Raises:
        OutputPathError: naming the key, where it was set, the path and the fix.
    """
    from omegaconf import OmegaConf

    from flashprobe.formats.paths import OutputPathError, check_write_dir
    from flashprobe.formats.run_dir import RUN_DIR_NAMES

    def value(key: str) -> Any:
        try:
            return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        except Exception:  # an interpolation only Hydra's run can resolve: checked there
            return None

    try:
        if value("hydra.output_subdir") is not None:
            raise OutputPathError(
                f"hydra.output_subdir is {value('hydra.output_subdir')!r}: flashprobe writes the run's "
                ".hydra/ record itself (never through a link); leave hydra.output_subdir unset"
            )
        if isinstance(value("hydra.run.dir"), str):
            check_write_dir(value("hydra.run.dir"), "hydra.run.dir", owned=RUN_DIR_NAMES)
        for key in ("run_dir", "output_root", "hydra.sweep.dir"):
            if isinstance(value(key), str):
                check_write_dir(value(key), key)
        for key, given in _writing_values(cfg):
            last = key.rsplit(".", 1)[-1]
            if last in PATH_KEYS and run_dir is not None:
                check_write_dir(given, key, inside=run_dir)
            elif last in NAME_KEYS and _leaves(given, last == "filename"):
                raise OutputPathError(
                    f"{key}={given!r} must be a file name inside the run directory, e.g. probe.jsonl (no "
                    "absolute path, no '..')"
                )
    except OutputPathError as err:  # named with where the key's value came from
        if source is None:
            raise
        named, rest = str(err).split(" ", 1)
        raise OutputPathError(f"{named} ({source(named.split('=')[0])}) {rest}") from None


def _leaves(name: str, a_file: bool) -> bool:
    """Whether ``name`` is not a relative name that stays where it is put (a file: not empty or ``.``)."""
    path = Path(name)
    return path.is_absolute() or ".." in path.parts or (a_file and name.strip() in ("", "."))


def _writing_values(cfg: Any) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every path or name value under the groups whose objects write files."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    def walk(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
        for k, _ in items:
            key = f"{prefix}.{k}"
            try:
                child = node[k]
            except Exception:  # an interpolation only Hydra's run can resolve
                continue
            if isinstance(child, DictConfig | ListConfig):
                yield from walk(child, key)
            elif str(k) in PATH_KEYS + NAME_KEYS and isinstance(child, str):
                yield key, child

    for group in WRITING_GROUPS:
        node = OmegaConf.select(cfg, group, default=None, throw_on_resolution_failure=False)
        if isinstance(node, DictConfig):
            yield from walk(node, group)

