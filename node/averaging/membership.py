"""Who a node believes is a live member of its run: whose readiness counts in matchmaking.

A readiness record is signed, but keys cost nothing. 310 throwaway keys once sealed a
well-formed record (an endpoint where nothing listens) under each of the next 20 round keys,
and from then on every round of the three honest nodes put them in groups with members that
never answered: 42 rounds aborted, 3 averaged. So matchmaking counts a readiness record, and
waits for a peer, only if this node has reason to believe it is a live member of the run:

- a **known member**: this node completed a round with it in the last
  :data:`MEMBER_SECONDS` (the round's result names the contributors), or (private runs) the
  run key's allowlist names it;
- a **newcomer that answered**: it has a live peer record in the run's directory, and it
  answered a signed liveness probe (``alive``: a ``GetInfo`` under its deadline, answered as
  that peer) at the endpoint it announced.

Honest nodes must agree on the candidates (groups are cut from them deterministically; peers
that see different sets compute different group ids and their round fails), so a newcomer's
answer is what counts, never the question: a probe starts as soon as matchmaking sees the
record, the newcomer counts only once its probe succeeded, and matchmaking waits a little
(:data:`NEWCOMER_WAIT_SECONDS`) for the answers of the newcomers it saw before it cuts groups.
Every honest node asks the same newcomer and hears the same answer, within milliseconds on a
LAN and a round trip or two across the internet. Answers are remembered per (peer, endpoint):
yes for :data:`ANSWERED_SECONDS`, no for :data:`SILENT_SECONDS` (a restarted peer, on a new
port, is asked afresh).

Probing is bounded, so that a flood of peer records with dead endpoints costs little: one
matchmaking asks at most :data:`MAX_PROBES_PER_ROUND` newcomers, at most
:data:`MAX_PROBES_IN_FLIGHT` questions are open at once, and none is waited for longer than
:data:`NEWCOMER_WAIT_SECONDS` (an endpoint that drops packets takes the probe's whole deadline
to fail; the answer is still remembered when it comes). The newcomers left out are neither
candidates nor waited for in that round; readiness signers are asked first, each group in the
round's shuffle, so peers that see the same records ask the same ones. A flood of N such
records thus costs each round at most about a second, for N / 64 rounds, then nothing until
its answers are forgotten; an honest newcomer hidden in it is asked within those N / 64 rounds.
Readiness records from keys with no peer record cost nothing at all.

Not covered: a key that runs a server and answers is a member like any other (what it sends is
the trust policy's business, ``node/trust/``), and one that answers some nodes and not others
can still make their candidate sets differ, and so fail their round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterable
from typing import TypeVar

from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.tasks import TaskSet

log = logging.getLogger(__name__)

#: A peer this node completed a round with is a member this long.
MEMBER_SECONDS = 600.0
#: How long a probe's answer is believed: yes, and no.
ANSWERED_SECONDS = 60.0
SILENT_SECONDS = 120.0
#: How long matchmaking waits for a newcomer's answer (its probe's own deadline is longer).
NEWCOMER_WAIT_SECONDS = 1.0
#: Newcomers one matchmaking may ask, and questions open at once (all rounds together).
MAX_PROBES_PER_ROUND = 64
MAX_PROBES_IN_FLIGHT = 64
#: Peers and answers remembered: beyond, the oldest are forgotten (keys cost nothing).
MAX_REMEMBERED = 4096

#: How long matchmaking waits for a missing peer before asking whether it is still there, and
#: how often it asks again while that peer answers but is not ready (it is still training).
PROBE_AFTER_SECONDS = 1.0
PROBE_EVERY_SECONDS = 3.0

#: Is this peer still there (its endpoint answers as it)? Must return within its own deadline.
Alive = Callable[[PeerRecord], Awaitable[bool]]
_Place = tuple[str, str]  # (peer id, endpoint)
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Membership:
    """Known members and probe answers, shared by every round of a node; ``close`` it."""

    def __init__(
        self,
        alive: Alive,
        *,
        allowed: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``alive`` asks a peer (the node's ``PeerService.alive``); ``allowed`` says whom a
        private run's allowlist names (None: an open run, nobody)."""
        self._alive, self._allowed, self.clock = alive, allowed, clock
        self._members: dict[str, float] = {}  # peer -> until
        self._answers: dict[_Place, tuple[bool, float]] = {}  # -> (answered, until)
        self._answered: dict[str, float] = {}  # peer -> until: it answered at some endpoint
        #: Questions open, and when each was asked: they outlive the matchmaking that asked,
        #: so that a slow "no" is remembered too.
        self._asking: dict[_Place, float] = {}
        self._tasks = TaskSet()
        #: Probes of newcomers by answer: "answered", "silent".
        self.probes: Counter[str] = Counter()

    def met(self, peer_ids: Iterable[str]) -> None:
        """These peers took part in a round with this node: members, for a while."""
        until = self.clock() + MEMBER_SECONDS
        for peer_id in peer_ids:
            self._members.pop(peer_id, None)  # to the end: the oldest go first
            self._members[peer_id] = until
        _forget_oldest(self._members)

    def known(self, peer_id: str) -> bool:
        until = self._members.get(peer_id)
        if until is not None and until > self.clock():
            return True
        return self._allowed is not None and self._allowed(peer_id)

    def answer(self, peer_id: str, endpoint: str) -> bool | None:
        """What ``peer_id`` answered at ``endpoint`` lately (None: not asked, or too long ago)."""
        held = self._answers.get((peer_id, endpoint))
        if held is None or held[1] <= self.clock():
            return None
        return held[0]

    def answered(self, peer_id: str) -> bool:
        """Whether ``peer_id`` answered lately, at any endpoint."""
        return self._answered.get(peer_id, 0.0) > self.clock()

    async def alive(self, record: PeerRecord) -> bool:
        """Ask ``record``'s peer now, and remember its answer."""
        answered = await self._alive(record)
        self._remember((record.peer_id, record.endpoint), answered)
        return answered

    def session(self, round_: int) -> Probes:
        """The questions of one matchmaking."""
        return Probes(self, round_)

    async def close(self) -> None:
        await self._tasks.close()

    def ask(self, record: PeerRecord, round_: int) -> bool:
        """Ask ``record``'s peer in the background, unless too many questions are open."""
        if len(self._asking) >= MAX_PROBES_IN_FLIGHT:
            return False
        place = (record.peer_id, record.endpoint)
        self._asking[place] = self.clock()
        self._tasks.spawn(self._probe(place, record, round_), f"probe-{record.peer_id[:12]}")
        return True

    def asked_at(self, peer_id: str, endpoint: str) -> float | None:
        """When the question still open to ``peer_id`` at ``endpoint`` was asked."""
        return self._asking.get((peer_id, endpoint))

    async def _probe(self, place: _Place, record: PeerRecord, round_: int) -> None:
        try:
            answered = await self._alive(record)
        except Exception:  # a bug behind ``alive``: this newcomer does not count, rounds go on
            log.exception("round %d: asking %s failed", round_, record.peer_id)
            answered = False
        finally:
            del self._asking[place]
        self._remember(place, answered)
        self.probes["answered" if answered else "silent"] += 1

    def _remember(self, place: _Place, answered: bool) -> None:
        until = self.clock() + (ANSWERED_SECONDS if answered else SILENT_SECONDS)
        self._answers.pop(place, None)
        self._answers[place] = (answered, until)
        _forget_oldest(self._answers)
        if answered:
            self._answered.pop(place[0], None)
            self._answered[place[0]] = until
            _forget_oldest(self._answered)


