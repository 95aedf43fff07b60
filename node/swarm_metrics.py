"""What a node's Prometheus series read from its :class:`~swarmgrad.node.swarm.Swarm` (the series
themselves are in ``node/metrics.py``; they read these at each scrape)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from swarmgrad.node.kinds import Failure
from swarmgrad.node.scraped import Links

if TYPE_CHECKING:
    from swarmgrad.node.swarm import Swarm


def watch(swarm: Swarm) -> None:
    """Point ``swarm.metrics`` at what it reports: traffic, failures, links, relays, refusals,
    trust (open runs), and the codec's compression ratio (measured once, now)."""
    metrics = swarm.metrics

    def traffic() -> dict[tuple[str, str], int]:
        averaging = swarm.traffic
        return {
            ("sent", "averaging"): averaging["sent"],
            ("received", "averaging"): averaging["received"],
            ("sent", "state"): swarm.state.servicer.sent_bytes,
            ("received", "state"): swarm.state.received_bytes,
        }

    def failures() -> Counter[str]:
        # Streams this node's servicers refused are violations by the peers that sent them.
        return swarm.failures + Counter({Failure.PROTOCOL_VIOLATION: swarm.rejections.total()})

    def links() -> Links:
        return swarm.peer_service.links(swarm.routes, swarm.peers, swarm.peer_id)

    def relayed() -> Counter[str]:
        reachability = swarm.reachability
        relay = reachability.relay_server if reachability is not None else None
        return relay.counts if relay is not None else Counter()

    metrics.read_tallies(traffic=traffic, failures=failures)
    metrics.read_links(links)
    metrics.read_relay(relayed)
    metrics.read_rejections(swarm.rejections.snapshot)
    if swarm.spec.trust.open:
        ledger, checks = swarm.ledger, swarm.owner_checks
        metrics.read_trust(
            lambda: (ledger.table(), (*ledger.counts(), dict(checks), dict(swarm.ban_counts)))
        )
    sample = torch.randn(  # its own generator: the process's random stream is the user's
        min(swarm.spec.averaging.chunk_values, 1 << 16), generator=torch.Generator().manual_seed(0)
    )
    metrics.compression_ratio.set(sample.nbytes / len(swarm.codec.encode(sample)[0]))
