"""A malicious node for simulations: the real node, whose every round sends an attack instead of
its honest update (``python -m swarmgrad.simulations.adversary --attack KIND node ...``), or
whose owner lies about its part, or whose check reports frame honest owners.

Everything else is the real node (discovery, matchmaking, its owner's part, state sync): only
the vector it hands to the all-reduce is replaced, by :class:`~.attacks.Attacker`, or (NaN) its
encoded chunks are poisoned on the way out, since honest encoders refuse NaN. ``swarmgrad
simulate`` starts peers whose profile says ``attack = "..."`` this way. Not for real runs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from swarmgrad.node import cli
from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.open import checks, reports
from swarmgrad.simulations.attacks import (
    Attack,
    Attacker,
    LyingOwner,
    NaNPayloads,
    false_report,
)


def install(attack: Attack, *, seed: int = 0) -> None:
    """Make every Averager in this process send ``attack`` instead of its values."""
    attacker = Attacker(attack, seed=seed)
    honest_all_reduce = Averager.all_reduce
    if attack is Attack.FALSE_REPORT:
        # The checks call the report maker by its name in their module.
        setattr(checks, "own_report", false_report(reports.own_report))  # noqa: B010

    async def all_reduce(
        self: Averager, vector: torch.Tensor, group: Group, **options: Any
    ) -> RoundResult:
        if attack is Attack.NAN:
            options["hooks"] = NaNPayloads()
        elif attack is Attack.LYING_OWNER:
            options["owner_hooks"] = LyingOwner()
        elif attack is Attack.FALSE_REPORT:
            pass  # its reports are false (above); its update is honest
        else:
            vector = attacker.update(vector)
        return await honest_all_reduce(self, vector, group, **options)

    Averager.all_reduce = all_reduce  # type: ignore[method-assign]


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) < 2 or argv[0] != "--attack":
        sys.exit("usage: python -m swarmgrad.simulations.adversary --attack KIND node ...")
    try:
        attack = Attack(argv[1])
    except ValueError:
        sys.exit(f"unknown attack {argv[1]!r}; known: {', '.join(Attack)}")
    install(attack)
    sys.argv = [sys.argv[0], *argv[2:]]
    cli.main()


if __name__ == "__main__":
    main()
