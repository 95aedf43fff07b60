"""One round as a trainer sees it, under one deadline: reachability, group, all-reduce, withdraw.

:meth:`Rounds.run` waits (once, before the node's first round with peers) for this node's
reachability verdict, forms a group for the epoch through the DHT (``matchmaking.py``), makes
punching routes to the group's relayed members, and all-reduces the trainer's vector
(``averager.py``), which encodes each chunk once and, for error feedback, reports what its
owners decode of it (``RoundResult.sent``). All of it runs under ``budget_seconds``: a DHT that
stalls matchmaking, or anything else that overruns, ends the round as NO_GROUP (before a group
formed) or ABORTED (after), never as a trainer waiting for good. Each way a round can fail is an
:class:`Outcome` the trainer handles, counts and survives; none raises.

The round's readiness record is withdrawn soon after the group forms (its mates have read it by
then) and again when the round ends, so that a latecomer never groups with peers that moved on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.group import MAX_BANDWIDTH, Group
from swarmgrad.node.averaging.matchmaking import Matchmaker
from swarmgrad.node.averaging.membership import Membership
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.discovery.directory import PeerDirectory
from swarmgrad.node.kinds import Failure, RoundOutcome
from swarmgrad.node.reachability.dialback import Reachability
from swarmgrad.node.reachability.routes import PunchRoutes
from swarmgrad.node.scraped import Tallies
from swarmgrad.protocol.errors import RoundAborted

log = logging.getLogger(__name__)

#: A readiness record stays this long after its group is formed (past matchmaking's settle
#: time), for group mates still reading the candidates, then it is withdrawn.
WITHDRAW_MARGIN_SECONDS = 2.5


#: A round's own outcomes are AVERAGED, NO_GROUP and ABORTED; a trainer reports the others.
Outcome = RoundOutcome


@dataclass(frozen=True, slots=True)
class Averaged:
    outcome: Outcome
    result: RoundResult | None = None
    group: Group | None = None
    #: What this node contributed, as its owners decoded it (``vector`` itself if not kept).
    sent: torch.Tensor | None = None
    error: str = ""
    seconds: float = 0.0  # the all-reduce's own duration


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundsConfig:
    #: Relative upload capacity: the share of each round's vector this node offers to own.
    bandwidth: float = 1.0
    #: How long a first round waits for the reachability verdict when there are peers to ask.
    reachability_wait_seconds: float = 15.0
    #: The whole round, from the reachability wait to the all-reduce's end.
    budget_seconds: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.bandwidth <= MAX_BANDWIDTH:
            raise ValueError(f"bandwidth must be positive and at most {MAX_BANDWIDTH:g}")
        if self.reachability_wait_seconds < 0 or not self.budget_seconds > 0:
            raise ValueError("reachability_wait_seconds and budget_seconds must be positive")


Spawn = Callable[[Coroutine[Any, Any, None], str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundParts:
    """What a round is made of: this node's parts, built before it."""

    matchmaker: Matchmaker
    averager: Averager
    directory: PeerDirectory
    reachability: Reachability
    routes: PunchRoutes
    tallies: Tallies
    #: Starts a background task the node owns (withdrawals that outlive the round).
    spawn: Spawn
    #: Who this node believes is a live member (``membership.py``): told who contributed to
    #: each round it averaged (None: matchmaking counts every signed readiness record).
    membership: Membership | None = None


