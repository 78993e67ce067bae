"""The shadow attention probe: compare kernels at every attention call inside real training.

* :func:`probe` attaches to an unmodified model: every attention call runs the primary kernel (what
  the model gets) and, on detached copies, the baseline and the FP64 golden value; deviations are
  accumulated per site on the device, forward and optionally backward.
* :class:`ShadowAttention` is the same as an ``nn.Module`` to call in place of SDPA.
* :func:`use_kernel` routes a model's attention calls to any kernel spec, with no statistics.
* :class:`ProbeConfig` holds every setting; :class:`DeviationStats` one site's statistics;
  :func:`reduce_across_ranks` all-reduces them; :func:`summarize` gives the verdict and the worst
  values over sites (a :class:`ProbeSummary`, whose failing calls are :class:`Failure` records).
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
from flashprobe.probing.summary import Failure, ProbeSummary, summarize

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
    "Failure",
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
