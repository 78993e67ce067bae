"""Trainer arguments for a precision, including fp16 mixed precision on CPU (which Lightning turns
into bf16 there; torch's CPU autocast supports fp16, so its ``MixedPrecision`` plugin is passed).
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
        precision: one of :data:`PRECISIONS` or a short form (``32``, ``16``, ``"bf16"``).
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
