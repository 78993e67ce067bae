"""Edge-case fuzzing of attention kernels: the catalogue (:mod:`~flashprobe.fuzz.cases`), the rule
(:mod:`~flashprobe.fuzz.rule`), random search, sequences and invariants, reproducers, the findings
ledger and the ``flashprobe fuzz`` command (:mod:`~flashprobe.fuzz.cli`); outputs and gradients, in
every memory layout.
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
