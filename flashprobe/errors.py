"""The base class of every error flashprobe raises on purpose.

Each error of flashprobe derives from :class:`FlashprobeError` and keeps its built-in class
(``ValueError`` for bad input, ``RuntimeError`` for a refusal at run time, ``OSError`` for a full
disk), so ``except FlashprobeError`` catches every error of flashprobe's own and ``except ValueError``
still catches a bad kernel spec. The commands print such an error in one paragraph without a
traceback; an error of another class (a bug) keeps its traceback. This module imports nothing of
flashprobe: it sits at the bottom of the package's import graph.
"""

from __future__ import annotations

__all__ = ["FlashprobeError"]


class FlashprobeError(Exception):
    """An error flashprobe raises on purpose: bad input, a refused kernel or call, an unusable file
    or directory, a stopped run. Its message names the problem and the fix."""
