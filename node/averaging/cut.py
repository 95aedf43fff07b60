"""Which of a round's candidates a node cuts into groups, and until when waiting for more
matters: the candidates of its **wave** (``grouping.waves``: records by when they were signed,
for rounds every ``inner_steps`` steps) or of its **slot** (``slots.py``: rounds at the slot
boundaries of the DHT clock). Both put a record where every peer that reads it puts it, from
its signed time alone, so that peers that stop waiting at different moments still cut the same
groups (``matchmaking.py``)."""

from __future__ import annotations

import logging
from collections import deque

from swarmgrad.node.averaging.grouping import waves
from swarmgrad.node.averaging.slots import in_slot, slot_cut, slot_of
from swarmgrad.node.discovery.records import ReadyRecord

log = logging.getLogger(__name__)

#: Matchmaking's settle time (``Settle``) is this many times the longest of this node's last few
#: announces (how long a readiness record takes to land in the DHT from here), within
#: ``MIN_SETTLE_SECONDS`` and the matchmaker's ``settle_seconds``.
SETTLE_PER_STORE = 3.0
MIN_SETTLE_SECONDS = 0.1
SETTLE_HISTORY = 4

#: A round's waves are this much shorter than its matchmaking: a record signed just before its
#: wave closes still reaches the DHT, and the first peer's last read.
WAVE_MARGIN_SECONDS = 2.0


class Cut:
    """``me``'s cut of a round: by waves of a little under ``timeout_seconds`` (the
    matchmaking timeout), or by slots of ``slot_seconds`` if that is set."""

    def __init__(self, me: str, *, timeout_seconds: float, slot_seconds: float = 0.0) -> None:
        self.me = me
        self.timeout_seconds = timeout_seconds
        self.slot_seconds = slot_seconds

    @property
    def wave_seconds(self) -> float:
        """How long after its first record a round's wave closes (``grouping.waves``)."""
        return max(self.timeout_seconds - WAVE_MARGIN_SECONDS, self.timeout_seconds / 2)

    def slot(self, round_: int, issued_at: float) -> int | None:
        """The slot ``me``'s readiness record signed at ``issued_at`` is in (0 without slots),
        or None if it is past its grace: then it posts none and joins no group."""
        if not self.slot_seconds:
            return 0
        slot = slot_of(issued_at, self.slot_seconds)
        if in_slot(issued_at, slot, self.slot_seconds):
            return slot
        log.info(
            "round %d: ready %.2f s after the slot's boundary, past its grace: "
            "trains on to the next",
            round_, issued_at - slot * self.slot_seconds,
        )  # fmt: skip
        return None

    def cut_at(self, slot: int) -> float:
        """When (DHT time) the records of ``slot`` have all been signed; without slots,
        never (waves close by themselves)."""
        if not self.slot_seconds:
            return -float("inf")
        return slot_cut(slot, self.slot_seconds)

    def over(self, in_bucket: dict[str, ReadyRecord], slot: int) -> float:
        """When waiting stops mattering (DHT time): a record signed after ``me``'s wave (slot)
        closed is in the next one, and one signed before has had its margin to be read.
        ``in_bucket``: the candidates of ``me``'s bucket, by peer id."""
        if self.slot_seconds:
            return self.cut_at(slot)
        if self.me not in in_bucket:
            return float("inf")
        wave = self._wave_of(in_bucket)
        return min(in_bucket[p].issued_at for p in wave) + self.timeout_seconds

    def mine(self, round_: int, by_id: dict[str, ReadyRecord], slot: int) -> dict[str, ReadyRecord]:
        """The candidates of ``me``'s wave, or of its slot (all of them if its own record is
        not among them: it joins no group anyway)."""
        if self.slot_seconds:
            mine = [p for p, r in by_id.items() if in_slot(r.issued_at, slot, self.slot_seconds)]
        else:
            mine = self._wave_of(by_id)
        if len(mine) < len(by_id):
            log.info(
                "round %d: %d ready peers are in another %s",
                round_, len(by_id) - len(mine), "slot" if self.slot_seconds else "wave",
            )  # fmt: skip
        return {p: by_id[p] for p in mine}

    def _wave_of(self, by_id: dict[str, ReadyRecord]) -> list[str]:
        """The peers of ``me``'s wave among ``by_id`` (all of them if ``me`` is not there)."""
        issued = {p: r.issued_at for p, r in by_id.items()}
        return next((w for w in waves(issued, self.wave_seconds) if self.me in w), list(by_id))


class Settle:
    """How long matchmaking waits, once it stops polling, before its last read: time for
    records signed before then to land in the DHT. A record signed before the first peer stopped
    and stored by the time the last one reads is cut alike by both; the wait only has to outlast
    a store. Waiting longer does not narrow the gap between two peers' last reads (a record
    signed inside it splits them however long both wait), so the wait follows what a store
    costs here: ``SETTLE_PER_STORE`` times the longest of the last ``SETTLE_HISTORY`` announces,
    at least ``MIN_SETTLE_SECONDS``, at most ``longest`` (before any announce, ``longest``).
    On loopback a store takes milliseconds and a round waits 0.1 s instead of 0.5 s; a DHT whose
    stores take longer than ``longest`` / ``SETTLE_PER_STORE`` gets the whole ``longest``."""

    def __init__(self, longest: float) -> None:
        self.longest = longest
        self._stores: deque[float] = deque(maxlen=SETTLE_HISTORY)

    def stored(self, seconds: float) -> None:
        """An announce of this node took ``seconds``."""
        self._stores.append(seconds)

    @property
    def seconds(self) -> float:
        return settle_time(max(self._stores), self.longest) if self._stores else self.longest


def settle_time(store_seconds: float, longest: float) -> float:
    """The settle time after stores of ``store_seconds`` (``Settle``), at most ``longest``."""
    return min(longest, max(MIN_SETTLE_SECONDS, SETTLE_PER_STORE * store_seconds))
