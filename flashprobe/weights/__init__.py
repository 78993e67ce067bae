"""Weight-deviation bounds (paper §V): snapshots (:mod:`~flashprobe.weights.store`,
:func:`save_snapshot`), distances (:func:`wasserstein_distance`, :func:`max_abs_diff`) and run
comparison (:func:`compare_runs`, behind ``flashprobe compare``).

Snapshots are written during training by :class:`flashprobe.callbacks.WeightSnapshot` (Lightning),
:class:`flashprobe.integrations.hf_snapshots.WeightSnapshotCallback` (Hugging Face) or
:func:`save_snapshot` (your own loop), all in one format.
"""

from flashprobe.weights.compare import (
    Comparison,
    Distances,
    PairComparison,
    SnapshotMismatchError,
    compare_pair,
    compare_runs,
    group_of,
)
from flashprobe.weights.distances import max_abs_diff, wasserstein_distance
from flashprobe.weights.snapshot import save_snapshot
from flashprobe.weights.store import SnapshotError, SnapshotStore, TensorSpec

__all__ = [
    "Comparison",
    "Distances",
    "PairComparison",
    "SnapshotError",
    "SnapshotMismatchError",
    "SnapshotStore",
    "TensorSpec",
    "compare_pair",
    "compare_runs",
    "group_of",
    "max_abs_diff",
    "save_snapshot",
    "wasserstein_distance",
]
