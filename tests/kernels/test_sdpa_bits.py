"""One golden: SDPA-shaped calls give the same bits through the references as before they took
calls beyond SDPA (windows, softcap, ALiBi, sinks, LSE, varlen, paged and cached keys).

The digests in ``data/sdpa_bits.json`` were recorded from the references before that change
(``tests/kernels/_sdpa_bits.py``, on one thread); matmul bits depend on the CPU's instruction set and
model, on torch's version and on the thread count, so the comparison runs on one thread where the rest
is that of the recording (elsewhere ``test_call_reference`` checks that SDPA-shaped calls give the bits
of SDPA's golden and baseline).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.kernels._sdpa_bits import digest, sdpa_outputs

_RECORD = json.loads((Path(__file__).parent / "data" / "sdpa_bits.json").read_text())


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    found = re.search(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
    return found.group(1).strip() if found else ""


def _same_machine() -> bool:
    here = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": _cpu_model(),
        "threads": 1,
    }
    return _RECORD["meta"] == here


@pytest.mark.skipif(not _same_machine(), reason=f"bits recorded with {_RECORD['meta']}")
def test_sdpa_shaped_calls_keep_their_bits():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the recording's: matmuls split over threads add in another order
    try:
        outputs = sdpa_outputs()
    finally:
        torch.set_num_threads(threads)
    assert sorted(outputs) == sorted(_RECORD["digests"])
    changed = [name for name, t in outputs.items() if digest(t) != _RECORD["digests"][name]]
    assert not changed, f"{len(changed)} of {len(outputs)} outputs changed bits, e.g. {changed[:5]}"
