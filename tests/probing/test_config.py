"""One table of probe settings through all four ways in: ``probe()``, ``ShadowAttention``, the
``AttentionProbe`` callback and the Hydra config (composed and instantiated as ``flashprobe train``
does). Each accepts and rejects exactly the same values, with the same message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from flashprobe.callbacks import AttentionProbe
from flashprobe.kernels import KernelSpecError
from flashprobe.probing import ProbeConfig, ProbeConfigError, ShadowAttention, probe
from flashprobe.probing.config import setting_names

from .test_sites import Direct

GOOD: list[dict[str, Any]] = [
    {},
    {"primary": "math"},
    {"primary": "tiled:block_k=16"},
    {"baseline": "sdpa_math"},
    {"golden": False},
    {"backward": True},
    {"every_n_calls": 3},
    {"every_n_steps": 10},
    {"sites": ["blocks.*", "!blocks.0.*"]},
    {"sites": "attn"},
    {"dropout": "skip"},
    {"memory_budget": 1 << 30},
]

BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"primary": "nope"}, KernelSpecError, "unknown kernel"),
    ({"primary": 3}, ProbeConfigError, "primary=3 must be a kernel spec"),
    ({"baseline": None}, ProbeConfigError, "baseline=None must be a kernel spec"),
    ({"baseline": "tiled:nosuch=1"}, KernelSpecError, "nosuch"),
    ({"golden": "yes"}, ProbeConfigError, "golden='yes' must be true or false"),
    ({"golden": 1}, ProbeConfigError, "golden=1 must be true or false"),
    ({"backward": None}, ProbeConfigError, "backward=None must be true or false"),
    ({"every_n_calls": 0}, ProbeConfigError, r"every_n_calls=0 must be an int >= 1"),
    ({"every_n_steps": True}, ProbeConfigError, r"every_n_steps=True must be an int >= 1"),
    ({"every_n_steps": 2.5}, ProbeConfigError, r"every_n_steps=2.5 must be an int >= 1"),
    ({"every_n_steps": "10"}, ProbeConfigError, r"every_n_steps='10' must be an int >= 1"),
    ({"sites": ["!"]}, ProbeConfigError, "sites="),
    ({"sites": [3]}, ProbeConfigError, "sites="),
    ({"dropout": "ignore"}, ProbeConfigError, "dropout='ignore': use one of compare, skip"),
    ({"memory_budget": 0}, ProbeConfigError, r"memory_budget=0 must be an int >= 1"),
    ({"memory_budget": -5}, ProbeConfigError, r"memory_budget=-5 must be an int >= 1"),
    ({"nosuch": 1}, ProbeConfigError, "unknown probe setting.*nosuch.*the settings are primary"),
]


def _via_probe(settings: dict[str, Any]) -> ProbeConfig:
    with probe(Direct(), **settings) as p:
        return p.config


def _via_shadow(settings: dict[str, Any]) -> ProbeConfig:
    return ShadowAttention(**settings).config


def _via_callback(settings: dict[str, Any]) -> ProbeConfig:
    return AttentionProbe(**settings).config


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value)  # quoted: '10' stays a string
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value)


def _via_hydra(settings: dict[str, Any]) -> ProbeConfig:
    overrides = ["run_dir=/nonexistent/run", "run_name=x"]
    for name, value in settings.items():
        prefix = "" if name in setting_names() else "+"  # an unknown key must be added to be seen
        overrides.append(f"{prefix}attention.probe.{name}={_hydra_value(value)}")
    with initialize_config_module("flashprobe.conf", version_base=None):
        cfg = compose("config", overrides=overrides)
    try:
        return instantiate(cfg.callbacks.attention_probe).config
    except InstantiationException as err:  # Hydra wraps the callback's own error: the cause is ours
        raise err.__cause__ from None


WAYS: dict[str, Callable[[dict[str, Any]], ProbeConfig]] = {
    "probe": _via_probe,
    "ShadowAttention": _via_shadow,
    "AttentionProbe": _via_callback,
    "hydra": _via_hydra,
}


@pytest.mark.parametrize("settings", GOOD, ids=lambda s: ",".join(s) or "defaults")
def test_every_way_in_accepts_the_same_settings(settings: dict[str, Any]) -> None:
    want = ProbeConfig(**settings)
    for name, way in WAYS.items():
        assert way(settings) == want, name


@pytest.mark.parametrize(("settings", "error", "message"), BAD, ids=lambda x: repr(x)[:40])
def test_every_way_in_rejects_the_same_settings(settings, error, message) -> None:
    for name, way in WAYS.items():
        with pytest.raises(error, match=message):
            way(settings)
            pytest.fail(f"{name} accepted {settings}")


def test_the_hydra_schema_has_every_setting_with_its_default() -> None:
    with initialize_config_module("flashprobe.conf", version_base=None):
        cfg = compose("config", overrides=["run_dir=/nonexistent/run", "run_name=x"])
    probe_cfg = dict(cfg.attention.probe)
    assert probe_cfg.pop("enabled") is True
    assert probe_cfg == ProbeConfig().as_dict()


def test_a_config_and_keywords_combine() -> None:
    cfg = ProbeConfig(backward=True)
    assert ShadowAttention(cfg, every_n_steps=5).config == ProbeConfig(backward=True, every_n_steps=5)
    with pytest.raises(ProbeConfigError, match="expected a ProbeConfig"):
        ShadowAttention({"backward": True})  # type: ignore[arg-type]


def test_a_config_is_built_and_checked_once_per_attach(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attaching with a config (as the callbacks do at every training batch) reuses it: the only new
    config is the one with ``backward="auto"`` decided for the model's device; a config whose
    ``backward`` is already decided is used as it is."""
    built: list[ProbeConfig] = []
    check = ProbeConfig.__post_init__

    def counting(self: ProbeConfig) -> None:
        built.append(self)
        check(self)

    monkeypatch.setattr(ProbeConfig, "__post_init__", counting)
    auto, decided = ProbeConfig(), ProbeConfig(backward=False)
    built.clear()
    with probe(Direct(), auto) as handle:
        assert handle.config is auto
        assert handle.shadow.config.backward is True  # math and SDPA have a backward on the CPU
    assert len(built) == 1
    built.clear()
    with probe(Direct(), decided) as handle:
        assert handle.config is decided and handle.shadow.config is decided
    assert built == []
    expected = ProbeConfig(backward=False, every_n_calls=2)
    built.clear()
    with probe(Direct(), decided, every_n_calls=2) as handle:
        assert handle.shadow.config is handle.config
    assert built == [expected]
