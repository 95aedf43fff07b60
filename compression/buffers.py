"""Where a codec's bytes and tensors live: the dtypes codecs take, flat views, raw bytes, and
the reusable host and device buffers encoders and decoders build payloads in.

Pure torch, no codec logic: ``base.py`` (the codec contract and ``decode``) and every codec
import these.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from types import MappingProxyType

import torch

#: dtypes a codec accepts as input and restores on decode, by their wire name.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
    }
)
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype}; codecs take {', '.join(_DTYPE_NAMES.values())}"
        ) from None


#: A payload as a decoder reads it: host bytes, or (``device_decode`` codecs) a uint8 tensor
#: on the device that decodes it.
Wire = bytes | memoryview | torch.Tensor


def cpu_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as 1-D on the CPU (for the codecs that compute on the host)."""
    return device_flat(tensor).cpu()


def device_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as 1-D where it lives (a view when it can be), after checking its dtype."""
    dtype_name(tensor.dtype)
    return tensor.detach().reshape(-1)


def flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a contiguous 1-D float32 CPU view or copy (no copy for contiguous fp32)."""
    flat = cpu_flat(tensor)
    if flat.dtype != torch.float32:
        flat = flat.float()
    return flat.contiguous()


def to_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (any dtype, bf16 included; a GPU tensor's through a
    pinned host buffer)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    flat = flat.view(torch.uint8)
    if flat.device.type != "cpu":
        host = _pinned(flat.numel())
        host.copy_(flat)
        flat = host
    return flat.numpy().tobytes()


def to_device(data: bytes | memoryview, device: torch.device) -> torch.Tensor:
    """``data`` as a uint8 tensor on ``device``.

    Page-locked data crosses in one copy. Other data (bytes received from the wire) is staged
    through two page-locked buffers in turn: the host copies one part into a buffer while the
    part before it crosses PCIe from the other.
    """
    out = torch.empty(len(data), dtype=torch.uint8, device=device)
    if not len(data):
        return out
    source = from_bytes(data, torch.uint8)
    if source.is_pinned():
        out.copy_(source)
        return out
    stream = torch.cuda.current_stream(device)
    slots = _staging()
    # Parts of equal size (a 17 MB payload in two halves, not 16 MiB and a remnant), so the
    # second part's host copy overlaps as much of the first part's crossing as it can.
    parts = -(-len(data) // STAGE_BYTES)
    size = -(-len(data) // parts)
    for i, start in enumerate(range(0, len(data), size)):
        stop = min(start + size, len(data))
        buffer, done = slots[i % 2]
        done.synchronize()  # the copy out of this buffer, two parts ago, is over
        part = buffer[: stop - start]
        part.copy_(source[start:stop])
        out[start:stop].copy_(part, non_blocking=True)
        done.record(stream)
    return out


#: Most bytes per part when host data is staged to a GPU. On an H100 (2026-11-26), parts of 16
#: MiB took 17 / 34 / 64 MB across in 0.75 / 1.08 / 1.79 ms, one part 0.76 / 1.26 / 2.11 ms; parts
#: of 4 MiB were slower than one for 64 MB (2.42 ms in another run). A pool of host threads
#: copying parts of 1-8 MiB with memmove took 1.3-1.7 ms for 17 MB (2026-11-27): not faster.
#: Later that day 32 MiB took 1.17 ms in two parts and 1.18 ms through one buffer, no overlap:
#: a part crosses slower while the host copies the next (docs/benchmarks.md).
STAGE_BYTES = 16 << 20


def _staging() -> list[tuple[torch.Tensor, torch.cuda.Event]]:
    """The calling thread's two page-locked staging buffers, each with the event recorded after
    the copy out of it was queued."""
    slots: list[tuple[torch.Tensor, torch.cuda.Event]] | None = getattr(_scratch, "staging", None)
    if slots is None:
        slots = [
            (torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())  # type: ignore[no-untyped-call]
            for _ in range(2)
        ]
        _scratch.staging = slots
    return slots


def from_bytes(data: Wire, dtype: torch.dtype, offset: int = 0, count: int = -1) -> torch.Tensor:
    """A read-only 1-D view of ``data`` (bytes, or a uint8 tensor) as ``dtype``; callers must not
    write into it."""
    if isinstance(data, torch.Tensor):
        size = dtype.itemsize
        stop = data.numel() if count < 0 else offset + count * size
        return data[offset:stop].view(dtype)
    if count == 0 or (count < 0 and len(data) == offset):
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable; nothing writes into these views.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype, offset=offset, count=count)


_scratch = threading.local()


def scratch_bytes(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """A reusable uint8 buffer of at least ``nbytes``, private to the calling thread.

    Encoders build their payload here and copy it once into the returned ``bytes``; reusing the
    buffer spares the page faults of a fresh large allocation on every call (about as costly as
    the encoding itself). Its contents are garbage between uses; it holds the largest payload the
    thread has built. On a GPU the caching allocator already reuses memory: a fresh tensor.
    """
    if device is not None and device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buffer: torch.Tensor | None = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        _scratch.buffer = buffer
    return buffer[:nbytes]


def _pinned(nbytes: int) -> torch.Tensor:
    """A reusable page-locked host buffer of ``nbytes``, private to the calling thread (copies
    between it and a GPU run at full PCIe speed)."""
    buffer: torch.Tensor | None = getattr(_scratch, "pinned", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        _scratch.pinned = buffer
    return buffer[:nbytes]
