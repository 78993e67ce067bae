"""Edge-case fuzzing of attention kernels: the catalogue, the rule, random search, reproducers.

Outputs and gradients (``dq``, ``dk``, ``dv``), in every memory layout, at the shapes of
long-context training.

* :mod:`~flashprobe.fuzz.inputs` — :class:`CaseInputs`, one attention call in the dtype under test;
* :mod:`~flashprobe.fuzz.layouts` — the memory layouts a case's inputs can take (:data:`LAYOUTS`);
* :mod:`~flashprobe.fuzz.cases` — the catalogue of adversarial cases (:data:`CATALOGUE`, profiles,
  the :data:`PROPERTIES` they test);
* :mod:`~flashprobe.fuzz.fit` — :func:`fit_inputs`: a case posed within a kernel's declared limits;
* :mod:`~flashprobe.fuzz.random_cases` — the random family sampled by ``--budget``;
* :mod:`~flashprobe.fuzz.rule` — the verdict on a case: :class:`Verdict`, :func:`judge`,
  :func:`judge_gradients`, :func:`check_output` (the rule itself is :mod:`flashprobe.judge`);
* :mod:`~flashprobe.fuzz.references` — golden, baseline noise and floor of a case, and of its
  gradients;
* :mod:`~flashprobe.fuzz.kernel_call` — calling a kernel on copies of a case's inputs;
* :mod:`~flashprobe.fuzz.run` — :class:`FuzzResult`, :func:`check_case`, :func:`run_catalogue`;
* :mod:`~flashprobe.fuzz.search` — :func:`random_search` (its failures shrunk by
  :func:`flashprobe.probing.repro.shrink_reproducer`, the one shrinker of every reproducer);
* :mod:`~flashprobe.fuzz.sequences` — several calls of a kernel in one process, each judged
  (:data:`SEQUENCES`: caches keyed without the scale, the strides, ...), saved and replayed whole;
* :mod:`~flashprobe.fuzz.invariants` — relations a correct kernel keeps (:data:`INVARIANTS`: V = 1,
  key permutation, batch invariance, ...), the declared precision, and :func:`run_checks`;
* :mod:`~flashprobe.fuzz.reproducer` — :func:`save_reproducer`: a failing case in the one
  reproducer format (:mod:`flashprobe.formats.reproducer`);
* :mod:`~flashprobe.fuzz.ledger` — :func:`load_ledger`: accepted findings (``--ledger``), their
  failures ``known``, their unexpected passes failures;
* :mod:`~flashprobe.fuzz.tables` — terminal, Markdown and catalogue tables;
* :mod:`~flashprobe.fuzz.cli` — the ``flashprobe fuzz`` command.
"""

from flashprobe.fuzz.cases import (
    CATALOGUE,
    PROFILES,
    PROPERTIES,
    SENTINELS,
    FuzzCase,
    case_generator,
    exact_logit_qk,
    select_cases,
)
from flashprobe.fuzz.fit import FittedInputs, NotApplicableError, fit_inputs
from flashprobe.fuzz.inputs import CaseInputs, UnrepresentableCaseError
from flashprobe.fuzz.invariants import CHECKS, INVARIANTS, run_checks, select_checks
from flashprobe.fuzz.kernel_call import KernelCall, call_kernel, kernel_label
from flashprobe.fuzz.layouts import LAYOUTS, apply_layout
from flashprobe.fuzz.ledger import Ledger, LedgerError, load_ledger
from flashprobe.fuzz.random_cases import MASK_KINDS, RandomCaseSpec, make_random_case, sample_random_spec
from flashprobe.fuzz.references import grad_output, gradient_references, references
from flashprobe.fuzz.reproducer import ReproducerStore, save_reproducer
from flashprobe.fuzz.rule import (
    GRADIENTS,
    RULE,
    VERDICTS,
    ZEROS_REASON,
    GradientReference,
    References,
    Verdict,
    check_output,
    judge,
    judge_gradients,
    rounding_floor,
    value_floor,
)
from flashprobe.fuzz.run import FuzzResult, case_references, check_case, run_catalogue
from flashprobe.fuzz.search import random_search
from flashprobe.fuzz.sequences import SEQUENCES, replay_sequence
from flashprobe.fuzz.tables import (
    catalogue_table,
    coverage,
    markdown_table,
    property_coverage,
    reason_lines,
    summary_counts,
    terminal_table,
)

__all__ = [
    "CATALOGUE",
    "CHECKS",
    "GRADIENTS",
    "INVARIANTS",
    "LAYOUTS",
    "MASK_KINDS",
    "PROFILES",
    "PROPERTIES",
    "RULE",
    "SENTINELS",
    "SEQUENCES",
    "VERDICTS",
    "ZEROS_REASON",
    "CaseInputs",
    "FittedInputs",
    "FuzzCase",
    "FuzzResult",
    "GradientReference",
    "KernelCall",
    "Ledger",
    "LedgerError",
    "NotApplicableError",
    "RandomCaseSpec",
    "References",
    "ReproducerStore",
    "UnrepresentableCaseError",
    "Verdict",
    "apply_layout",
    "call_kernel",
    "case_generator",
    "case_references",
    "catalogue_table",
    "check_case",
    "check_output",
    "coverage",
    "exact_logit_qk",
    "fit_inputs",
    "grad_output",
    "gradient_references",
    "judge",
    "judge_gradients",
    "kernel_label",
    "load_ledger",
    "make_random_case",
    "markdown_table",
    "property_coverage",
    "random_search",
    "reason_lines",
    "references",
    "replay_sequence",
    "rounding_floor",
    "run_catalogue",
    "run_checks",
    "sample_random_spec",
    "save_reproducer",
    "select_cases",
    "select_checks",
    "summary_counts",
    "terminal_table",
    "value_floor",
]
