"""The codec contract: tensor -> (payload bytes, small metadata) -> tensor, and the registry.

A codec is a pair of pure functions with a stable ``name`` and ``version``. Everything ``decode``
needs is in the payload and in :class:`Meta` (shape, dtype, integer parameters such as the block
size), so a receiver decodes any peer's message with :func:`decode` without knowing how the sender
configured its codec. ``decode`` treats both arguments as hostile: it checks the codec name and
version, the shape, the parameters and the exact payload length before it allocates anything, and
it checks scales and values for NaN/Inf (finite fp32 values beyond the range of the declared dtype,
say 1e6 declared ``float16``, count: the cast would make them Inf), raising :class:`CodecError` (a
``ValueError``) instead of returning a garbage tensor.

Payloads are little-endian; the byte layout of each codec is documented in its class.

On a GPU: the dense codecs (``none``, ``fp16``, ``bf16``, ``int8``, ``int4``) encode a CUDA tensor
on its device and copy only the payload to the host; :func:`decode` into a CUDA ``out`` (or with
``device=``) copies only the payload to the device and decodes there. The values are the same
bits as on the CPU: every step is one correctly rounded IEEE operation. The sparse and low-rank
codecs work on the CPU and move tensors across.
"""

from __future__ import annotations

import importlib
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

import torch

from swarmgrad.compression.buffers import (
    DTYPES,
    Wire,
    dtype_name,
    to_bytes,
    to_device,
)
from swarmgrad.compression.traits import Traits

if sys.byteorder != "little":  # pragma: no cover - no such machine in CI
    raise ImportError("swarmgrad codecs assume a little-endian machine")

#: Largest tensor a peer may describe in one message (2**31 elements, 8 GiB of fp32): bigger
#: shapes are rejected before any allocation.
MAX_NUMEL = 2**31
MAX_NDIM = 8


class CodecError(ValueError):
    """A payload or its metadata is malformed: wrong codec, version, shape, length or values."""


class NonFiniteError(CodecError):
    """A payload decodes to (or scales by) NaN or Inf."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Meta:
    """What a receiver needs, beside the payload, to decode a tensor.

    ``params`` holds the codec's integer parameters (block size, k, rank, ...); they are part of
    the message, so a receiver never has to share the sender's configuration.
    """

    codec: str
    version: int
    shape: tuple[int, ...]
    dtype: str
    params: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def raw_nbytes(self) -> int:
        """Size of the uncompressed tensor in its own dtype."""
        return self.numel * DTYPES[self.dtype].itemsize

    def ratio(self, payload_nbytes: int) -> float:
        """Compression ratio: uncompressed bytes over payload bytes (inf for an empty payload)."""
        return self.raw_nbytes / payload_nbytes if payload_nbytes else math.inf


class Codec(ABC):
    """Base class of every codec. Subclasses set ``name``/``version`` and implement both halves.

    ``encode`` accepts any tensor of a dtype in :data:`DTYPES`, of any shape (empty, scalar,
    non-contiguous included); ``decode`` returns a new contiguous tensor of the original shape and
    dtype. Implementations are vectorized torch with no Python loop over elements.
    """

    name: ClassVar[str]
    version: ClassVar[int]
    #: Whether decode(encode(x)) == x exactly.
    lossless: ClassVar[bool] = False
    #: Whether ``_decode_into`` also takes the payload as a uint8 tensor on a GPU (and decodes
    #: there); otherwise a GPU ``out`` gets the CPU decoding copied in.
    device_decode: ClassVar[bool] = False
    #: Where its values may go (open runs, pipeline boundaries); see ``compression/traits.py``.
    traits: ClassVar[Traits] = Traits()

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> tuple[bytes, Meta]:
        """Compress ``tensor``; returns the payload and the metadata that goes with it."""

    # A codec implements one of the two decoders; each defaults to the other. Writing into a
    # given tensor is the better one to implement: a fresh multi-MiB allocation costs about as
    # much as the decoding.

    @classmethod
    def _decode(cls, data: bytes | memoryview, meta: Meta) -> torch.Tensor:
        """Decode a payload whose ``meta`` passed the generic checks in :func:`decode`."""
        out = torch.empty(meta.numel, dtype=DTYPES[meta.dtype])
        cls._decode_into(data, meta, out)
        return out.reshape(meta.shape)

    @classmethod
    def _decode_into(cls, data: Wire, meta: Meta, out: torch.Tensor) -> None:
        """Decode into the flat, contiguous ``out`` of ``meta``'s dtype and size (on ``data``'s
        device: ``data`` is a uint8 tensor only for codecs with ``device_decode``)."""
        if isinstance(data, torch.Tensor):  # pragma: no cover - decode() never does this
            raise TypeError(f"{cls.name} decodes host bytes only")
        out.copy_(cls._decode(data, meta).reshape(-1))

    @classmethod
    def _decode_onto(cls, data: bytes | memoryview, meta: Meta, out: torch.Tensor) -> None:
        """Decode host bytes into the flat ``out`` on a GPU: with ``device_decode``, only the
        payload crosses and is decoded there; otherwise the CPU's decoding is copied across."""
        if cls.device_decode:
            cls._decode_into(to_device(data, out.device), meta, out)
        else:
            out.copy_(cls._decode(data, meta).reshape(-1))

    @classmethod
    @abstractmethod
    def payload_nbytes(cls, meta: Meta) -> int:
        """Exact payload size implied by ``meta``; raises CodecError for bad parameters."""

    def decode(self, data: bytes, meta: Meta) -> torch.Tensor:
        return decode(data, meta)

    def encode_view(self, tensor: torch.Tensor) -> tuple[bytes | memoryview, Meta]:
        """Like :meth:`encode`, but a codec may return a view of memory instead of a new bytes
        object: of ``tensor``'s own (the identity codec on a CPU tensor), or of the page-locked
        host buffer a GPU's payload was copied into. The caller must keep ``tensor`` alive and
        unchanged until the payload has been consumed."""
        return self.encode(tensor)

    def _meta(self, tensor: torch.Tensor, **params: int) -> Meta:
        return Meta(
            codec=self.name,
            version=self.version,
            shape=tuple(tensor.shape),
            dtype=dtype_name(tensor.dtype),
            params=params,
        )


