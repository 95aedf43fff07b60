"""Round matchmaking's groups, kept up to date as candidates arrive one by one.

The node cuts the candidates it sees into groups with :func:`assign_groups`; a peer's group is
fixed by the candidates visible when it reads them. With thousands of peers each reading a
different (larger) set, calling ``assign_groups`` per read costs O(n log n) each; this keeps the
candidates in the node's own order (:func:`group_order`) and answers one peer's group in O(group
size). ``tests/unit/test_des.py`` checks it against ``assign_groups`` itself.
"""

from __future__ import annotations

import bisect
from typing import Any

from swarmgrad.node.averaging.grouping import group_order


class Candidates:
    """The peers ready for one round that a reader sees, in the round's shuffle."""

    def __init__(self, round_: int, group_size: int) -> None:
        if group_size < 2:
            raise ValueError("group_size must be at least 2")
        self.round = round_
        self.group_size = group_size
        self._order: list[tuple[bytes, str]] = []
        self.ids: set[str] = set()
        #: Bumped by every change: what a reader's cached answers about these candidates
        #: (``rounds.Rounds._awaited``) are keyed by.
        self.version = 0
        self.awaited: tuple[Any, ...] | None = None
        #: The groups cut at this version, by their slice of the order (a group of 256 is read
        #: by each of its members).
        self._cut: tuple[int, dict[tuple[int, int], tuple[str, ...]]] = (0, {})

    def __len__(self) -> int:
        return len(self._order)

    def add(self, peer_id: str) -> None:
        if peer_id not in self.ids:
            self.ids.add(peer_id)
            self.version += 1
            bisect.insort(self._order, (group_order(self.round, peer_id), peer_id))

    def remove(self, peer_id: str) -> None:
        if peer_id in self.ids:
            self.ids.discard(peer_id)
            self.version += 1
            del self._order[
                bisect.bisect_left(self._order, (group_order(self.round, peer_id), peer_id))
            ]

    def group_of(self, peer_id: str) -> tuple[str, ...] | None:
        """``peer_id``'s group among the candidates now (sorted ids), as ``assign_groups`` would
        cut it; None if it is not a candidate or would be alone."""
        if peer_id not in self.ids:
            return None
        n, size = len(self._order), self.group_size
        rank = bisect.bisect_left(self._order, (group_order(self.round, peer_id), peer_id))
        full = n // size
        last = max(full - 1, 0) if n % size else full - 1  # the group the remainder joins
        index = min(rank // size, last) if full else 0
        start = index * size
        end = n if index == last or not full else start + size
        if end - start < 2:
            return None
        version, cut = self._cut
        if version != self.version:
            cut = {}
            self._cut = (self.version, cut)
        group = cut.get((start, end))
        if group is None:
            group = cut[(start, end)] = tuple(sorted(pid for _key, pid in self._order[start:end]))
        return group
