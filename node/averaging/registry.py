"""The rounds a node is in, by (round, group id), and the streams that arrive before their round.

A member's stream (or check message) may reach this node a little before it has started the
same round: members start at slightly different times. It waits up to ``join_timeout_seconds``
for the round to appear before it is refused with UNKNOWN_ROUND. Streams are signed, but keys
cost nothing: a stranger's flood of streams for rounds that never come once held every waiting
slot, and an honest member arriving before its owner started the round was refused and its part
lost. So the members matchmaking counts for a round (:meth:`Rounds.expect`) each have slots of
their own (:data:`MAX_EARLY_STREAMS_PER_MEMBER`), and any other key waits in a small shared pool
(:data:`MAX_EARLY_STREAMS`) or is refused OVERLOADED. Check messages wait the same way in slots
of their own (:data:`MAX_EARLY_CHECKS_PER_MEMBER`, :data:`MAX_EARLY_CHECKS`): a member checks
after this node served its part, so only a node that owns no part sees early ones from honest
members, and a stranger's flood of them must not take the slots honest streams need.

A stream for a round this node will not run is refused at once: one whose number it runs now in
another group (the peers' matchmakings cut different sets), or one it is past (it averaged that
round's number, or started a later one). Asked (the Peer service's GetInfo naming a round,
``quiet.py``), the node says it has left such a round, as it says of one it finished or gave up
on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.reducer import PartReducer
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

__all__ = ["ActiveRound", "Registry"]

#: Rounds whose key is remembered after they end, so late streams are refused at once.
FINISHED_MEMORY = 256
#: Streams, and check messages, that may wait at once for a round this node has not started:
#: from each member matchmaking expects in that round (one stream per owner, a few retried; the
#: checks of one round), and from any other key, all together.
MAX_EARLY_STREAMS_PER_MEMBER = 2
MAX_EARLY_CHECKS_PER_MEMBER = 8
MAX_EARLY_STREAMS = 16
MAX_EARLY_CHECKS = 16
#: Rounds whose expected members are kept: a node's rounds go forward, and a stream for a round
#: it has finished is refused at once.
EXPECTED_ROUNDS = 2

Key = tuple[int, bytes]


@dataclass(slots=True)
class ActiveRound:
    group: Group
    me: int
    reducer: PartReducer | None
    #: The policy's state of the round (its check messages, in open runs).
    state: object = None

    def member(self, peer_id: str) -> int:
        """``peer_id``'s index in the round's group; NOT_A_MEMBER if it has none."""
        try:
            return self.group.index(peer_id)
        except KeyError:
            raise ProtocolViolation(
                ResultCode.NOT_A_MEMBER, f"{peer_id} is not in group of round {self.group.round}"
            ) from None


class Registry:
    """This node's rounds in progress and lately finished (module docstring)."""

    def __init__(self, join_timeout_seconds: float) -> None:
        self._join_timeout_seconds = join_timeout_seconds
        self._rounds: dict[Key, ActiveRound] = {}
        self._finished: dict[Key, None] = {}
        #: The highest round number this node has started, and the highest one it averaged
        #: (its replica moved past it): it runs no round below the one, nor at the other.
        self._started = self._averaged = -1
        self._changed = asyncio.Condition()
        #: Streams and check messages waiting for their rounds to start: by kind in the shared
        #: pool, by (kind, round, sender) in the expected members' slots.
        self._early: Counter[str | tuple[str, int, str]] = Counter()
        #: The members matchmaking expects in the latest rounds (:meth:`expect`).
        self._expected: dict[int, frozenset[str]] = {}

    def known(self, key: Key) -> bool:
        """Whether round ``key`` runs here or ran lately."""
        return key in self._rounds or key in self._finished

    async def add(self, key: Key, active: ActiveRound) -> None:
        async with self._changed:
            self._rounds[key] = active
            self._started = max(self._started, key[0])
            self._changed.notify_all()

    def averaged(self, round_: int) -> None:
        """This node averaged a round of number ``round_`` (its replica moves past it)."""
        self._averaged = max(self._averaged, round_)

    def left(self, key: Key) -> bool:
        """Whether this node has left round ``key`` (finished it, or given up on it), runs that
        round's number in another group (its matchmaking cut another set), or is past that
        number (it averaged a round of it, or started a later one): in each case it sends
        nothing more in ``key``. A round it may still start, it has not left."""
        past = key[0] <= self._averaged or key[0] < self._started
        return past or key in self._finished or self._elsewhere(key)

    def _refuse_if_left(self, key: Key) -> None:
        """Refuse a stream for ``key`` at once if this node will not run it (:meth:`left`): the
        peers' matchmakings cut different sets, or this node is past that round. (A round it
        ran lingers for the readers of its results: that one is served.)"""
        if key in self._rounds or not self.left(key):
            return
        if key in self._finished:
            why = f"round {key[0]} has ended here"
        elif self._elsewhere(key):
            why = f"this node is in round {key[0]} with another group than {key[1].hex()[:12]}"
        else:
            why = f"this node is past round {key[0]}"
        raise ProtocolViolation(ResultCode.UNKNOWN_ROUND, why)

    def _elsewhere(self, key: Key) -> bool:
        """This node runs round ``key[0]`` now, in another group than ``key[1]``: it will not
        run ``key`` (a new group of the same round comes only from a new matchmaking, which
        would not cut peers that are busy in ``key``)."""
        return any(
            r == key[0] and g != key[1] and (r, g) not in self._finished for r, g in self._rounds
        )

    def finish(self, key: Key) -> None:
        """``key`` has ended: streams for it are refused from now on (it lingers until
        :meth:`drop` for the readers of its results)."""
        self._finished[key] = None
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.pop(next(iter(self._finished)))

    def drop(self, key: Key) -> ActiveRound | None:
        return self._rounds.pop(key, None)

    def drain(self) -> Iterator[ActiveRound]:
        """Every round still here, forgotten as it is handed out (at the node's stop)."""
        while self._rounds:
            _, active = self._rounds.popitem()
            yield active

    def expect(self, round_: int, peer_ids: Collection[str]) -> None:
        """``peer_ids`` may stream to this node in ``round_`` before it starts the round: the
        members its matchmaking counts (``matchmaking.py``). Each gets early slots of its own;
        forgotten once newer rounds are expected."""
        self._expected[round_] = frozenset(peer_ids)
        for old in sorted(self._expected)[:-EXPECTED_ROUNDS]:
            del self._expected[old]

    async def wait(self, key: Key, sender: str, *, checks: bool = False) -> ActiveRound:
        """The round ``key``, waiting for it to start if need be (``checks``: for a check
        message, in the check messages' slots): in ``sender``'s own slots if it is an expected
        member of the round, or else in the shared pool."""
        self._refuse_if_left(key)
        if key not in self._rounds:
            kind = "checks" if checks else "streams"
            own = MAX_EARLY_CHECKS_PER_MEMBER if checks else MAX_EARLY_STREAMS_PER_MEMBER
            shared = MAX_EARLY_CHECKS if checks else MAX_EARLY_STREAMS
            slot: str | tuple[str, int, str] = kind
            if sender in self._expected.get(key[0], ()) and self._early[kind, key[0], sender] < own:
                slot = (kind, key[0], sender)
            elif self._early[kind] >= shared:
                raise ProtocolViolation(
                    ResultCode.OVERLOADED, f"too many {kind} are waiting for rounds to start"
                )
            self._early[slot] += 1
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._join_timeout_seconds), self._changed:
                        # ... or until this node starts that round's number in another
                        # group, or a later round.
                        await self._changed.wait_for(lambda: key in self._rounds or self.left(key))
            finally:
                self._early[slot] -= 1
                if not self._early[slot]:
                    del self._early[slot]
            self._refuse_if_left(key)
        active = self._rounds.get(key)
        if active is None:
            raise ProtocolViolation(
                ResultCode.UNKNOWN_ROUND,
                f"no round {key[0]} with group {key[1].hex()[:12]} here "
                f"(waited {self._join_timeout_seconds:g} s)",
            )
        return active
