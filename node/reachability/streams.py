"""Byte streams a relay or a punched link carries: spliced both ways, closed quietly."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

_COPY_BYTES = 256 * 1024


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: Counter[str], key: str
) -> None:
    try:
        while data := await reader.read(_COPY_BYTES):
            counter[key] += len(data)
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
) -> None:
    """Copy bytes both ways until both directions end (or one side breaks); then close both."""
    try:
        await asyncio.gather(_pipe(a[0], b[1], counter, "in"), _pipe(b[0], a[1], counter, "out"))
    finally:
        for writer in (a[1], b[1]):
            writer.close()
        for writer in (a[1], b[1]):
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


def close_quietly(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(RuntimeError):
        writer.close()
