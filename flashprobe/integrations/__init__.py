"""Integrations with other libraries, each imported on its own (its library is needed only there).

* :mod:`flashprobe.integrations.hf`: Hugging Face transformers — ``AttentionProbeCallback`` for
  ``transformers.Trainer`` and :func:`~flashprobe.integrations.hf.register_attention`, which makes a
  flashprobe kernel selectable as ``attn_implementation="probe_kernel"``; its
  ``WeightSnapshotCallback`` (:mod:`flashprobe.integrations.hf_snapshots`) writes weight snapshots in
  the format of the Lightning ``WeightSnapshot``, for ``flashprobe compare``.
"""
