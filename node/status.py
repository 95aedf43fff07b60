"""``swarmgrad status``: a run's peers as the DHT shows them, read by a short-lived DHT node."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.start import start_reader


async def run_peers(
    *,
    bootstrap: Sequence[str],
    run_id: str,
    spec_hash: bytes | None,
    timeout_seconds: float,
    backend: str = "hivemind",
    network_secret: str = "",
) -> list[dict[str, Any]]:
    """One row per peer record of ``run_id`` (of ``spec_hash``, or of every spec in use).

    The reader joins the DHT with a throwaway identity: it announces nothing.
    """
    async with asyncio.timeout(timeout_seconds):
        discovery = await start_reader(
            bootstrap,
            backend=backend,
            network_secret=network_secret,
            timeout_seconds=timeout_seconds,
            run_id=run_id,
            spec_hash=spec_hash or bytes(32),
        )
        try:
            if spec_hash is not None:
                hashes = [spec_hash]
            else:
                hashes = [bytes.fromhex(h) for h in sorted(await discovery.find_specs())]
            rows = []
            for each in hashes:
                now = dht_time()
                for record in await discovery.for_spec(each).find():
                    rows.append(
                        {
                            "peer_id": record.peer_id,
                            "spec": record.spec_hash[:12],
                            "role": record.role,
                            "epoch": record.epoch,
                            "throughput": record.throughput,
                            "endpoint": record.endpoint,
                            "reachability": record.reachability,
                            "via": record.via,
                            "punched": record.punched,
                            "checksum": record.checksum,
                            "last_seen_seconds": max(0.0, now - record.issued_at),
                            "expires_in_seconds": record.expires_at - now,
                        }
                    )
            return rows
        finally:
            await discovery.close()
