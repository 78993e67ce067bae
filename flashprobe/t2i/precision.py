"""Trainer arguments for a precision, including fp16 mixed precision on CPU.

Lightning 2.6 accepts ``precision="32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-true"`` and
``"64-true"`` on CPU, but silently turns ``"16-mixed"`` into ``"bf16-mixed"`` there (with a
warning). torch's CPU autocast does support float16 (with a CPU ``GradScaler``), so
:func:`trainer_precision` passes Lightning's ``MixedPrecision("16-mixed", "cpu")`` plugin instead:
the FP16-vs-FP32 comparison of the paper then really runs in FP16 on a CPU.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRECISIONS", "trainer_precision"]

#: Precisions the text-to-image workload is tested with.
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")
_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def trainer_precision(precision: str | int, accelerator: str = "cpu") -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` that give exactly ``precision`` on ``accelerator``.

    Args:
        precision: a Lightning precision (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ...;
            the short forms ``32``, ``16``, ``"bf16"`` too).
        accelerator: ``"cpu"``, ``"gpu"``/``"cuda"``, ``"auto"``, ...

    Returns:
        ``{"precision": ...}``, or ``{"plugins": [MixedPrecision("16-mixed", "cpu")]}`` for fp16
        mixed precision on CPU.

    Raises:
        ValueError: an unknown precision, naming the supported ones.
    """
    name = _ALIASES.get(str(precision), str(precision))
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if name == "16-mixed" and accelerator == "cpu":
        from lightning.pytorch.plugins.precision import MixedPrecision  # Lightning only where it is built

        return {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    return {"precision": name}
