"""Codecs: tensor -> (bytes, small metadata) -> tensor, plus error-feedback state. Pure torch.

The built-in codecs are ``none``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``topk``, ``sparse``
and ``powersgd``; the registry loads them the first time it is asked. Build one with
:func:`get_codec`, decode any peer's payload with :func:`decode`. What each codec is safe for
(open runs, pipeline boundaries) is in :mod:`swarmgrad.compression.traits`, which, like this
package, imports torch only when a codec itself is used: a run spec is checked without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmgrad.compression import floating, lowrank, quantization, sparse
    from swarmgrad.compression.base import (
        MAX_NUMEL,
        Codec,
        CodecError,
        Meta,
        NonFiniteError,
        codec_names,
        decode,
        get_codec,
        register,
    )
    from swarmgrad.compression.buffers import DTYPES
    from swarmgrad.compression.feedback import ErrorFeedback

#: Where each public name lives (imported on first use: ``swarmgrad.compression.X``).
_HOMES = {
    "DTYPES": "buffers",
    "MAX_NUMEL": "base",
    "Codec": "base",
    "CodecError": "base",
    "ErrorFeedback": "feedback",
    "Meta": "base",
    "NonFiniteError": "base",
    "codec_names": "base",
    "decode": "base",
    "get_codec": "base",
    "register": "base",
}
_SUBMODULES = ("floating", "lowrank", "quantization", "sparse")

__all__ = [
    "DTYPES",
    "MAX_NUMEL",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "Meta",
    "NonFiniteError",
    "codec_names",
    "decode",
    "floating",
    "get_codec",
    "lowrank",
    "quantization",
    "register",
    "sparse",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
