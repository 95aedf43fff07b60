"""An averaging group: its members, its id, and how the flat vector is cut into owned parts."""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

#: The largest relative bandwidth a member may offer: a million times another's share says nothing
#: an honest peer would, and a larger number (1e308 is finite) overflows the partition's sums.
MAX_BANDWIDTH = 1e6
#: The largest weight (samples since the last round) a member's values may carry, far above any
#: real round's; a sum of such weights stays exact in float64.
MAX_WEIGHT = 1e12


def bounded(bandwidth: float, weight: float) -> bool:
    """Whether a peer's bandwidth and weight may enter a group (finite, in range)."""
    return 0 <= bandwidth <= MAX_BANDWIDTH and 0 < weight <= MAX_WEIGHT


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """One peer of a group.

    ``bandwidth`` is relative upload capacity: a member owns a share of the vector proportional to
    it (0: owns nothing, e.g. a peer that cannot accept connections). ``weight`` is what its values
    count for in the average (samples processed since the last round).
    """

    peer_id: str
    endpoint: str
    bandwidth: float = 1.0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.peer_id or len(self.peer_id) > 256:
            raise ValueError(f"bad peer id {self.peer_id!r}")
        if not bounded(self.bandwidth, self.weight):  # NaN fails too
            raise ValueError(
                f"{self.peer_id}: bandwidth {self.bandwidth} must be in [0, {MAX_BANDWIDTH:g}] "
                f"and weight {self.weight} in (0, {MAX_WEIGHT:g}]"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """The members of one round's group, in an order every member agrees on."""

    round: int
    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        ids = [m.peer_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ValueError("a group lists a peer twice")
        if not self.members:
            raise ValueError("a group needs at least one member")
        if self.round < 0:
            raise ValueError("round must be >= 0")
        if not any(m.bandwidth > 0 for m in self.members):
            raise ValueError("no member of the group has bandwidth to own a part")

    @property
    def group_id(self) -> bytes:
        """16 bytes that change with the round and with any detail of any member."""
        h = hashlib.sha256(struct.pack("<Q", self.round))
        for m in self.members:
            for text in (m.peer_id, m.endpoint):
                data = text.encode()
                h.update(struct.pack("<I", len(data)) + data)
            h.update(struct.pack("<dd", m.bandwidth, m.weight))
        return h.digest()[:16]

    def index(self, peer_id: str) -> int:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        raise KeyError(f"{peer_id} is not in the group")

    def partition(self, total: int) -> list[tuple[int, int]]:
        """[start, end) of each member's part of a vector of ``total`` values.

        Sizes are proportional to bandwidth; the remainder of the integer division goes to the
        largest fractional shares (ties to the lower index), so every member computes the same cut.
        """
        bandwidth = sum(m.bandwidth for m in self.members)
        shares = [total * m.bandwidth / bandwidth for m in self.members]
        sizes = [math.floor(s) for s in shares]
        by_fraction = sorted(range(len(sizes)), key=lambda i: (-(shares[i] - sizes[i]), i))
        for i in by_fraction[: total - sum(sizes)]:
            sizes[i] += 1
        return chunk_offsets(sizes)


def chunk_sizes(numel: int, chunk_values: int) -> list[int]:
    """Sizes of the chunks a part of ``numel`` values is streamed in."""
    full, rest = divmod(numel, chunk_values)
    return [chunk_values] * full + ([rest] if rest else [])


def chunk_offsets(numels: list[int]) -> list[tuple[int, int]]:
    """Where each chunk of ``numels`` values starts and ends in their part."""
    offsets, start = [], 0
    for numel in numels:
        offsets.append((start, start + numel))
        start += numel
    return offsets
