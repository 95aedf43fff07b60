"""Codecs: tensor -> (bytes, small metadata) -> tensor, plus error-feedback state. Pure torch.

Importing this package registers every built-in codec: ``none``, ``fp16``, ``bf16``, ``int8``,
``int4``, ``topk``, ``powersgd``. Build one with :func:`get_codec`, decode any peer's payload with
:func:`decode`.
"""

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
