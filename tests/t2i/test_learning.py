"""The default text-to-image run learns visibly: samples show the captioned colours (slow: minutes)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from flashprobe.t2i import ShapesDataModule, TextToImageModule, caption_agreement, default_sample_captions

#: Steps of the default run (what ``flashprobe train`` is sized for).
DEFAULT_STEPS = 900


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning", "ignore:.*LeafSpec")
def test_default_run_learns_the_captioned_colours(tmp_path: Path) -> None:
    L.seed_everything(0, workers=True, verbose=False)
    dm, module = ShapesDataModule(), TextToImageModule()
    captions = default_sample_captions(96, seed=1)  # not the grid's captions
    before = caption_agreement(module.sample(captions), captions)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=DEFAULT_STEPS,
        val_check_interval=300,
        check_val_every_n_epoch=None,
        logger=CSVLogger(tmp_path, name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, dm)
    after = caption_agreement(module.sample(captions), captions)
    assert after.background >= 0.9 > before.background + 0.5
    assert after.colour >= 0.5 > before.colour + 0.25
    steps = [step for step, _, _ in module.sample_history]
    assert steps == [0, 300, 600, 900]
    assert all(path.is_file() for _, path, _ in module.sample_history)
