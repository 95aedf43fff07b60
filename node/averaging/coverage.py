"""What a round's result holds: which members' values, in which chunks, and where none.

A member's result is built chunk by chunk, each averaged over the contributors its owner
names; :func:`cover` reads those lists back into who contributed everywhere, who only in part,
and which ranges of the vector hold no average at all (the trainer leaves those untouched). The
all-reduce (``allreduce.py``) and an open run's checks of a result (``open/policy.py``) share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swarmgrad.node.averaging.group import Group, chunk_offsets, chunk_sizes
from swarmgrad.node.averaging.plan import AllReduceConfig


@dataclass(frozen=True, slots=True)
class Coverage:
    """Which members' values a round's result holds, and where it holds none."""

    contributors: tuple[str, ...]
    partial: tuple[str, ...]
    missing: tuple[tuple[int, int], ...]
    #: Whether any chunk was averaged with another member than this one.
    with_others: bool


def cover(
    group: Group,
    config: AllReduceConfig,
    bounds: list[tuple[int, int]],
    contributors: Mapping[tuple[int, int], tuple[int, ...]],
    me: int | None = None,
    *,
    abstains: bool = False,
) -> Coverage:
    """The :class:`Coverage` of a result whose chunks (part, index) hold ``contributors``'
    values (absent: missing; ``abstains``: an owner's own values stay out of its part)."""
    ids = [m.peer_id for m in group.members]
    missing: list[tuple[int, int]] = []
    seen_in: dict[int, int] = dict.fromkeys(range(len(ids)), 0)
    averaged_chunks = 0
    with_others = False
    for part, (start, end) in enumerate(bounds):
        for index, (cs, ce) in enumerate(
            chunk_offsets(chunk_sizes(end - start, config.chunk_values))
        ):
            chunk = contributors.get((part, index))
            if chunk is None:
                if missing and missing[-1][1] == start + cs:
                    missing[-1] = (missing[-1][0], start + ce)
                else:
                    missing.append((start + cs, start + ce))
                continue
            averaged_chunks += 1
            with_others |= any(c != me for c in chunk)
            for c in chunk:
                seen_in[c] += 1
            if abstains and part not in chunk:
                seen_in[part] += 1  # an owner's values stay out of its own part
    return Coverage(
        contributors=tuple(ids[c] for c, n in seen_in.items() if n == averaged_chunks),
        partial=tuple(ids[c] for c, n in seen_in.items() if 0 < n < averaged_chunks),
        missing=tuple(missing),
        with_others=with_others,
    )
