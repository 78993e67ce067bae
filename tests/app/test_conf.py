"""Every config group option composes, and every composed config builds its objects."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
from omegaconf import OmegaConf

from flashprobe.app.train import CONF_DIR, compose
from flashprobe.kernels import get_kernel

#: flashprobe's config groups (conf/hydra holds options of Hydra's own groups: logging, help).
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name[0] != "_" and p.name != "hydra")
#: The repository's conf/: the experiments users run from the repository root.
REPO_CONF = Path(__file__).resolve().parents[2] / "conf"
REPO_EXPERIMENTS = sorted(p.stem for p in (REPO_CONF / "experiment").glob("*.yaml"))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_every_group_has_options() -> None:
    assert {"attention", "callbacks", "data", "experiment", "logger", "model", "study_run", "trainer"} <= set(
        GROUPS
    )
    for group in GROUPS:
        assert _options(group), f"conf/{group} has no option"


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in _options(g)])
def test_option_composes(group: str, option: str, tmp_path) -> None:
    cfg = compose([f"{group}={option}"], run_dir=tmp_path)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    assert cfg.run_dir == str(tmp_path)
    if cfg.attention.kernel is not None:
        get_kernel(cfg.attention.kernel)
    get_kernel(cfg.attention.probe.baseline)
    if group == "model":
        model = hydra.utils.instantiate(cfg.model)
        assert sum(p.numel() for p in model.parameters()) > 0
    if group == "study_run":
        assert cfg.run_name == option


def test_the_repository_conf_only_adds_options() -> None:
    """Files in ./conf replace packaged options of the same name: the repository's own must not."""
    assert REPO_EXPERIMENTS, "conf/experiment is empty"
    for path in REPO_CONF.rglob("*.yaml"):
        group = path.parent.relative_to(REPO_CONF)
        replaced = CONF_DIR / group / path.name
        assert not replaced.exists(), f"conf/{group}/{path.name} replaces a packaged option"


def test_experiments_start_with_their_command() -> None:
    for path in [*(CONF_DIR / "experiment").glob("*.yaml"), *(REPO_CONF / "experiment").glob("*.yaml")]:
        text = path.read_text()
        assert f"flashprobe train experiment={path.stem}" in text, f"{path.name} does not name its command"


#: Overrides that shrink any experiment to seconds (applied after the experiment's own values): one
#: torch thread too (the study experiments' two threads, beside the other test workers, made each run
#: several times slower).
TINY = [
    "model=tiny",
    "threads=1",
    "logger=csv",
    "data.num_train=16",
    "data.num_val=8",
    "data.batch_size=8",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "module.num_samples=2",
    "module.num_sample_steps=2",
    "module.warmup_steps=0",
    "callbacks.weight_snapshot.every_n_steps=1",
]


@pytest.mark.parametrize("experiment", [*_options("experiment"), *REPO_EXPERIMENTS])
def test_every_experiment_runs_at_a_tiny_budget(experiment: str, tmp_path, monkeypatch) -> None:
    from flashprobe.app.train import train

    monkeypatch.chdir(REPO_CONF.parent)  # ./conf is the repository's
    cfg = compose([f"experiment={experiment}", *TINY], run_dir=tmp_path)
    _, objects = train(cfg)
    assert objects["trainer"].global_step == 2
    assert (tmp_path / "snapshots" / "manifest.json").is_file()
    assert (tmp_path / "probe.jsonl").is_file() == bool(cfg.attention.probe.enabled)
