"""A member's wait for an owner's next averaged chunk, and what it does when the owner goes quiet.

A crashed owner's connections reset, and the member's read fails at once. A frozen one (SIGSTOP,
a laptop gone to sleep, a link that drops every packet) neither answers nor resets: the read
would wait out the whole reducer timeout. So an owner quiet for :data:`QUIET_SECONDS` is asked
whether it is there (the plan's ``alive``: in a node, a signed GetInfo under its own deadline),
again each time it stays quiet that long after an answer, and at once after a question it left
unanswered; :data:`UNANSWERED_PROBES` unanswered in a row and it is gone (:class:`Unanswered`).
An owner that answers is waited for, up to the timeout: it may be waiting for a slow member.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from swarmgrad.node.averaging.group import Member
from swarmgrad.node.averaging.plan import Alive
from swarmgrad.protocol.errors import PeerUnavailable

#: An owner whose next averaged chunk has not come for this long is asked whether it is there;
#: this many unanswered questions in a row and it is gone.
QUIET_SECONDS = 2.0
UNANSWERED_PROBES = 2


class Unanswered(PeerUnavailable):
    """The owner went quiet and answered none of the questions whether it is there."""


async def next_from_owner(
    call: grpc.aio.StreamStreamCall[Any, Any],
    owner: Member,
    *,
    timeout_seconds: float,
    alive: Alive | None,
) -> Any:
    """``owner``'s next message on ``call``, within ``timeout_seconds`` (TimeoutError), or
    :class:`Unanswered` once it went quiet and did not answer (module docstring)."""
    loop = asyncio.get_running_loop()
    limit = loop.time() + timeout_seconds
    read = asyncio.ensure_future(call.read())
    unanswered = 0
    try:
        while True:
            left = limit - loop.time()
            # After an unanswered question (it took the question's whole deadline), ask again
            # at once; before the first, and after an answer, wait a quiet while.
            quiet = left if alive is None else min(left, 0.0 if unanswered else QUIET_SECONDS)
            done, _ = await asyncio.wait({read}, timeout=max(0.0, quiet))
            if done:
                return read.result()
            if loop.time() >= limit:
                raise TimeoutError
            assert alive is not None
            unanswered = 0 if await alive(owner.peer_id, owner.endpoint) else unanswered + 1
            if read.done():  # it answered on the stream meanwhile
                return read.result()
            if unanswered >= UNANSWERED_PROBES:
                raise Unanswered(
                    f"{owner.peer_id} went quiet and answered none of {unanswered} liveness probes"
                )
    finally:
        read.cancel()
