"""The libp2p sidecar's directory: what one peer stores for others, by key and subkey.

Each key holds one entry per subkey, the latest expiry winning (like hivemind's dictionary
values), bounded in entries, sizes and lifetimes (:mod:`.budget`, the limits both backends
share); only swarmgrad's sealed values filed where their seal says are kept
(``records.validate``). Entries travel between peers as JSON
(:func:`encode_entries` / :func:`decode_entries`). Pure Python: no libp2p here.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from swarmgrad.node.discovery.budget import (
    MAX_BYTES_PER_KEY,
    MAX_ENTRIES_PER_KEY,
    Budget,
    entry_bytes,
    freshness,
)
from swarmgrad.node.discovery.check_budget import CheckBudget
from swarmgrad.node.discovery.envelope import Envelope, RecordError
from swarmgrad.node.discovery.records import validate

MAX_KEY_CHARS, MAX_SUBKEY_CHARS = 512, 128


# -- the directory: entries by key and subkey ---------------------------------------------------


@dataclass(slots=True)
class Entry:
    value: bytes
    expires: float


class Directory:
    """What this peer stores for others, bounded in entries, sizes and lifetimes."""

    def __init__(self) -> None:
        self.keys: dict[str, dict[str, Entry]] = {}
        self.budget = Budget()
        #: Signature checks per storing peer (``check_budget.py``).
        self.checks = CheckBudget()

    def store(
        self,
        key: str,
        subkey: str,
        value: bytes,
        expires: float,
        now: float,
        *,
        storer: Hashable | None = None,
    ) -> bool:
        """Whether the value was stored (False: a newer one is held); ValueError if it may not
        be (RecordError: not a valid value there, or OverBudget: ``storer``, the peer that
        asked, has no signature checks left for now; BudgetFull: no room for it). None for
        ``storer``: this peer's own value, never refused for want of checks."""
        envelope = check_entry(
            key, subkey, value, expires, now, may_check=self.checks.for_storer(storer)
        )
        for gone_key, gone_subkey in self.budget.purge(now):
            self._drop(str(gone_key), str(gone_subkey))
        old = self.keys.get(key, {}).get(subkey)
        if old is not None and old.expires >= expires:
            return False  # a newer value (or this one) is already held
        size = entry_bytes(subkey, value)
        rank = freshness(envelope, now)
        for gone_key, gone_subkey in self.budget.make_room(key, subkey, size, rank=rank):
            self._drop(str(gone_key), str(gone_subkey))  # stale readiness records (budget.py)
        self.keys.setdefault(key, {})[subkey] = Entry(value, expires)
        self.budget.add(key, subkey, size, expires, rank=rank)
        return True

    def _drop(self, key: str, subkey: str) -> None:
        entries = self.keys[key]
        del entries[subkey]
        if not entries:
            del self.keys[key]

    def get(self, key: str, now: float) -> dict[str, Entry]:
        return {s: e for s, e in self.keys.get(key, {}).items() if e.expires > now}


def check_entry(
    key: str,
    subkey: str,
    value: bytes,
    expires: float,
    now: float,
    *,
    may_check: Callable[[], bool] | None = None,
) -> Envelope:
    """``value`` opened, if it is a sealed value that may live under (key, subkey) until
    ``expires``; ValueError (RecordError) otherwise (``may_check``: as ``records.validate``)."""
    if not 0 < len(key) <= MAX_KEY_CHARS or not 0 < len(subkey) <= MAX_SUBKEY_CHARS:
        raise ValueError("key or subkey empty or too long")
    return validate(key, subkey, value, expires, now, may_check=may_check)


def bound(entries: dict[str, Entry], held_by: dict[str, int]) -> dict[str, Entry]:
    """``entries`` cut to one key's limits (:mod:`.budget`), keeping first those that the most
    replicas returned (``held_by``, by subkey): the answer to the node must fit its line, and
    what a replica held before a flood, every replica holds."""
    kept: dict[str, Entry] = {}
    total = 0
    for subkey in sorted(entries, key=lambda s: -held_by.get(s, 0)):
        size = entry_bytes(subkey, entries[subkey].value)
        if len(kept) < MAX_ENTRIES_PER_KEY and total + size <= MAX_BYTES_PER_KEY:
            kept[subkey] = entries[subkey]
            total += size
    return kept


def merge(key: str, into: dict[str, Entry], entries: dict[str, Entry], now: float) -> int:
    """Merge another peer's ``entries`` for ``key`` (the latest expiry wins); how many it
    returned that were not valid (dropped: they must not shadow a genuine entry)."""
    dropped = 0
    for subkey, entry in entries.items():
        try:
            check_entry(key, subkey, entry.value, entry.expires, now)
        except RecordError:
            dropped += 1
            continue
        if subkey not in into or into[subkey].expires < entry.expires:
            into[subkey] = entry
    return dropped


def encode_entries(entries: dict[str, Entry]) -> list[dict[str, Any]]:
    return [
        {"subkey": s, "value": base64.b64encode(e.value).decode(), "expires": e.expires}
        for s, e in entries.items()
    ]


def decode_entries(raw: object) -> dict[str, Entry]:
    """Entries from a peer's answer; raises ValueError on anything malformed."""
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES_PER_KEY:
        raise ValueError("entries must be a list")
    entries = {}
    for item in raw:
        if not isinstance(item, dict) or set(item) != {"subkey", "value", "expires"}:
            raise ValueError("malformed entry")
        subkey, value, expires = item["subkey"], item["value"], item["expires"]
        if not isinstance(subkey, str) or not isinstance(value, str):
            raise ValueError("malformed entry")
        if not isinstance(expires, int | float) or isinstance(expires, bool):
            raise ValueError("malformed entry")
        entries[subkey] = Entry(base64.b64decode(value, validate=True), float(expires))
    return entries
