"""Shared fixtures: child processes are reaped whatever happens to the test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from swarmgrad.simulations.allreduce_peer import PeerProcess


class Peers:
    """Starts allreduce_peer processes and kills every one of them at teardown."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.started: list[PeerProcess] = []

    async def start(self, peer_id: str, *args: str) -> PeerProcess:
        peer = await PeerProcess.start(peer_id, self.out_dir, *args)
        self.started.append(peer)
        return peer


@pytest_asyncio.fixture
async def peers(tmp_path: Path) -> AsyncIterator[Peers]:
    registry = Peers(tmp_path)
    try:
        yield registry
    finally:
        for peer in registry.started:
            peer.kill()
        for peer in registry.started:
            await peer.process.wait()
