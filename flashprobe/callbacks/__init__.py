"""Lightning callbacks: the attention probe, weight snapshots and the non-finite guard, usable in any
``Trainer``."""

from flashprobe.callbacks.attention_probe import AttentionProbe
from flashprobe.callbacks.nonfinite_guard import NonFiniteGuard
from flashprobe.callbacks.weight_snapshot import WeightSnapshot

__all__ = ["AttentionProbe", "NonFiniteGuard", "WeightSnapshot"]
