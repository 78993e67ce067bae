"""Weight-deviation bounds (paper §V): snapshots, distances and run comparison.

* :mod:`~flashprobe.weights.store`: the on-disk snapshot layout (``RUN_DIR/snapshots/``, safetensors
  files plus a JSON manifest, atomic writes) and :class:`SnapshotStore`, a lazy reader.
* :mod:`~flashprobe.weights.distances`: :func:`wasserstein_distance` (scipy's 1-D Wasserstein-1; two
  samples of one size in float64 here) and :func:`max_abs_diff`.
* :mod:`~flashprobe.weights.compare`: :func:`compare_runs` (behind ``flashprobe compare``), distances per
  tensor, module group and whole model at every common step of two or more runs.

* :mod:`~flashprobe.weights.snapshot`: :func:`save_snapshot`, a snapshot saved by hand (no trainer).

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
