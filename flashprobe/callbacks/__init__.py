"""Lightning callbacks: the attention probe and weight snapshots, usable in any ``Trainer``."""

from flashprobe.callbacks.attention_probe import AttentionProbe
from flashprobe.callbacks.weight_snapshot import WeightSnapshot

__all__ = ["AttentionProbe", "WeightSnapshot"]
