"""Microbenchmarks: ``flashprobe bench NAME`` runs ``flashprobe.bench.NAME:main``.

Commands: ``paper`` (every microbenchmark claim of the paper, judged), ``precision``, ``seqlen`` and
``tiles`` (deviation vs dtype, sequence length and tile size: Figs 3-6), ``speed`` (time and memory),
``overhead`` (the probe's training-step overhead), ``bias`` (signed error on repeated row maxima),
``fp8`` (FP8 variants vs the FP64 golden value) and ``verdicts`` (the probe on torch's kernels).

Shared pieces: :mod:`~flashprobe.bench.args` (options, ``run_cli``), :mod:`~flashprobe.bench.inputs`,
:mod:`~flashprobe.bench.sweep` and :mod:`~flashprobe.bench.sweep_command` (the deviation sweep and its
pipeline), :mod:`~flashprobe.bench.results` (files and tables). Figures: :mod:`flashprobe.report`.
"""
