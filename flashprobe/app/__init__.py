"""The application layer: ``flashprobe train`` and ``flashprobe study``.

``train`` is the generic training application around the text-to-image workload of
:mod:`flashprobe.t2i` (run directories, resume, rank re-runs, ``run.json``); ``study`` trains the
paper's §V weight-deviation study through Hydra multirun; ``study_progress``, ``console``,
``overrides`` and ``machine`` are their helpers. The library layers (:mod:`flashprobe.kernels`,
:mod:`flashprobe.probing`, :mod:`flashprobe.weights`, :mod:`flashprobe.deviation`) never import
this package, so they load without Lightning or Hydra (``tests/test_layers.py``).
"""
