"""``flashprobe train``: the Hydra app that trains the text-to-image model.

``train(cfg)`` builds everything from a composed config and returns ``(metrics, objects)`` so tests
and the study call it directly; :func:`cli_main` is the thin ``@hydra.main`` entry point used by
the ``flashprobe train`` command (``-m`` multirun sweeps included).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from flashprobe.t2i.precision import trainer_precision

__all__ = ["CONF_DIR", "cli_main", "compose", "train"]

log = logging.getLogger(__name__)

#: The packaged Hydra configs.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def _run_dir(cfg: DictConfig) -> Path:
    """The run directory: Hydra's output dir inside a Hydra app, else ``cfg.run_dir``."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir)
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    raise ValueError("train: no run directory; set run_dir=... when calling train() outside Hydra")


def _check(cfg: DictConfig) -> None:
    from flashprobe.kernels import get_kernel

    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps is not None and max_steps != -1 and max_steps <= 0:
        raise ValueError(f"trainer.max_steps={max_steps} must be positive (or -1 for max_epochs)")
    if cfg.attention.kernel is not None:
        get_kernel(cfg.attention.kernel)  # unknown kernels and options fail here, before any work
    for key in ("baseline",):
        spec = cfg.attention.probe.get(key)
        if spec is not None:
            get_kernel(spec)


def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Train the text-to-image model described by ``cfg``.

    Args:
        cfg: a composed ``flashprobe/conf/config.yaml`` (see :func:`compose`), optionally with
            ``run_dir`` set when called outside a Hydra app.

    Returns:
        ``(metrics, objects)``: the trainer's final callback metrics as floats, and the built
        ``datamodule``, ``module``, ``trainer``, ``callbacks``, ``loggers`` and ``run_dir``.
    """
    _check(cfg)
    run_dir = _run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network unless asked for
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)

    L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.instantiate(cfg.module)
    callbacks = [
        hydra.utils.instantiate(c)
        for name, c in (cfg.get("callbacks") or {}).items()
        if c is not None and (name != "attention_probe" or cfg.attention.probe.enabled)
    ]
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    precision = trainer_precision(
        trainer_cfg.pop("precision", "32-true"), trainer_cfg.get("accelerator", "cpu")
    )
    trainer: L.Trainer = hydra.utils.instantiate(
        trainer_cfg, default_root_dir=str(run_dir), callbacks=callbacks, logger=loggers or False, **precision
    )
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    finally:
        for lg in loggers:
            finalize = getattr(lg, "finalize", None)
            if finalize is not None:
                finalize("success")
        if "wandb" in sys.modules:
            import wandb

            if wandb.run is not None:
                wandb.finish()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    objects = {
        "datamodule": datamodule,
        "module": module,
        "trainer": trainer,
        "callbacks": callbacks,
        "loggers": loggers,
        "run_dir": run_dir,
    }
    return metrics, objects


def compose(overrides: Sequence[str] = (), run_dir: str | Path | None = None) -> DictConfig:
    """Compose the packaged config with Hydra overrides, outside a Hydra app (tests, the study).

    Args:
        overrides: Hydra overrides such as ``["attention=math", "trainer.max_steps=5"]``.
        run_dir: the run directory to train into.

    Returns:
        The composed config, with ``run_dir`` set when given.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    if run_dir is not None:
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    return cfg


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    metrics, _ = train(cfg)
    return metrics.get("val/loss")


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe train [overrides]``: run the Hydra app with ``argv`` as its command line.

    Lightning's DDP launcher starts the other ranks by re-running the main script with
    ``sys.argv[1:]``; ``sys.argv`` and ``__main__.__spec__`` are pointed at this module, so the
    ranks re-run this Hydra app (``python -m flashprobe.t2i.train OVERRIDES``), not the CLI.
    """
    sys.argv = [__file__, *(sys.argv[1:] if argv is None else argv)]
    main_module = sys.modules.get("__main__")
    if main_module is not None and getattr(main_module, "__spec__", None) is not None:
        main_module.__spec__ = importlib.util.find_spec(__name__)
    _hydra_main()
    return 0


if __name__ == "__main__":
    _hydra_main()
