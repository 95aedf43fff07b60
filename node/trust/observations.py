"""What an owner sees of each member in the chunks it aggregates: clip, cosine, screens and
fingerprints (:class:`Observation`, noted by :func:`observe_chunk`), which the trust ledger
(``ledger.py``) turns into flags and bans."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from swarmgrad.node.trust.aggregate import Aggregate, Screen
from swarmgrad.node.trust.flags import Flag

__all__ = ["MIN_JUDGED_MEMBERS", "SKETCH_VALUES", "Observation", "observe_chunk", "sketch"]

#: Values of a chunk kept as its fingerprint for replay and duplicate checks (a strided subset).
SKETCH_VALUES = 2048
#: The fewest members a chunk must have for their scale, clip and cosine to flag them: with
#: five, two colluders are still a minority of any honest owner's others (open runs' groups
#: should have at least one member more: the owner's own values stay out of its part).
MIN_JUDGED_MEMBERS = 5


@dataclass(slots=True)
class Observation:
    """One member's values of one owner's part in one round, as the owner saw them."""

    numel: int = 0
    clip_sum: float = 0.0  # numel-weighted
    cosine_sum: float = 0.0
    flags: set[Flag] = field(default_factory=set)
    #: (global position, numel) of each chunk -> its fingerprint.
    sketches: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def add_chunk(self, numel: int, clip: float, cosine: float) -> None:
        self.numel += numel
        self.clip_sum += numel * clip
        self.cosine_sum += numel * cosine

    @property
    def clip(self) -> float:
        return self.clip_sum / self.numel if self.numel else 1.0

    @property
    def cosine(self) -> float:
        return self.cosine_sum / self.numel if self.numel else 1.0


def sketch(values: torch.Tensor) -> torch.Tensor:
    """A chunk's fingerprint: up to :data:`SKETCH_VALUES` of its values, evenly strided."""
    step = max(1, values.numel() // SKETCH_VALUES)
    return values[::step][:SKETCH_VALUES].double()


_SCREEN_FLAGS = {Screen.ZERO: Flag.ZERO, Screen.SCALE: Flag.SCALE, Screen.OUTSIZED: Flag.OUTSIZED}
K = TypeVar("K")


def observe_chunk(
    observations: MutableMapping[K, Observation],
    members: Sequence[K],
    stack: torch.Tensor,
    outcome: Aggregate,
    position: tuple[int, int],
) -> None:
    """Note in ``observations`` what each of ``members`` (the rows of ``stack``) looked like in
    one aggregated chunk at ``position`` (its start in the round's vector, its size).

    A member's scale, clip and cosine are measured against the others of the chunk, so they say
    something only where honest members are most of them: from a chunk of fewer than
    :data:`MIN_JUDGED_MEMBERS` they are not taken (two colluders among an honest owner's three
    other members made it flag, then ban, the honest one). All zeros, replays and duplicates
    are facts about the member's own values, taken from any chunk, and so is a norm far above
    the owner's own (``outsized``: a statistical flag, not a decisive one, because how far noise
    stands out depends on the chunk, so owners of different parts would ban in different
    rounds)."""
    fingerprints = [sketch(row) for row in stack]
    judged = len(members) >= MIN_JUDGED_MEMBERS
    for k, member in enumerate(members):
        seen = observations.setdefault(member, Observation())
        if k in outcome.screened:
            screen = outcome.screened[k]
            if screen in (Screen.ZERO, Screen.OUTSIZED) or judged:
                seen.flags.add(_SCREEN_FLAGS[screen])
            continue
        if judged:
            seen.add_chunk(position[1], outcome.clip[k], outcome.cosine[k])
        seen.sketches[position] = fingerprints[k]
        for j in range(k):
            if torch.equal(fingerprints[j], fingerprints[k]) and torch.equal(stack[j], stack[k]):
                seen.flags.add(Flag.DUPLICATE)
                observations[members[j]].flags.add(Flag.DUPLICATE)
