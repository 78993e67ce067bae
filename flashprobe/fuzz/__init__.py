"""Edge-case fuzzing of attention kernels: the catalogue, the 2x rule, random search, reproducers.

* :mod:`~flashprobe.fuzz.inputs` — :class:`CaseInputs`, one attention call in the dtype under test;
* :mod:`~flashprobe.fuzz.cases` — the catalogue of adversarial cases (:data:`CATALOGUE`);
* :mod:`~flashprobe.fuzz.random_cases` — the random family sampled by ``--budget``;
* :mod:`~flashprobe.fuzz.rule` — the 2x rule: :class:`Verdict`, :func:`judge`, :func:`check_output`;
* :mod:`~flashprobe.fuzz.references` — golden, baseline noise and floor of a case;
* :mod:`~flashprobe.fuzz.kernel_call` — calling a kernel on copies of a case's inputs;
* :mod:`~flashprobe.fuzz.run` — :class:`FuzzResult`, :func:`check_case`, :func:`run_catalogue`;
* :mod:`~flashprobe.fuzz.search` — :func:`random_search` and :func:`shrink`;
* :mod:`~flashprobe.fuzz.reproducer` — :func:`save_reproducer`;
* :mod:`~flashprobe.fuzz.tables` — terminal, Markdown and catalogue tables;
* :mod:`~flashprobe.fuzz.cli` — the ``flashprobe fuzz`` command.
"""

from flashprobe.fuzz.cases import CATALOGUE, SENTINELS, FuzzCase, case_generator, exact_logit_qk, select_cases
from flashprobe.fuzz.inputs import CaseInputs, UnrepresentableCaseError
from flashprobe.fuzz.kernel_call import KernelCall, call_kernel, kernel_label
from flashprobe.fuzz.random_cases import MASK_KINDS, RandomCaseSpec, make_random_case, sample_random_spec
from flashprobe.fuzz.references import references
from flashprobe.fuzz.reproducer import save_reproducer
from flashprobe.fuzz.rule import (
    RULE,
    VERDICTS,
    ZEROS_REASON,
    References,
    Verdict,
    check_output,
    judge,
    rounding_floor,
    value_floor,
)
from flashprobe.fuzz.run import FuzzResult, check_case, run_catalogue
from flashprobe.fuzz.search import random_search, shrink
from flashprobe.fuzz.tables import (
    catalogue_table,
    markdown_table,
    reason_lines,
    summary_counts,
    terminal_table,
)

__all__ = [
    "CATALOGUE",
    "MASK_KINDS",
    "RULE",
    "SENTINELS",
    "VERDICTS",
    "ZEROS_REASON",
    "CaseInputs",
    "FuzzCase",
    "FuzzResult",
    "KernelCall",
    "RandomCaseSpec",
    "References",
    "UnrepresentableCaseError",
    "Verdict",
    "call_kernel",
    "case_generator",
    "catalogue_table",
    "check_case",
    "check_output",
    "exact_logit_qk",
    "judge",
    "kernel_label",
    "make_random_case",
    "markdown_table",
    "random_search",
    "reason_lines",
    "references",
    "rounding_floor",
    "run_catalogue",
    "sample_random_spec",
    "save_reproducer",
    "select_cases",
    "shrink",
    "summary_counts",
    "terminal_table",
    "value_floor",
]
