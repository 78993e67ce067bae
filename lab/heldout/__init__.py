"""Held-out attention kernels with the real libraries' signatures: correct controls and one realistic bug
per field-bug class of 2025–26, written without reference to flashprobe's detectors.

``HELDOUT`` maps a name to ``HeldOut(fn, api, kind, trigger)``; ``CONTRACTS`` maps the same names to the
conventions each kernel follows (signature source, LSE base, LSE of a row without keys, dtypes, backward,
``out=``, calls needed). ``stateful.reset_state()`` forgets the state the stateful kernels keep.
"""

from __future__ import annotations

from lab.heldout import flash_attn_like, fp8_like, merge_like, stateful, varlen_like
from lab.heldout._table import Contract, HeldOut

_MODULES = (flash_attn_like, varlen_like, merge_like, fp8_like, stateful)

HELDOUT: dict[str, HeldOut] = {name: row for module in _MODULES for name, row in module.HELDOUT.items()}
CONTRACTS: dict[str, Contract] = {name: c for module in _MODULES for name, c in module.CONTRACTS.items()}

__all__ = ["CONTRACTS", "HELDOUT", "Contract", "HeldOut"]