class Probes:
    """One matchmaking's questions to newcomers: at most :data:`MAX_PROBES_PER_ROUND`, each
    asked as soon as its record is seen and waited for at most :data:`NEWCOMER_WAIT_SECONDS`."""

    def __init__(self, membership: Membership, round_: int) -> None:
        self.membership, self.round = membership, round_
        self._asked: set[_Place] = set()

    def verdict(self, record: PeerRecord, *, exact: bool = True) -> bool | None:
        """Whether ``record``'s peer counts as a member: True (known, or it answered at this
        endpoint, or at any with ``exact`` False), False (silent, or too slow, or no question
        left for it this round), None (its answer is due soon: asked now, or under
        :data:`NEWCOMER_WAIT_SECONDS` ago)."""
        membership = self.membership
        if membership.known(record.peer_id):
            return True
        if not exact and membership.answered(record.peer_id):
            return True
        answer = membership.answer(record.peer_id, record.endpoint)
        if answer is not None:
            return answer
        place = (record.peer_id, record.endpoint)
        asked = membership.asked_at(*place)
        if asked is None:
            if len(self._asked) >= MAX_PROBES_PER_ROUND or place in self._asked:
                return False  # no question left; or asked, and the answer was forgotten
            if not membership.ask(record, self.round):
                return False  # too many open: asked on a later poll
            self._asked.add(place)
            return None
        return None if membership.clock() - asked < NEWCOMER_WAIT_SECONDS else False

    async def settle(self) -> None:
        """Wait for the answers still due (at most :data:`NEWCOMER_WAIT_SECONDS`)."""
        membership = self.membership
        while True:
            due = [
                asked + NEWCOMER_WAIT_SECONDS
                for place in self._asked
                if (asked := membership.asked_at(*place)) is not None
            ]
            now = membership.clock()
            if not due or max(due) <= now:
                return
            await asyncio.sleep(min(0.02, max(due) - now))


