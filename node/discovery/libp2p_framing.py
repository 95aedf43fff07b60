"""Messages on the libp2p sidecar's streams: a 4-byte length, then a JSON object, bounded.

Pure Python on libp2p's stream interface (``read``/``write``); imported by the sidecar's DHT
(``libp2p_kademlia.py``) and by tests that speak the directory protocol to it.
"""

from __future__ import annotations

import json
from typing import Any

from libp2p.abc import INetStream

#: A message between peers: a get's answer is one key's entries, which the directory keeps
#: under ``budget.MAX_BYTES_PER_KEY`` (base64 and JSON make them ~4/3 as large).
MAX_MESSAGE_BYTES = 2 << 20


class Oversize(ValueError):
    """A message over ``MAX_MESSAGE_BYTES``: refused unread."""


async def read_message(stream: INetStream) -> dict[str, Any]:
    header = await _read_exactly(stream, 4)
    size = int.from_bytes(header, "big")
    if size > MAX_MESSAGE_BYTES:
        raise Oversize(f"a message of {size} bytes")
    message = json.loads(await _read_exactly(stream, size))
    if not isinstance(message, dict):
        raise ValueError("a message that is not an object")
    return message


async def write_message(stream: INetStream, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    await stream.write(len(data).to_bytes(4, "big") + data)


async def _read_exactly(stream: INetStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await stream.read(size - len(data))
        if not chunk:
            raise EOFError("the stream ended early")
        data += chunk
    return data
