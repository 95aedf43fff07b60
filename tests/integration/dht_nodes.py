"""Real hivemind DHT nodes on 127.0.0.1 for tests: a bootstrap node and peers joined through it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from swarmgrad.node.discovery.hivemind_dht import HivemindDiscovery
from swarmgrad.node.discovery.start import DiscoveryConfig
from swarmgrad.node.identity import Identity


@contextlib.asynccontextmanager
async def hivemind_nodes(
    n: int, *, run_id: str, spec_hash: bytes
) -> AsyncIterator[list[tuple[Identity, HivemindDiscovery]]]:
    """``n`` DHT nodes of one run and spec, each with a new identity; the first bootstraps the
    others. All are closed on exit."""
    ids = [Identity.generate() for _ in range(n)]
    nodes: list[tuple[Identity, HivemindDiscovery]] = []
    try:
        boot = await HivemindDiscovery.start(
            ids[0], DiscoveryConfig(), run_id=run_id, spec_hash=spec_hash
        )
        nodes.append((ids[0], boot))
        config = DiscoveryConfig(initial_peers=tuple(boot.visible_maddrs()))
        for identity in ids[1:]:
            node = await HivemindDiscovery.start(
                identity, config, run_id=run_id, spec_hash=spec_hash
            )
            nodes.append((identity, node))
        yield nodes
    finally:
        for _, node in nodes:
            await node.close()
