"""What one DHT node holds for others: the limits per key and in all, shared by both backends.

A DHT is writable by anyone, and sealed values from throwaway keys cost nothing to make: without
a bound per key, a flood of large values under a topic makes every answer for it too large to
travel (the genuine records hidden with the flood) or fills the node's memory. Each key holds at
most :data:`MAX_ENTRIES_PER_KEY` entries and :data:`MAX_BYTES_PER_KEY` bytes, well inside what
one answer may carry (the libp2p sidecar's ``MAX_MESSAGE_BYTES`` and its line to the node,
hivemind's 4 MiB daemon messages); a node holds at most :data:`MAX_ENTRIES` and
:data:`MAX_BYTES` in all.

When a key is full, what gives way depends on what the key holds:

- **Long-lived keys** (peer records, specs, runs, allowlists, bans): the signers already in it
  keep their slots (each may replace its value with a newer one that fits) and new signers are
  refused: a flood cannot push out the records held before it.
- **Round keys** hold readiness records, which live for one matchmaking. An honest one is issued
  as its node starts matchmaking; a flood stored ahead of the round is older. Keeping the first
  comers there let 310 throwaway keys take each of the next 20 round keys before the honest
  nodes came, and matchmaking stalled. So an entry that does not fit takes the room of the
  stalest ones the key holds, if they are staler than it (:func:`freshness`: when the value
  was issued, but never later than when it arrived here, so a value dated ahead, as the 60 s
  of clock skew allow, gains nothing). A flood then has to be re-signed and re-sent faster
  than honest nodes announce to keep them out, and matchmaking does not believe its signers
  anyway (``node/averaging/membership.py``).

When the node is full, the stalest round-key entries give way the same way, to a fresher one or
to any long-lived key's entry. Pure Python (no hivemind, no libp2p): both backends' processes
import it.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass

from swarmgrad.node.discovery.envelope import Envelope, Kind, allowed_kinds

MAX_ENTRIES_PER_KEY = 4096
#: Bytes of one key's entries (:func:`entry_bytes`): ~1,500 peer records, or 78 specs of 16 KiB.
MAX_BYTES_PER_KEY = 1280 * 1024
MAX_ENTRIES = 65536
MAX_BYTES = 128 << 20
#: What an entry costs besides its subkey and value: its expiry and framing (an answer's JSON
#: object per entry is ~60 bytes, base64 aside), so that a key's entries, however small, fit
#: an answer sized for :data:`MAX_BYTES_PER_KEY`.
ENTRY_OVERHEAD_BYTES = 64

Place = tuple[Hashable, Hashable]  # (key, subkey)


class BudgetFull(ValueError):
    """An entry that would take a key, or the node, over its limits."""


def entry_bytes(subkey: str, value: bytes) -> int:
    """What an entry counts for against the limits."""
    return len(subkey.encode()) + len(value) + ENTRY_OVERHEAD_BYTES


def freshness(envelope: Envelope, now: float) -> float | None:
    """How fresh a value is, for the keys whose entries give way to fresher ones (round keys:
    readiness records and their withdrawals): its issue time, capped at ``now`` (when it
    arrives); None under every other key."""
    if Kind.READY not in allowed_kinds(envelope.key):
        return None
    return min(envelope.issued_at, now)


@dataclass(slots=True)
class _Held:
    size: int
    expires: float
    serial: int  # which add this is: heap items of a replaced entry are stale
    rank: float | None  # freshness; None: a long-lived key's entry, never evicted


# A ranked entry in a heap, stalest first; stale items (the entry replaced or gone) are skipped.
_Item = tuple[float, int, Hashable, Hashable]


class Budget:
    """The sizes and expiries of the entries one node holds, by key and subkey, with running
    totals: whether one more fits, and which stale round-key entries make room for it, in time
    independent of how much is held. Expired entries leave lazily (an expiry heap), when
    :meth:`purge` is called."""

    def __init__(self) -> None:
        self._held: dict[Hashable, dict[Hashable, _Held]] = {}
        self._key_bytes: dict[Hashable, int] = {}
        self._expiries: list[tuple[float, int, Hashable, Hashable]] = []
        #: Ranked entries, stalest first: per key, and of the whole node.
        self._ranked: dict[Hashable, list[_Item]] = {}
        self._all_ranked: list[_Item] = []
        self._serial = 0  # also a tie-breaker: keys and subkeys need not be ordered
        self.entries = 0
        self.bytes = 0

    def purge(self, now: float) -> list[Place]:
        """Forget the entries that expired by ``now``; the (key, subkey) pairs forgotten."""
        gone = []
        while self._expiries and self._expiries[0][0] <= now:
            _, serial, key, subkey = heapq.heappop(self._expiries)
            if self._current(serial, key, subkey):  # not replaced since
                self._forget(key, subkey)
                gone.append((key, subkey))
        return gone

    def make_room(
        self, key: Hashable, subkey: Hashable, size: int, *, rank: float | None = None
    ) -> list[Place]:
        """Make room for an entry of ``size`` bytes under (key, subkey), replacing the one held
        there, of freshness ``rank`` (:func:`freshness`; None for a long-lived key's entry).
        BudgetFull if it does not fit; otherwise the entries that gave way for it, forgotten
        here: the caller drops them from its storage. Call :meth:`purge` first."""
        entries = self._held.get(key, {})
        old = entries.get(subkey)
        old_size = old.size if old is not None else 0
        new = int(old is None)
        taken: list[tuple[list[_Item], _Item]] = []  # popped from a heap: victims, or put back
        victims: dict[Place, int] = {}  # and their sizes

        def key_fits() -> bool:
            freed = [s for (k, _), s in victims.items() if k == key]
            count = len(entries) + new - len(freed)
            held = self._key_bytes.get(key, 0) - old_size + size - sum(freed)
            return count <= MAX_ENTRIES_PER_KEY and held <= MAX_BYTES_PER_KEY

        def node_fits() -> bool:
            count = self.entries + new - len(victims)
            held = self.bytes - old_size + size - sum(victims.values())
            return count <= MAX_ENTRIES and held <= MAX_BYTES

        steps = ((self._ranked.get(key, []), key_fits), (self._all_ranked, node_fits))
        try:
            if rank is None and not key_fits():
                raise BudgetFull(self._why_key(entries, old))
            for heap, fits in steps:
                while not fits():
                    item = self._stalest(heap, skip=(key, subkey), chosen=victims)
                    if item is not None:
                        taken.append((heap, item))
                    if item is None or (rank is not None and item[0] >= rank):
                        raise BudgetFull(
                            self._why_key(entries, old)
                            if fits is key_fits
                            else "this peer's directory is full"
                        )
                    victims[item[2], item[3]] = self._held[item[2]][item[3]].size
        except BudgetFull:
            for heap, item in taken:  # nothing gives way after all
                heapq.heappush(heap, item)
            raise
        for victim_key, victim_subkey in victims:
            self._forget(victim_key, victim_subkey)
        return list(victims)

    def add(
        self,
        key: Hashable,
        subkey: Hashable,
        size: int,
        expires: float,
        *,
        rank: float | None = None,
    ) -> None:
        """Count an entry stored under (key, subkey) until ``expires`` (replacing any there),
        of freshness ``rank`` (as given to :meth:`make_room`)."""
        if subkey in self._held.get(key, {}):
            self._forget(key, subkey)
        self._serial += 1
        self._held.setdefault(key, {})[subkey] = _Held(size, expires, self._serial, rank)
        self._key_bytes[key] = self._key_bytes.get(key, 0) + size
        self.entries += 1
        self.bytes += size
        heapq.heappush(self._expiries, (expires, self._serial, key, subkey))
        if rank is not None:
            item = (rank, self._serial, key, subkey)
            heapq.heappush(self._ranked.setdefault(key, []), item)
            heapq.heappush(self._all_ranked, item)
            self._compact(key)

    def drop_key(self, key: Hashable) -> None:
        """Forget every entry under ``key`` (its storage replaced them all)."""
        for subkey in list(self._held.get(key, {})):
            self._forget(key, subkey)

    @staticmethod
    def _why_key(entries: dict[Hashable, _Held], old: _Held | None) -> str:
        if old is None and len(entries) >= MAX_ENTRIES_PER_KEY:
            return f"this key holds {MAX_ENTRIES_PER_KEY} entries already"
        return f"this key's entries would take over {MAX_BYTES_PER_KEY} bytes"

    def _current(self, serial: int, key: Hashable, subkey: Hashable) -> bool:
        held = self._held.get(key, {}).get(subkey)
        return held is not None and held.serial == serial

    def _stalest(self, heap: list[_Item], *, skip: Place, chosen: dict[Place, int]) -> _Item | None:
        """Pop the stalest current entry of ``heap`` that is neither ``skip`` (the slot being
        written) nor already ``chosen`` (those stay out of the heap until put back)."""
        skipped = []
        found = None
        while heap:
            item = heapq.heappop(heap)
            _, serial, key, subkey = item
            if not self._current(serial, key, subkey):
                continue  # replaced or gone: dropped for good
            if (key, subkey) == skip or (key, subkey) in chosen:
                skipped.append(item)
                continue
            found = item
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def _compact(self, key: Hashable) -> None:
        """Drop stale heap items once they outnumber the entries (renewals leave one each)."""
        heap = self._ranked.get(key)
        if heap is not None and len(heap) > 2 * len(self._held.get(key, {})) + 64:
            self._ranked[key] = [i for i in heap if self._current(i[1], key, i[3])]
            heapq.heapify(self._ranked[key])
        if len(self._all_ranked) > 2 * self.entries + 64:
            self._all_ranked = [i for i in self._all_ranked if self._current(i[1], i[2], i[3])]
            heapq.heapify(self._all_ranked)

    def _forget(self, key: Hashable, subkey: Hashable) -> None:
        held = self._held[key].pop(subkey)
        self.entries -= 1
        self.bytes -= held.size
        self._key_bytes[key] -= held.size
        if not self._held[key]:
            del self._held[key], self._key_bytes[key]
            self._ranked.pop(key, None)
