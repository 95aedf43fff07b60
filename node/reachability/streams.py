"""Byte streams a relay or a punched link carries: spliced both ways, closed quietly."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable

#: Called with each chunk's size before it is passed on; may wait (a relay's byte budget).
Meter = Callable[[int], Awaitable[None]]

_COPY_BYTES = 256 * 1024


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    counter: Counter[str],
    key: str,
    meter: Meter | None,
) -> None:
    try:
        while data := await reader.read(_COPY_BYTES):
            counter[key] += len(data)
            if meter is not None:
                await meter(len(data))
            writer.write(data)
            await writer.drain()
    except OSError:  # reset, or not connected any more: this direction is over
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    counter: Counter[str],
    meter: Meter | None = None,
) -> None:
    """Copy bytes both ways until both directions end (or one side breaks); then close both.
    ``meter`` hears every chunk, both ways, before it is written on."""
    try:
        await asyncio.gather(
            _pipe(a[0], b[1], counter, "in", meter), _pipe(b[0], a[1], counter, "out", meter)
        )
    finally:
        for writer in (a[1], b[1]):
            writer.close()
        for writer in (a[1], b[1]):
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


def close_quietly(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(RuntimeError):
        writer.close()
