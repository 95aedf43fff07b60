"""A malicious node for simulations: the real node, whose every round sends an attack instead of
its honest update (``python -m swarmgrad.simulations.adversary --attack KIND node ...``), or
whose owner lies about its part (and withholds accounts), or whose check reports frame honest
owners.

Everything else is the real node (discovery, matchmaking, its owner's part, state sync): only
the vector it hands to the all-reduce is replaced, by :class:`~.attacks.Attacker`, or (NaN) its
encoded chunks are poisoned on the way out, since honest encoders refuse NaN. ``swarmgrad
simulate`` starts peers whose profile says ``attack = "..."`` this way. Not for real runs.

``benchmarks/adversaries.py`` runs the same attacks against an older checkout (before the
round's owner hooks), so the owner's lie goes in as the tree takes it (``_lie``), and the
modules patched are found where the tree keeps them.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from swarmgrad.node import cli
from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.reducer import SenderSession
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.simulations.attacks import (
    Attack,
    Attacker,
    LyingOwner,
    NaNPayloads,
    false_report,
    flip_result,
    lying_result,
    withheld_member,
)


def install(attack: Attack, *, seed: int = 0) -> None:
    """Make every Averager in this process send ``attack`` instead of its values."""
    attacker = Attacker(attack, seed=seed)
    honest_all_reduce = Averager.all_reduce
    takes_hooks = "owner_hooks" in inspect.signature(honest_all_reduce).parameters
    if attack is Attack.FALSE_REPORT:
        checks, reports = _modules("checks", "reports")
        # The checks call the report maker by its name in their module.
        setattr(checks, "own_report", false_report(reports.own_report))  # noqa: B010
    if attack is Attack.WITHHOLD_LIE:
        _withhold_in_turn()

    async def all_reduce(
        self: Averager, vector: torch.Tensor, group: Group, **options: Any
    ) -> RoundResult:
        if attack is Attack.NAN:
            options["hooks"] = NaNPayloads()
        elif attack is Attack.LYING_OWNER:
            _lie(self, options, lying_result, takes_hooks)
        elif attack is Attack.WITHHOLD_LIE:
            _lie(self, options, flip_result, takes_hooks)
        elif attack is Attack.FALSE_REPORT:
            pass  # its reports are false (above); its update is honest
        else:
            vector = attacker.update(vector, round_=group.round)
        return await honest_all_reduce(self, vector, group, **options)

    Averager.all_reduce = all_reduce  # type: ignore[method-assign]


Lie = Callable[[int, torch.Tensor], torch.Tensor]


def _lie(averager: Averager, options: dict[str, Any], lie: Lie, takes_hooks: bool) -> None:
    """Make this round's owner publish ``lie`` of its results: as owner hooks, or on a tree
    from before them, through the averager's own attribute."""
    if takes_hooks:
        options["owner_hooks"] = LyingOwner(lie)
    else:
        setattr(averager, "tamper_results", lie)  # noqa: B010


def _modules(*names: str) -> list[Any]:
    """The averaging modules ``names``: in ``open/`` where the tree has it, else flat."""
    try:
        return [importlib.import_module(f"swarmgrad.node.averaging.open.{n}") for n in names]
    except ModuleNotFoundError:
        return [importlib.import_module(f"swarmgrad.node.averaging.{n}") for n in names]


def _withhold_in_turn() -> None:
    """This process's owner ends one member's stream a round without its signed account, each
    other member in turn (``withheld_member``). Every session a node serves is for its own part,
    so no check of the owner is needed."""
    honest_account = SenderSession.account

    async def account(self: SenderSession) -> averaging_pb2.Signed | None:
        signed = await honest_account(self)
        reducer = self._reducer
        victim = withheld_member(reducer.group.round, len(reducer.group.members), reducer.part)
        return None if self._member == victim else signed

    SenderSession.account = account  # type: ignore[method-assign]


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