class Rounds:
    def __init__(self, parts: RoundParts, config: RoundsConfig) -> None:
        self._parts, self.config = parts, config
        self._waited = False  # for a reachability verdict, before the first round

    async def run(
        self,
        vector: torch.Tensor,
        *,
        epoch: int,
        weight: float,
        keep_sent: bool = False,
        owner_residual: torch.Tensor | None = None,
    ) -> Averaged:
        """One round for ``epoch``: the all-reduce of ``vector`` with a group from the DHT
        (``keep_sent``: report what the owners decoded of it, for error feedback;
        ``owner_residual``: this node's feedback as an owner, ``reducer.py``)."""
        group: Group | None = None
        try:
            async with asyncio.timeout(self.config.budget_seconds):
                await self._await_reachability()
                # Read only now: the verdict may have moved this node's endpoint (a mapped
                # port, a relay); a NAT'd node announcing its LAN address owns a part nobody
                # can reach.
                endpoint = self._parts.reachability.endpoint
                group = await self._form_group(epoch, weight=weight, endpoint=endpoint)
                if group is None:
                    return Averaged(Outcome.NO_GROUP, error="nobody else was ready in time")
                return await self._average(
                    vector, group, keep_sent=keep_sent, owner_residual=owner_residual
                )
        except DiscoveryError as error:
            self._parts.tallies.failed("discovery failed", Failure.DISCOVERY)
            return Averaged(Outcome.NO_GROUP, error=str(error))
        except TimeoutError:
            budget = f"the round's budget of {self.config.budget_seconds:g} s ran out"
            if group is None:
                self._parts.tallies.count("no group")
                self._parts.spawn(self._withdraw(epoch), f"withdraw-round-{epoch}")
                return Averaged(Outcome.NO_GROUP, error=f"{budget} while forming a group")
            self._parts.tallies.failed("aborted", Failure.ABORTED_ROUND)
            return Averaged(Outcome.ABORTED, group=group, error=budget)

    async def _form_group(self, epoch: int, *, weight: float, endpoint: str) -> Group | None:
        group = await self._parts.matchmaker.form_group(
            epoch,
            endpoint=endpoint,
            bandwidth=self.config.bandwidth * self._parts.reachability.owner_share,
            weight=weight,
        )
        if group is None:
            self._parts.tallies.count("no group")
            # This peer trains on: a latecomer for the round must not count on it.
            await self._withdraw(epoch)
        return group

    async def _average(
        self,
        vector: torch.Tensor,
        group: Group,
        *,
        keep_sent: bool,
        owner_residual: torch.Tensor | None,
    ) -> Averaged:
        parts, epoch = self._parts, group.round
        log.info("epoch %d: averaging in a group of %d", epoch, len(group.members))
        # The readiness record goes soon after the group is formed (its mates have read it by
        # then), not only when the round ends: a peer whose matchmaking starts while this one is
        # still in a failing attempt would build its group from this attempt's record while this
        # node's next attempt announces another (its weight grows in between), and the two would
        # compute different group ids every time. CI saw that livelock: two peers ~5 s out of
        # phase, each attempt refused as UNKNOWN_ROUND, for minutes.
        early = asyncio.create_task(
            self._withdraw_after(epoch, parts.matchmaker.settle_seconds + WITHDRAW_MARGIN_SECONDS),
            name=f"withdraw-round-{epoch}-early",
        )
        try:
            await parts.routes.prepare([m.endpoint for m in group.members], parts.directory.peers)
            started = asyncio.get_running_loop().time()
            result = await parts.averager.all_reduce(
                vector, group, keep_sent=keep_sent, owner_residual=owner_residual
            )
        except RoundAborted as error:
            parts.tallies.failed("aborted", Failure.ABORTED_ROUND)
            return Averaged(Outcome.ABORTED, group=group, error=str(error))
        except Exception as error:  # a bug a peer's input reached: one round lost, not the node
            log.exception("epoch %d: the round failed on an unexpected error", epoch)
            parts.tallies.failed("aborted", Failure.INTERNAL)
            return Averaged(Outcome.ABORTED, group=group, error=f"internal error: {error!r}")
        finally:
            # Also when the round ends (early or not): a peer arriving late for this round must
            # not form a group with peers that have moved on, and the delayed withdrawal must
            # not take down the record of this node's next attempt.
            early.cancel()
            parts.spawn(self._withdraw(epoch), f"withdraw-round-{epoch}")
        if parts.membership is not None:  # they answered, and averaged: members, for a while
            parts.membership.met(result.contributors)
        parts.tallies.count("averaged" if result.complete else "partial")
        parts.tallies.failures.update(result.failure_kinds.values())
        seconds = asyncio.get_running_loop().time() - started
        sent = result.sent if result.sent is not None else vector
        return Averaged(Outcome.AVERAGED, result=result, group=group, sent=sent, seconds=seconds)

    async def _await_reachability(self) -> None:
        """Before a first round with peers, wait (a little) for this node's reachability verdict:
        a NAT'd node announced as reachable would own a part that nobody can dial."""
        settled = self._parts.reachability.settled
        if settled.is_set() or len(self._parts.directory.peers) < 2 or self._waited:
            return
        self._waited = True  # once: a node nobody can confirm stays "unknown" for good
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.reachability_wait_seconds):
                await settled.wait()

    async def _withdraw_after(self, epoch: int, delay_seconds: float) -> None:
        await asyncio.sleep(delay_seconds)
        await self._withdraw(epoch)

    async def _withdraw(self, epoch: int) -> None:
        await self._parts.directory.withdraw(f"round/{epoch}")
