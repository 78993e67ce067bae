"""What two runs differ in, read from their records (manifest facts, config.yaml settings)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashprobe.weights import SnapshotStore
from flashprobe.weights.differences import describe_differences, run_differences

from ._helpers import write_run


def _run(root: Path, name: str, *, value: float = 0.0, config: str | None = None, **facts) -> Path:
    """A two-step run with the manifest facts given (``attention``, ``precision``, ``seed``)."""
    run = write_run(root / name, {s: {"w": torch.full((4,), value + s)} for s in (0, 1)}, **facts)
    if config is not None:
        (run / "config.yaml").write_text(config.replace("RUN", str(run)))
    return run


FACTS = {"attention": "math", "precision": "bf16-mixed", "seed": 0}


def _differences(a: Path, b: Path) -> dict:
    return run_differences(SnapshotStore(a), SnapshotStore(b))


def test_the_manifest_facts_that_differ_are_named_with_both_values(tmp_path: Path) -> None:
    base = _run(tmp_path, "base", **FACTS)
    flash = _run(tmp_path, "flash", **{**FACTS, "attention": "sdpa_flash"})
    flash_seed1 = _run(tmp_path, "flash_seed1", **{**FACTS, "attention": "sdpa_flash", "seed": 1})
    unknown = _run(tmp_path, "unknown", attention="math", precision="bf16-mixed")  # no seed recorded
    assert _differences(flash, base) == {"differs": {"attention": ["sdpa_flash", "math"]}, "unrecorded": []}
    assert _differences(base, _run(tmp_path, "same", **FACTS)) == {"differs": {}, "unrecorded": []}
    both = _differences(flash_seed1, base)
    assert both["differs"] == {"attention": ["sdpa_flash", "math"], "seed": [1, 0]}
    assert describe_differences(both) == "attention (sdpa_flash vs math), seed (1 vs 0)"
    assert _differences(unknown, base) == {"differs": {}, "unrecorded": ["seed"]}


CONFIG = """\
seed: 0
run_name: NAME
run_dir: RUN
attention:
  name: math
  kernel: math
  probe: {enabled: PROBE}
trainer: {precision: bf16-mixed, max_steps: STEPS}
model: {depth: 2}
module: {attention: math, model: {depth: 2}, noise_seed: 0}
logger: {csv: {save_dir: RUN}}
callbacks:
  weight_snapshot: {dirpath: RUN, run_id: NAME, seed: 0}
  checkpoint: {dirpath: RUN/checkpoints, every_n_train_steps: EVERY}
"""


def _config(name: str, *, probe: bool = False, steps: int = 4, every: int = 2) -> str:
    text = CONFIG.replace("NAME", name).replace("PROBE", str(probe).lower())
    return text.replace("STEPS", str(steps)).replace("EVERY", str(every))


def test_config_yaml_settings_count_as_one_thing_each_and_places_and_the_probe_as_none(
    tmp_path: Path,
) -> None:
    base = _run(tmp_path, "base", config=_config("base"), **FACTS)
    # another name and directory, the probe on, checkpoints at other steps: none changes training
    same = _run(tmp_path, "same", config=_config("same", probe=True, every=1), **FACTS)
    assert _differences(same, base)["differs"] == {}
    longer = _run(tmp_path, "longer", config=_config("longer", steps=8), **FACTS)
    assert _differences(longer, base)["differs"] == {"trainer.max_steps": [8, 4]}
    deeper = _config("deeper").replace("depth: 2", "depth: 3")  # model.depth and module.model.depth: one
    assert _differences(_run(tmp_path, "deeper", config=deeper, **FACTS), base)["differs"] == {
        "model.depth": [3, 2]
    }