#: Told by a codec's ``_payload`` that bytes ``[start, stop)`` of ``payload`` are final (in the
#: order of the work queued on the payload's device), so a listener can start copying them out
#: while later parts are still computed.
Ready = Callable[[torch.Tensor, int, int], None]


class DevicePayloadCodec(Codec):
    """A codec that builds its payload as a uint8 tensor where the input lives (a GPU's tensor
    on its GPU): ``encode`` copies it into bytes, ``encode_view`` of a GPU tensor hands out the
    pinned host copy itself (one copy across PCIe, none on the host). A codec that reports the
    parts of its payload as they are done (``ready``) has them copied across while it computes
    the rest."""

    device_decode = True

    @abstractmethod
    def _payload(
        self, tensor: torch.Tensor, ready: Ready | None = None
    ) -> tuple[torch.Tensor, Meta]:
        """The payload as a uint8 tensor on ``tensor``'s device (it may be a reused buffer)."""

    def encode(self, tensor: torch.Tensor) -> tuple[bytes, Meta]:
        payload, meta = self._payload(tensor)
        return to_bytes(payload), meta

    def encode_view(self, tensor: torch.Tensor) -> tuple[bytes | memoryview, Meta]:
        if tensor.device.type == "cpu":
            payload, meta = self._payload(tensor)
            return to_bytes(payload), meta
        sink = _ToHost(tensor.device)
        try:
            payload, meta = self._payload(tensor, sink.ready)
        except BaseException:
            sink.stream.synchronize()  # no copy may still write into a buffer being freed
            raise
        return sink.finish(payload), meta


