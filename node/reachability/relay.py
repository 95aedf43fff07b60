"""Relays: a reachable peer carries TCP connections for one that nobody can dial (behind a NAT).

The unreachable node (the *client*) keeps one outbound *control* connection open to a relay
peer. The relay listens on a port of its own for that client (its *relayed endpoint*, which the
client announces as its gRPC endpoint). When someone connects there, the relay sends ``open``
with a fresh random id over the control connection; the client opens a *data* connection to the
relay carrying that id (possession of the id is the proof) and one to its own gRPC server, and
both ends copy bytes until either side closes. gRPC runs over that unchanged: HTTP/2 end to end.

Frames on the relay port are a 4-byte big-endian length and a JSON object (at most 4 KiB):

    relay  -> any:    {"relay": "swarmgrad/1", "nonce": hex}
    client -> relay:  {"hello": peer_id, "key": hex, "sig": hex(Ed25519(nonce + peer_id))}
                      or {"data": id}
    relay  -> client: {"ready": port} | {"open": id, "from": host} | {"ping": 0}
                      | {"error": why} (refused at hello, or evicted later; then it hangs up)
    client -> relay:  {"ping": 0}

``from`` is the address the dialer connected from, as the relay saw it: the client's gRPC server
sees every relayed connection come from the client itself, and ``Peer.Punch`` must know who really
called (it punches only towards its caller). :attr:`RelayClient.origins` maps the local end of each
spliced connection to that address while the connection lasts.

Both sides ping every ``ping_seconds`` and give up on silence after ``silence_seconds``, so a
client learns within seconds that its relay died. Load is bounded (clients per relay, pending and
open connections per client and per dialer address) and counted.

A relay is not a forwarder for anyone. It serves only the peers its node admits (``admit``, asked
at hello; a node's is a :class:`RelayAdmission`: a live record in its run and, in a private run,
a place on the allowlist). Each client's spliced bytes, both ways together, spend a token bucket (a
sustained rate and a burst, :class:`RelayLimits`): past it the relay stops reading that client's
connections until the budget refills, and TCP pushes back on the sender, so what a client moves
and the relay's CPU for it are bounded. A client that wanted more than its rate for
``max_throttled_seconds`` in a row, or carried nothing (no byte, no new connection) for
``idle_seconds``, is evicted; when every slot is taken, a newcomer first evicts a client over its
rate now or idle for ``idle_under_pressure_seconds``, and is refused only if there is none. A
refused or evicted client is told why (``{"error": why}``) and the relay counts it by reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarmgrad.protocol.errors import PeerUnavailable

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 4096
PROTOCOL = "swarmgrad/1"
MIB = 1 << 20

#: Whether the relay serves a peer, asked at its hello: None if so, else why not (told to the
#: peer and counted, so a short fixed phrase).
Admit = Callable[[str], Awaitable[str | None]]


class RelayError(PeerUnavailable):
    """A relay refused this client, broke the protocol, or went silent."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayLimits:
    max_clients: int = 8
    max_connections_per_client: int = 32  # pending + open
    #: Of those, from any one dialer address: one host cannot hold every slot of a client.
    max_connections_per_dialer: int = 8
    handshake_timeout_seconds: float = 5.0
    #: How long a dialer waits for the client to attach its side before it is hung up on.
    attach_timeout_seconds: float = 10.0
    ping_seconds: float = 2.0
    silence_seconds: float = 6.0
    #: Each client's byte budget, both ways together: a token bucket refilled at this rate that
    #: holds at most ``burst_bytes``. Only connections *to* a relayed node cross its relay (it
    #: dials out directly): the parts of the vector it owns, and the state it serves. A round
    #: moves ~2 x (members - 1) x its part through it (int8): the demo model (0.67 M values) at
    #: most ~1.4 MB; a 125 M model in a group of 8, ~25 MB as the one relayed member (a relayed
    #: member owns a tenth of a direct one's share), ~220 MB were all 8 relayed; a 1 B model
    #: ~200 MB as the one relayed member. The burst carries each of those without a pause; the
    #: rate (134 Mbit/s, above most home uplinks, which limit first) then carries 1 GB a minute,
    #: and costs the relay ~4% of a core per client flat out (benchmarks/relay_abuse.py). A
    #: state download from a relayed donor is slowed to the rate (downloads use several donors).
    rate_bytes_per_second: float = 16 * MIB
    burst_bytes: int = 256 * MIB
    #: A client that wanted more than its rate this long in a row is evicted: its slot is freed.
    max_throttled_seconds: float = 120.0
    #: A client with no byte spliced and no new connection this long is evicted (honest ones
    #: see a round's connections every few minutes, and take another relay when evicted).
    idle_seconds: float = 900.0
    #: With every slot taken, a newcomer evicts a client idle this long (or over its rate now).
    idle_under_pressure_seconds: float = 30.0

    def __post_init__(self) -> None:
        if (
            self.max_clients < 0
            or self.max_connections_per_client < 1
            or self.max_connections_per_dialer < 1
        ):
            raise ValueError("relay limits must be positive")
        if not 0 < self.ping_seconds < self.silence_seconds:
            raise ValueError("ping_seconds must be positive and below silence_seconds")
        if not (self.rate_bytes_per_second > 0 and self.burst_bytes > 0):
            raise ValueError("a relay client's rate and burst must be positive")
        if not (
            0 < self.idle_under_pressure_seconds <= self.idle_seconds
            and self.max_throttled_seconds > 0
        ):
            raise ValueError(
                "idle_under_pressure_seconds must be positive and at most idle_seconds, and "
                "max_throttled_seconds positive"
            )


def frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


async def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(frame(message))
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, timeout_seconds: float) -> dict[str, Any]:
    """One frame, within the deadline; RelayError for anything malformed or oversized."""
    try:
        async with asyncio.timeout(timeout_seconds):
            (size,) = struct.unpack(">I", await reader.readexactly(4))
            if size > MAX_FRAME_BYTES:
                raise RelayError(f"a frame of {size} bytes (the limit is {MAX_FRAME_BYTES})")
            body = await reader.readexactly(size)
    except TimeoutError:
        raise RelayError(f"nothing heard in {timeout_seconds:g} s") from None
    except (asyncio.IncompleteReadError, ConnectionError) as error:
        raise RelayError(f"connection closed: {error}") from None
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RelayError("a frame that is not JSON") from None
    except RecursionError:  # 4 KiB of "[[[[..." is deeper than the parser's stack allows
        raise RelayError("a frame nested too deeply") from None
    if not isinstance(message, dict) or len(message) > 4:
        raise RelayError("a frame that is not a small JSON object")
    return message


# -- the relay ----------------------------------------------------------------------------------
