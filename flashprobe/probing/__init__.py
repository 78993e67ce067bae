"""The shadow attention probe: compare kernels at every attention call inside real training.

* :func:`probe` attaches to an unmodified model; every ``scaled_dot_product_attention`` call made
  inside it runs the primary kernel (its output is what the model gets) and, on identical
  detached inputs, the baseline and the FP64 golden value; deviations are accumulated per site
  (module path) on the device, forward and optionally backward.
* :class:`ShadowAttention` is the same as an ``nn.Module`` to call in place of SDPA.
* :func:`use_kernel` routes a model's SDPA calls to any kernel spec, with no statistics.
* :class:`ProbeConfig` holds every setting, validated once (the callback and the Hydra config use
  it too).
* :class:`DeviationStats` holds one site's on-device statistics; :func:`reduce_across_ranks`
  all-reduces them in distributed training; :func:`summarize` gives the worst values over sites.

Modules, one idea each: ``call`` (one SDPA call adapted to the kernels' convention), ``sites`` (the
attached models and the site finder: which attached module made a call), ``patching`` (swapping the
attention sources' names in and out), the sources ``sdpa`` (with ``opaque`` for compiled graphs),
``fastpath``, ``flex``, ``hf_flex``, ``flashattn``, ``flashinfer`` and ``varlen`` (the last three
through ``direct``: arguments bound by signature, read as a call of the kernels layer), ``intercept``
(the table of sources and the handles' attach/detach), ``compiled`` (the attach-time check for
``torch.compile(..., fullgraph=True)``), ``routing`` (``use_kernel``), ``shadow`` (``ShadowAttention``;
its references are planned in bounded memory by :mod:`flashprobe.kernels.reference`), ``config``
(``ProbeConfig``), ``stats`` (on-device statistics and their cross-rank reduction), ``summary`` (the
summary over sites, typed: ``ProbeSummary``), ``session`` (a training run's tally and verdict block),
``run_session`` (the training callbacks' ``ProbeSession``), ``repro`` (reproducers replayed and shrunk,
the probe's and the fuzzer's; their file is :mod:`flashprobe.formats.reproducer`), ``probe``
(``probe``).
"""

from flashprobe.probing.call import SdpaCall
from flashprobe.probing.compiled import ProbeCompileError
from flashprobe.probing.config import DROPOUT_POLICIES, ProbeConfig, ProbeConfigError
from flashprobe.probing.probe import Probe, probe
from flashprobe.probing.routing import KernelRoute, use_kernel
from flashprobe.probing.shadow import ON_FAILURE, ProbeFailureError, ShadowAttention
from flashprobe.probing.sites import ROOT_SITE, ProbeWarning
from flashprobe.probing.stats import (
    ARG_FIELDS,
    DIRECTIONS,
    FIELDS,
    GRADIENTS,
    INPUTS,
    MAX_FIELDS,
    N_MAX,
    N_SUMS,
    PAIRS,
    SUM_FIELDS,
    DeviationStats,
    reduce_across_ranks,
    stats_dict,
)
from flashprobe.probing.summary import ProbeSummary, summarize

__all__ = [
    "ARG_FIELDS",
    "DIRECTIONS",
    "DROPOUT_POLICIES",
    "FIELDS",
    "GRADIENTS",
    "INPUTS",
    "MAX_FIELDS",
    "N_MAX",
    "N_SUMS",
    "ON_FAILURE",
    "PAIRS",
    "ROOT_SITE",
    "SUM_FIELDS",
    "DeviationStats",
    "KernelRoute",
    "Probe",
    "ProbeCompileError",
    "ProbeConfig",
    "ProbeConfigError",
    "ProbeFailureError",
    "ProbeSummary",
    "ProbeWarning",
    "SdpaCall",
    "ShadowAttention",
    "probe",
    "reduce_across_ranks",
    "stats_dict",
    "summarize",
    "use_kernel",
]
