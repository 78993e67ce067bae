"""What the study tests share: the study experiment shrunk to seconds."""

from __future__ import annotations

#: Overrides that shrink ``experiment=study`` to seconds: a tiny model, 4 steps, a snapshot and a
#: checkpoint every 2 steps, a 2-image sample grid.
TINY = [
    "model=tiny",
    "logger=csv",
    "data.num_train=64",
    "data.num_val=16",
    "data.batch_size=16",
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "callbacks.weight_snapshot.every_n_steps=2",
    "callbacks.checkpoint.every_n_train_steps=2",
    "module.num_samples=2",
    "module.num_sample_steps=2",
    "module.warmup_steps=0",
]
