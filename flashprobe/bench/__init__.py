"""Microbenchmarks: ``flashprobe bench NAME`` runs ``flashprobe.bench.NAME:main``.

Commands (one module each):

* :mod:`~flashprobe.bench.paper` — every microbenchmark claim of the paper (Figs 3–6), measured at
  the setting it needs (:mod:`~flashprobe.bench.paper_runs`) and judged against a stated criterion
  (:mod:`~flashprobe.bench.claims`), beside the real kernels;
* :mod:`~flashprobe.bench.precision` — deviation vs dtype (paper Figs 3, 4);
* :mod:`~flashprobe.bench.seqlen` — deviation vs sequence length at a fixed tile size (Fig 5);
* :mod:`~flashprobe.bench.tiles` — deviation vs tile size, block order and tile shape (Fig 6);
* :mod:`~flashprobe.bench.speed` — time and peak memory of kernels vs ``math``;
* :mod:`~flashprobe.bench.overhead` — training-step overhead of the shadow probe, against upper limits;
* :mod:`~flashprobe.bench.bias` — signed (biased) error on repeated row maxima (Qiu & Yao), and the
  ``tiled:max_shift=repeated`` mitigation.
* :mod:`~flashprobe.bench.fp8` — FP8 attention variants vs the FP64 golden value, and the P-cast
  collapse of an attention sink (forward only).
* :mod:`~flashprobe.bench.verdicts` — the probe's verdict on torch's kernels in training (its calibration).

The comparison of pass/fail rules on the project's planted bugs is evidence, outside the package:
``python -m lab.rules`` in the repository.

Shared pieces:

* :mod:`~flashprobe.bench.errors` — ``BenchArgumentError``: bad input, exit code 2;
* :mod:`~flashprobe.bench.args` — the common options, their parsing, ``--out`` checking, ``run_cli``;
* :mod:`~flashprobe.bench.inputs` — input shape and distribution, ``q, k, v`` drawn in float64;
* :mod:`~flashprobe.bench.sweep` — primary vs baseline vs golden over points × dtypes × seeds;
* :mod:`~flashprobe.bench.sweep_command` — the pipeline of ``precision``, ``seqlen`` and ``tiles``;
* :mod:`~flashprobe.bench.results` — ``DIR/<name>.json`` and ``.csv``, ``--replot`` loading, tables.

Figures are drawn by :mod:`flashprobe.report.bench_figures`; edge-case fuzzing is :mod:`flashprobe.fuzz`.
"""
