"""A round's peers that go quiet: a member's wait for an owner's next averaged chunk, and an
owner's for its members' chunks.

A crashed owner's connections reset, and the member's read fails at once. A frozen one (SIGSTOP,
a laptop gone to sleep, a link that drops every packet) neither answers nor resets: the read
would wait out the whole reducer timeout. So an owner quiet for :data:`QUIET_SECONDS` is asked
whether it is there (the plan's ``alive``: in a node, a signed GetInfo under its own deadline),
again each time it stays quiet that long after an answer, and at once after a question it left
unanswered; :data:`UNANSWERED_PROBES` unanswered in a row and it is gone (:class:`Unanswered`).
An owner that answers is waited for, up to the timeout: it may be waiting for a slow member.

An owner asks the same of a member that holds up its part (:func:`watch_senders`): one that
owns no part (bandwidth 0: a relayed peer, in most swarms) is asked by nobody else, and its
stream's silence would end only at the sender timeout. The question names the round, and a
member that answers it has left the round (finished it, or given up on it: it sends nothing
more) is dropped at once. That is how a node resumed after a freeze learns that the others went
on without it: their streams to its part reached it only with their reset, which gRPC does not
hand on, and they still answer "there" (docs/benchmarks.md, "Crashes").
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc

from swarmgrad.node.averaging.group import Member
from swarmgrad.node.averaging.plan import Alive
from swarmgrad.node.averaging.reducer import PartReducer
from swarmgrad.node.kinds import Presence
from swarmgrad.protocol.errors import PeerUnavailable

#: An owner whose next averaged chunk has not come for this long is asked whether it is there;
#: this many unanswered questions in a row and it is gone.
QUIET_SECONDS = 2.0
UNANSWERED_PROBES = 2
#: How often an owner looks for members holding up its part.
WATCH_SECONDS = 0.25


class Unanswered(PeerUnavailable):
    """The owner went quiet and answered none of the questions whether it is there."""


async def next_from_owner(
    call: grpc.aio.StreamStreamCall[Any, Any],
    owner: Member,
    *,
    timeout_seconds: float,
    alive: Alive | None,
    round_key: tuple[int, bytes],
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
            if left <= 0:
                raise TimeoutError
            # After an unanswered question (it took the question's whole deadline), ask again
            # at once; before the first, and after an answer, wait a quiet while.
            quiet = left if alive is None else min(left, 0.0 if unanswered else QUIET_SECONDS)
            done, _ = await asyncio.wait({read}, timeout=quiet)
            if done:
                return read.result()
            if quiet >= left:  # the wait ran to the timeout
                raise TimeoutError
            assert alive is not None
            # An owner that left the round still serves its results to slow readers: there.
            there = await alive(owner.peer_id, owner.endpoint, round_key) is not Presence.GONE
            unanswered = 0 if there else unanswered + 1
            if read.done():  # it answered on the stream meanwhile
                return read.result()
            if unanswered >= UNANSWERED_PROBES:
                raise Unanswered(_gone(owner.peer_id, unanswered))
    finally:
        read.cancel()


async def watch_senders(reducer: PartReducer, alive: Alive) -> None:
    """The owner's side: a member that holds up ``reducer``'s part (its next chunk not in) and
    was not heard from for :data:`QUIET_SECONDS` is asked whether it is there, as a member asks
    a quiet owner; :data:`UNANSWERED_PROBES` unanswered in a row and it is dropped, and at once
    if it answers that it has left the round. Runs until the part is done or the round cancels
    it."""
    loop = asyncio.get_running_loop()
    group = reducer.group
    round_key = (group.round, group.group_id)
    unanswered: Counter[int] = Counter()
    answered_at: dict[int, float] = {}
    asked: dict[int, tuple[asyncio.Future[Presence], float]] = {}  # the question, heard then
    try:
        while not reducer.done:
            now = loop.time()
            for member in reducer.holding_up():
                since = max(reducer.heard[member], answered_at.get(member, 0.0))
                if member in asked or (not unanswered[member] and now - since < QUIET_SECONDS):
                    continue
                peer = group.members[member]
                question = asyncio.ensure_future(alive(peer.peer_id, peer.endpoint, round_key))
                asked[member] = (question, reducer.heard[member])
            for member, (answer, heard) in list(asked.items()):
                if not answer.done():
                    continue
                del asked[member]
                said = (
                    answer.result()
                    if not answer.cancelled() and answer.exception() is None
                    else Presence.GONE
                )
                peer_id = group.members[member].peer_id
                if said is Presence.LEFT and reducer.heard[member] == heard:
                    reducer.drop(member, f"{peer_id} has left the round")
                elif said is Presence.THERE or reducer.heard[member] != heard:
                    unanswered[member] = 0
                    answered_at[member] = loop.time()
                else:
                    unanswered[member] += 1
                    if unanswered[member] >= UNANSWERED_PROBES:
                        reducer.drop(member, _gone(peer_id, unanswered[member]))
            await asyncio.sleep(WATCH_SECONDS)
    finally:
        for pending, _ in asked.values():
            pending.cancel()


def _gone(peer_id: str, unanswered: int) -> str:
    return f"{peer_id} went quiet and answered none of {unanswered} liveness probes"
