"""transformers' FlexAttention entry point (``attn_implementation="flex_attention"``) as a source.

transformers calls a compiled ``flex_attention`` that no name swap reaches, so its wrapper
``compile_friendly_flex_attention`` is swapped instead; the model gets the wrapper's output and the
probe compares it like a direct ``flex_attention`` call (:mod:`flashprobe.probing.flex`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from flashprobe.probing import patching
from flashprobe.probing.flex import FLEX_ORIGINAL, FlexCall, probed_call

__all__ = ["SOURCE"]

_MODULE, _FUNCTION = "transformers.integrations.flex_attention", "compile_friendly_flex_attention"


def _probed(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``compile_friendly_flex_attention``, probed."""

    def compile_friendly_flex_attention(
        query: Any, key: Any, value: Any, training: bool = False, **kwargs: Any
    ):  # type: ignore[no-untyped-def]
        def run() -> Any:
            return original(query, key, value, training=training, **kwargs)

        def call() -> FlexCall:
            return FlexCall(FlexCall.bind(query, key, value, **kwargs).arguments, runner=run)

        return probed_call(sys._getframe(1), call, run)

    return compile_friendly_flex_attention


def _install() -> None:
    library = sys.modules.get(_MODULE)
    original = getattr(library, _FUNCTION, None)
    if FLEX_ORIGINAL is not None and callable(original):
        patching.patch(vars(library), _FUNCTION, _probed(original))


#: transformers' ``compile_friendly_flex_attention``.
SOURCE = patching.Source("transformers flex_attention", _install)
