"""The one error a ``flashprobe bench`` command raises for bad input."""

from __future__ import annotations

from flashprobe.errors import FlashprobeError

__all__ = ["BenchArgumentError"]


class BenchArgumentError(ValueError, FlashprobeError):
    """A benchmark was given a bad argument (shape, dtype, kernel, distribution, ...).

    :func:`~flashprobe.bench.args.run_cli` turns it into exit code 2 and one line on stderr, so
    the message names the problem and the fix.
    """