class _ToHost:
    """Copies the finished parts of a GPU payload into one page-locked host buffer on a side
    stream, so the copy across PCIe overlaps the computing of the parts after them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.host: torch.Tensor | None = None
        self.copied = 0

    def ready(self, payload: torch.Tensor, start: int, stop: int) -> None:
        if self.host is None:
            self.host = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.host[start:stop].copy_(payload[start:stop], non_blocking=True)
        self.copied += stop - start

    def finish(self, payload: torch.Tensor) -> bytes | memoryview:
        self.stream.synchronize()
        if payload.numel() == 0:
            return b""
        host = self.host
        if host is None or self.copied != payload.numel():  # the codec reported no (or not all)
            host = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(payload)
        return host.numpy().data.cast("B")  # the array, and so the buffer, stay alive


_REGISTRY: dict[tuple[str, int], type[Codec]] = {}
_BUILTIN_MODULES = ("floating", "quantization", "sparse", "chunk_sparse", "lowrank")
_builtins_loaded = False


def _registry() -> dict[tuple[str, int], type[Codec]]:
    """The registry, with the built-in codecs' modules imported (each registers its codecs)."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(f"swarmgrad.compression.{module}")
    return _REGISTRY


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec known to :func:`decode` and :func:`get_codec`."""
    key = (cls.name, cls.version)
    if key in _REGISTRY and _REGISTRY[key] is not cls:
        raise RuntimeError(f"codec {cls.name!r} v{cls.version} registered twice")
    _REGISTRY[key] = cls
    return cls


def registered_traits() -> dict[str, Traits]:
    """Each registered codec's traits (its newest version's), by name."""
    return {name: cls.traits for (name, _), cls in sorted(_registry().items())}


def codec_names() -> list[str]:
    """Names of all registered codecs, in registration order."""
    return list(dict.fromkeys(name for name, _ in _registry()))


def get_codec(name: str, **options: int | float) -> Codec:
    """Build the newest version of codec ``name`` with ``options`` (e.g. ``block_size=256``)."""
    versions = [v for (n, v) in _registry() if n == name]
    if not versions:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(codec_names())}")
    cls = _REGISTRY[(name, max(versions))]
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"bad options for codec {name!r}: {e}") from None


def decode(
    data: bytes | bytearray | memoryview,
    meta: Meta,
    *,
    max_numel: int = MAX_NUMEL,
    out: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Decode any registered codec's payload, validating ``meta`` and ``data`` first.

    ``max_numel`` caps the tensor a message may describe: sparse and low-rank payloads are small
    while their decoded tensors are not, so a receiver passes the size its run spec allows.
    ``out`` (contiguous, ``meta``'s dtype and number of elements) receives the values instead of
    a new tensor: a fresh multi-MiB allocation costs about as much as decoding it. On error,
    ``out`` may hold partial values. ``out`` may live on a GPU; without ``out``, the result is
    made on ``device`` (the CPU by default).
    """
    cls = _registry().get((meta.codec, meta.version))
    if cls is None:
        known = [v for (n, v) in _REGISTRY if n == meta.codec]
        if known:
            raise CodecError(f"codec {meta.codec!r} has no version {meta.version} (have {known})")
        raise CodecError(f"unknown codec {meta.codec!r}")
    if meta.dtype not in DTYPES:
        raise CodecError(f"unsupported dtype {meta.dtype!r}")
    if len(meta.shape) > MAX_NDIM or any(
        # A dimension over MAX_NUMEL beside a 0 has no elements, but torch cannot make it.
        not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_NUMEL
        for d in meta.shape
    ):
        raise CodecError(f"bad shape {meta.shape!r}")
    if meta.numel > min(max_numel, MAX_NUMEL):
        raise CodecError(
            f"shape {meta.shape} has {meta.numel} elements, more than {min(max_numel, MAX_NUMEL)}"
        )
    for key, value in meta.params.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise CodecError(f"parameter {key!r} must be an integer, got {value!r}")
    # Views (a pinned GPU payload, a received buffer) are read in place: no copy of the payload.
    payload: bytes | memoryview = data if isinstance(data, bytes) else memoryview(data).cast("B")
    # Decoding needs no codec options: they travel in meta.params.
    expected = cls.payload_nbytes(meta)
    if len(payload) != expected:
        raise CodecError(
            f"{meta.codec} payload for shape {meta.shape} must be {expected} bytes, "
            f"got {len(payload)}"
        )
    if out is not None:
        if not out.is_contiguous() or out.dtype != DTYPES[meta.dtype] or out.numel() != meta.numel:
            raise ValueError(f"out must be a contiguous {meta.dtype} tensor of {meta.numel} values")
        _decode_on(cls, payload, meta, out.view(-1))
        return out
    if device is not None and torch.device(device).type != "cpu":
        result = torch.empty(meta.numel, dtype=DTYPES[meta.dtype], device=device)
        _decode_on(cls, payload, meta, result)
        return result.reshape(meta.shape)
    result = cls._decode(payload, meta)
    if result.shape != torch.Size(meta.shape):  # pragma: no cover - a codec bug, not bad input
        raise AssertionError(f"{meta.codec} decoded shape {tuple(result.shape)} != {meta.shape}")
    return result


def _decode_on(
    cls: type[Codec], payload: bytes | memoryview, meta: Meta, out: torch.Tensor
) -> None:
    """Decode into the flat ``out`` on its device: on a GPU, only the payload crosses."""
    if out.device.type == "cpu":
        cls._decode_into(payload, meta, out)
    else:
        cls._decode_onto(payload, meta, out)


def expect_params(meta: Meta, *names: str) -> dict[str, int]:
    """Return ``meta.params`` after checking it has exactly ``names``."""
    if set(meta.params) != set(names):
        raise CodecError(
            f"{meta.codec} expects parameters {sorted(names)}, got {sorted(meta.params)}"
        )
    return dict(meta.params)


def check_finite(tensor: torch.Tensor, what: str, *, dtype: torch.dtype | None = None) -> None:
    """Raise CodecError if ``tensor`` holds NaN or Inf, or, given ``dtype``, a value that casting
    to ``dtype`` turns into Inf.

    One read pass with no temporary: min and max propagate NaN, and are finite iff every value is;
    a cast is monotonic, so they alone say whether every value fits ``dtype``.
    """
    if tensor.numel():
        bounds = torch.stack(torch.aminmax(tensor.reshape(-1))).tolist()  # one read back
        if not all(math.isfinite(bound) for bound in bounds):
            raise NonFiniteError(f"{what} contains NaN or Inf")
        # The bounds are exact in float64 (they came from a narrower float).
        if dtype is not None and not fits(torch.tensor(bounds, dtype=torch.float64), dtype):
            raise NonFiniteError(f"{what} overflows {dtype_name(dtype)}")


def fits(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every one of ``values`` stays finite once cast to ``dtype``."""
    return bool(values.to(dtype).isfinite().all())
