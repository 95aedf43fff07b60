"""What one DHT node holds for others: the limits per key and in all, shared by both backends.

A DHT is writable by anyone, and sealed values from throwaway keys cost nothing to make: without
a bound per key, a flood of large values under a topic makes every answer for it too large to
travel (the genuine records hidden with the flood) or fills the node's memory. Each key holds at
most :data:`MAX_ENTRIES_PER_KEY` entries and :data:`MAX_BYTES_PER_KEY` bytes, well inside what
one answer may carry (the libp2p sidecar's ``MAX_MESSAGE_BYTES`` and its line to the node,
hivemind's 4 MiB daemon messages); a node holds at most :data:`MAX_ENTRIES` and
:data:`MAX_BYTES` in all. When a key is full, the signers already in it keep their slots (each
may replace its value with a newer one that fits) and new signers are refused: a flood cannot
push out the records held before it. Pure Python (no hivemind, no libp2p): both backends'
processes import it.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

MAX_ENTRIES_PER_KEY = 4096
#: Bytes of one key's entries (:func:`entry_bytes`): ~1,500 peer records, or 78 specs of 16 KiB.
MAX_BYTES_PER_KEY = 1280 * 1024
MAX_ENTRIES = 65536
MAX_BYTES = 128 << 20
#: What an entry costs besides its subkey and value: its expiry and framing (an answer's JSON
#: object per entry is ~60 bytes, base64 aside), so that a key's entries, however small, fit
#: an answer sized for :data:`MAX_BYTES_PER_KEY`.
ENTRY_OVERHEAD_BYTES = 64


class BudgetFull(ValueError):
    """An entry that would take a key, or the node, over its limits."""


def entry_bytes(subkey: str, value: bytes) -> int:
    """What an entry counts for against the limits."""
    return len(subkey.encode()) + len(value) + ENTRY_OVERHEAD_BYTES


class Budget:
    """The sizes and expiries of the entries one node holds, by key and subkey, with running
    totals: whether one more fits, in time independent of how much is held. Expired entries
    leave lazily (an expiry heap), when :meth:`purge` is called."""

    def __init__(self) -> None:
        self._held: dict[Hashable, dict[Hashable, tuple[int, float]]] = {}
        self._key_bytes: dict[Hashable, int] = {}
        self._expiries: list[tuple[float, int, Hashable, Hashable]] = []
        self._pushed = 0  # a tie-breaker: keys and subkeys need not be ordered
        self.entries = 0
        self.bytes = 0

    def purge(self, now: float) -> list[tuple[Hashable, Hashable]]:
        """Forget the entries that expired by ``now``; the (key, subkey) pairs forgotten."""
        gone = []
        while self._expiries and self._expiries[0][0] <= now:
            expires, _, key, subkey = heapq.heappop(self._expiries)
            held = self._held.get(key, {}).get(subkey)
            if held is not None and held[1] == expires:  # not replaced since
                self._forget(key, subkey)
                gone.append((key, subkey))
        return gone

    def check(self, key: Hashable, subkey: Hashable, size: int) -> None:
        """BudgetFull unless an entry of ``size`` bytes fits under (key, subkey), replacing the
        one held there. Call :meth:`purge` first."""
        entries = self._held.get(key, {})
        old = entries.get(subkey)
        old_size = old[0] if old is not None else 0
        key_bytes = self._key_bytes.get(key, 0) - old_size + size
        if old is None and len(entries) >= MAX_ENTRIES_PER_KEY:
            raise BudgetFull(f"this key holds {MAX_ENTRIES_PER_KEY} entries already")
        if key_bytes > MAX_BYTES_PER_KEY:
            raise BudgetFull(f"this key's entries would take over {MAX_BYTES_PER_KEY} bytes")
        if old is None and self.entries >= MAX_ENTRIES:
            raise BudgetFull("this peer's directory is full")
        if self.bytes - old_size + size > MAX_BYTES:
            raise BudgetFull("this peer's directory is full (bytes)")

    def add(self, key: Hashable, subkey: Hashable, size: int, expires: float) -> None:
        """Count an entry stored under (key, subkey) until ``expires`` (replacing any there)."""
        if subkey in self._held.get(key, {}):
            self._forget(key, subkey)
        self._held.setdefault(key, {})[subkey] = (size, expires)
        self._key_bytes[key] = self._key_bytes.get(key, 0) + size
        self.entries += 1
        self.bytes += size
        self._pushed += 1
        heapq.heappush(self._expiries, (expires, self._pushed, key, subkey))

    def drop_key(self, key: Hashable) -> None:
        """Forget every entry under ``key`` (its storage replaced them all)."""
        for subkey in list(self._held.get(key, {})):
            self._forget(key, subkey)

    def _forget(self, key: Hashable, subkey: Hashable) -> None:
        size, _ = self._held[key].pop(subkey)
        self.entries -= 1
        self.bytes -= size
        self._key_bytes[key] -= size
        if not self._held[key]:
            del self._held[key], self._key_bytes[key]
