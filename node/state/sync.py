"""State sync: serve what this node published, and catch up from donors when it falls behind.

A trainer publishes its replicated state after every round (:meth:`StateSync.publish`, from
its own thread); the State service serves the last few published states by root, so a download
that began before this node moved on still completes. A replica that is behind the swarm, or at
its epoch with another checksum, picks donors (:func:`pick_donors`: the newest epoch, in open
runs the newest most peers have reached, then the checksum most peers share) and downloads from
several at once, each chunk checked against the signed manifest (``protocol/state.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Failure, Reach
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.scraped import Tallies
from swarmgrad.node.state.download import download
from swarmgrad.node.transport.transport import Transport
from swarmgrad.protocol import state
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.errors import SwarmgradError
from swarmgrad.protocol.server import Rejections

log = logging.getLogger(__name__)

#: Published states served at once (by root).
SERVED_STATES = 3


class RoutePreparer(Protocol):
    """Makes the links to ``peers`` (punched routes to relayed ones) before they are dialed."""

    async def prepare(self, endpoints: Iterable[str], peers: Iterable[PeerRecord]) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSyncConfig:
    #: Bounds each request of a download.
    download_timeout_seconds: float = 60.0
    #: Donors a download draws on at once.
    max_donors: int = 4

    def __post_init__(self) -> None:
        if not self.download_timeout_seconds > 0 or self.max_donors < 1:
            raise ValueError("download_timeout_seconds and max_donors must be positive")


def pick_donors(
    peers: list[PeerRecord], me: str, epoch: int, checksum: str, *, open_run: bool = False
) -> list[PeerRecord]:
    """The peers to resync from (all hold the same state), or none if this replica is in step.

    The swarm's state is the newest epoch any peer announces, and at that epoch the checksum
    most peers share (ties go to the smallest checksum, so every replica picks the same one;
    this replica's own vote counts). A replica behind that epoch, or at it with another
    checksum, downloads the state from the peers that have it.

    In an open run an epoch is a claim anyone can make: one peer announcing epoch 10**6 with a
    state of its own making would be the only donor. There the swarm's epoch is the newest that
    at least half of the other peers have reached (the upper median of their epochs), which a
    minority can neither raise nor lower past the honest peers' range; a replica ahead of it
    stays as it is.
    """
    others = [p for p in peers if p.peer_id != me and p.checksum]
    if not others:
        return []
    if open_run:
        epochs = sorted((p.epoch for p in others), reverse=True)
        newest = epochs[len(epochs) // 2]
        if newest < epoch:
            return []
    else:
        newest = max(epoch, *(p.epoch for p in others))
    votes = Counter(p.checksum for p in others if p.epoch == newest)
    if epoch == newest:
        votes[checksum] += 1
    best = min(votes, key=lambda c: (-votes[c], c))
    if epoch == newest and best == checksum:
        return []
    return [p for p in others if p.epoch == newest and p.checksum == best]


def carries_progress(epoch: int, donor_epoch: int, carry_epochs: int) -> bool:
    """Whether a replica at ``epoch`` that downloads the state of ``donor_epoch`` keeps the
    progress it has not averaged yet (``algorithm.carry_epochs``): that progress was made from
    this replica's state, ``donor_epoch - epoch + 1`` rounds older than the one it goes onto
    (1: a group that averaged apart at the same epoch; 2: one missed round)."""
    return carry_epochs > 0 and donor_epoch - epoch + 1 <= carry_epochs


@dataclass(frozen=True, slots=True, kw_only=True)
class StateParts:
    """What state sync uses of the node: built before it."""

    identity: Identity
    spec: RunSpec
    transport: Transport
    verifier: Verifier
    rejections: Rejections
    tallies: Tallies
    #: Hears each download's duration (a metric).
    observe_seconds: Callable[[float], None] = lambda seconds: None


class StateSync:
    """Registers the State service on the node's transport; publishes, serves and downloads."""

    def __init__(self, parts: StateParts, config: StateSyncConfig) -> None:
        self._parts, self.config = parts, config
        self._snapshot: state.Snapshot | None = None
        self._served: dict[str, state.Snapshot] = {}
        self.received_bytes = 0
        transport = parts.transport
        self.servicer = state.StateServicer(
            run_id=parts.spec.run.id,
            spec_hash=parts.spec.hash,
            lookup=self._served.get,
            verifier=parts.verifier,
            rejections=parts.rejections,
            pace=transport.pace if transport.paced else None,
        )
        transport.register(lambda server: state.add_to_server(self.servicer, server))

    @property
    def snapshot(self) -> state.Snapshot | None:
        """The state this node published last."""
        return self._snapshot

    def publish(self, snapshot: state.Snapshot) -> None:
        """Serve ``snapshot`` from now on (with the last few before it); thread-safe."""
        self._snapshot = snapshot
        self._served[snapshot.checksum] = snapshot
        while len(self._served) > SERVED_STATES:
            del self._served[next(iter(self._served))]

    def find_donors(self, peers: list[PeerRecord], epoch: int, checksum: str) -> list[PeerRecord]:
        """Peers to download state from if this node is behind or diverged (:func:`pick_donors`),
        at most ``max_donors``, in random order (joiners spread over the donors)."""
        parts = self._parts
        donors = pick_donors(
            peers, parts.identity.peer_id, epoch, checksum, open_run=parts.spec.trust.open
        )
        donors = [d for d in donors if d.reachability != Reach.UNREACHABLE]  # nobody can dial them
        random.shuffle(donors)
        return donors[: self.config.max_donors]

    async def download(
        self, donors: list[PeerRecord], num_values: int, *, routes: RoutePreparer
    ) -> state.Snapshot | None:
        """The state ``donors`` announce (all the same checksum), from all of them at once;
        None if it failed (counted and logged)."""
        parts = self._parts
        started = asyncio.get_running_loop().time()
        log.info(
            "downloading state %s (epoch %d) from %d donor(s)",
            donors[0].checksum,
            donors[0].epoch,
            len(donors),
        )
        await routes.prepare([d.endpoint for d in donors], donors)
        try:
            result = await download(
                [(d.peer_id, parts.transport.channel(d.endpoint)) for d in donors],
                signer=parts.identity,
                run_id=parts.spec.run.id,
                spec_hash=parts.spec.hash,
                root=donors[0].checksum,
                num_values=num_values,
                timeout_seconds=self.config.download_timeout_seconds,
            )
        except SwarmgradError as error:
            parts.tallies.failed("state download failed", Failure.STATE_DOWNLOAD)
            log.warning("state download failed: %s", error)
            return None
        for donor, why in result.failures.items():  # survived: others served its chunks
            parts.tallies.failures[Failure.STATE_DOWNLOAD] += 1
            log.warning("state donor %s dropped: %s", donor, why)
        parts.tallies.count("state downloads")
        self.received_bytes += result.snapshot.values.nbytes
        parts.observe_seconds(asyncio.get_running_loop().time() - started)
        return result.snapshot
