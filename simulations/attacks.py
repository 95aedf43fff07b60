"""What a malicious member sends instead of its honest update: the attacks open runs defend against.

Pure functions on the flat update a member would average (tests, ``benchmarks/byzantine.py``,
``benchmarks/adversaries.py``); each takes the attacker's honest update and what the attack may
know. "A little is enough" (ALIE) is omniscient: it reads the honest members' updates of the
round, as colluders could. Colluders (COLLUDE) need no channel between them: each derives the
round's shared direction from the round number and a seed they agreed on beforehand.
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmgrad.protocol.v1 import averaging_pb2


class Attack(enum.StrEnum):
    SIGN_FLIP = "sign_flip"  # -x
    SCALE = "scale"  # 100 x
    NOISE = "noise"  # Gaussian noise, 3x the update's norm
    ZEROS = "zeros"  # nothing
    NAN = "nan"  # NaN in a few places (on the wire: a NaN block scale, see NaNPayloads)
    REPLAY = "replay"  # its first round's update, every round after
    ALIE = "alie"  # mean - z std of the honest updates, per coordinate (z = 1)
    # The honest mean (a colluder's own update, in a swarm) plus the round's shared direction.
    COLLUDE = "collude"
    # As an owner or a checker (its update stays honest):
    LYING_OWNER = "lying_owner"  # shifts its part's result by 1% of its norm
    FALSE_REPORT = "false_report"  # sends false check reports, to frame honest owners
    # Ends one member's stream a round without its signed account (each other member in turn)
    # and returns its part's result x(-3): issue 42's critical attack.
    WITHHOLD_LIE = "withhold_lie"

    @property
    def as_owner(self) -> bool:
        """Whether the attack is in what it does as an owner or checker, not in its update."""
        return self in (Attack.LYING_OWNER, Attack.FALSE_REPORT, Attack.WITHHOLD_LIE)


#: The seed colluders agreed on; with the round number it gives every colluder the same direction.
COLLUSION_SEED = 42
#: The shared direction's norm, as a multiple of the colluder's honest update's norm: as far from
#: the honest mean as two honest updates are from each other (their cosines are ~0.2-0.3 here).
COLLUSION_SCALE = 1.0


def shared_direction(round_: int, numel: int, *, seed: int = COLLUSION_SEED) -> torch.Tensor:
    """The unit direction every colluder adds in ``round_``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + round_)
    direction = torch.randn(numel, generator=generator)
    return direction / float(direction.norm())


def colluding_update(honest_mean: torch.Tensor, round_: int) -> torch.Tensor:
    """A colluder's update: ``honest_mean`` plus the round's shared direction."""
    direction = shared_direction(round_, honest_mean.numel())
    return honest_mean + direction * (COLLUSION_SCALE * float(honest_mean.norm()))


def flip_result(index: int, value: torch.Tensor) -> torch.Tensor:
    """The rotating withholder's lie: its part's result times -3."""
    return value * -3.0


def withheld_member(round_: int, members: int, owner: int) -> int:
    """The member whose account the rotating withholder keeps in ``round_``: each of the
    ``members`` other than the ``owner`` in turn."""
    others = [m for m in range(members) if m != owner]
    return others[round_ % len(others)]


@dataclass(slots=True)
class Attacker:
    """One malicious member's state across rounds."""

    attack: Attack
    seed: int = 0
    _first: torch.Tensor | None = None
    _generator: torch.Generator = field(default_factory=torch.Generator)
    _rounds: int = 0  # updates made so far: the round, where the caller does not say

    def __post_init__(self) -> None:
        self._generator.manual_seed(self.seed)

    def update(
        self,
        honest: torch.Tensor,
        others: Sequence[torch.Tensor] = (),
        *,
        round_: int | None = None,
    ) -> torch.Tensor:
        """What it sends this round instead of ``honest`` (``others``: the honest members'
        updates, for ALIE and COLLUDE; ``round_``: the round, for COLLUDE, else counted)."""
        attack = self.attack
        round_ = self._rounds if round_ is None else round_
        self._rounds += 1
        if attack.as_owner:
            return honest
        if attack is Attack.COLLUDE:  # knowing the others, their mean; in a swarm, its own
            mean = torch.stack(list(others)).mean(0) if others else honest
            return colluding_update(mean, round_)
        if self._first is None:
            self._first = honest.clone()
            if attack is Attack.REPLAY:
                return honest.clone()  # it has nothing to replay yet
        if attack is Attack.SIGN_FLIP:
            return -honest
        if attack is Attack.SCALE:
            return honest * 100.0
        if attack is Attack.NOISE:
            noise = torch.randn(honest.shape, generator=self._generator)
            return noise * (3.0 * float(honest.norm()) / max(1e-12, float(noise.norm())))
        if attack is Attack.ZEROS:
            return torch.zeros_like(honest)
        if attack is Attack.NAN:
            poisoned = honest.clone()
            poisoned[:: max(1, honest.numel() // 7)] = float("nan")
            return poisoned
        if attack is Attack.REPLAY:
            return self._first.clone()
        stack = torch.stack(list(others) or [honest])
        return stack.mean(0) - stack.std(0, correction=0)


class NaNPayloads:
    """Round hooks that make every chunk decode to NaN: its first block scale (a blockwise
    codec's payload opens with fp32 scales) becomes NaN. Honest encoders refuse NaN input, so
    an attacker writes the bytes itself."""

    async def before_send(self, owner: int, index: int, payload: bytes) -> bytes:
        return struct.pack("<f", float("nan")) + payload[4:]


def lying_result(index: int, value: torch.Tensor) -> torch.Tensor:
    """What a lying owner publishes for a chunk: its result shifted by 1% of the result's norm
    (small enough to pass for noise, large enough to pull a run off course round after round)."""
    shift = torch.ones_like(value)
    return value + shift * (0.01 * float(value.norm()) / max(1e-12, float(shift.norm())))


@dataclass(slots=True)
class LyingOwner:
    """Owner hooks (``node/averaging/hooks.py``) of an owner that publishes ``lie`` of each
    chunk's result instead of the result."""

    lie: Callable[[int, torch.Tensor], torch.Tensor] = lying_result

    def result(self, index: int, value: torch.Tensor) -> torch.Tensor:
        return self.lie(index, value)


def false_report(
    honest: Callable[..., averaging_pb2.PartReport],
) -> Callable[..., averaging_pb2.PartReport]:
    """A member's report maker (``checks.own_report``) that sends false projections, to frame
    honest owners: each number moved far outside any slack."""

    @functools.wraps(honest)
    def report(*args: Any, **kwargs: Any) -> averaging_pb2.PartReport:
        out = honest(*args, **kwargs)
        moved = [x + 1e3 * (1.0 + abs(x)) for x in out.projections]
        del out.projections[:]
        out.projections.extend(moved)
        return out

    return report