class Liveness:
    """Which of the peers a round waits for are gone: each missing one is asked (``alive``) once
    it has been waited for ``PROBE_AFTER_SECONDS``, again every ``PROBE_EVERY_SECONDS`` while it
    answers, in the background (the wait goes on polling meanwhile).

    Gone is said of a peer at an endpoint: one that restarts (a new process, a new port) and
    publishes a new record is asked again there, and waited for if it answers, as a peer that
    read only its new record waits for it; else the two would cut different groups."""

    def __init__(self, round_: int, alive: Alive | None) -> None:
        self._round, self._alive = round_, alive
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._asked: dict[_Place, float] = {}
        self._probes: set[asyncio.Task[None]] = set()
        #: The endpoint at which each peer that is gone did not answer.
        self._gone: dict[str, str] = {}

    def gone(self, peer_id: str, record: PeerRecord | None) -> bool:
        """Whether ``peer_id`` (its live record: ``record``) did not answer where it is."""
        endpoint = self._gone.get(peer_id)
        return endpoint is not None and (record is None or record.endpoint == endpoint)

    def check(self, missing: Collection[PeerRecord]) -> None:
        now = self._loop.time()
        if self._alive is None or now - self._started < PROBE_AFTER_SECONDS:
            return
        for record in missing:
            place = (record.peer_id, record.endpoint)
            asked = self._asked.get(place)
            if self.gone(record.peer_id, record) or (asked and now - asked < PROBE_EVERY_SECONDS):
                continue
            self._asked[place] = now
            probe = asyncio.create_task(self._probe(self._alive, record))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)

    async def _probe(self, alive: Alive, record: PeerRecord) -> None:
        if not await alive(record):
            log.info(
                "round %d: %s does not answer at %s; not waiting for it",
                self._round, record.peer_id, record.endpoint,
            )  # fmt: skip
            self._gone[record.peer_id] = record.endpoint

    def close(self) -> None:
        for probe in self._probes:
            probe.cancel()


def _forget_oldest(memory: dict[K, V]) -> None:
    """Keep ``memory`` (insertion-ordered: renewals move to the end) to :data:`MAX_REMEMBERED`."""
    while len(memory) > MAX_REMEMBERED:
        del memory[next(iter(memory))]
