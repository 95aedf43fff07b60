"""Donor servers for the state sync tests: real gRPC servers on 127.0.0.1:0, each serving a
snapshot of one run's state (the true one, by default) to a joiner whose key is fixed; the
fixture ``donors`` stops them at teardown."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest_asyncio
import torch

from swarmgrad.node.identity import Identity
from swarmgrad.protocol import state
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.server import open_channel, start_server

RUN, SPEC_HASH = "r", b"\1" * 32
JOINER = Identity.from_seed("test-state-sync/joiner")
NUM_VALUES, CHUNK_VALUES = 20_000, 1024  # 20 chunks, the last one short


def random_snapshot(seed: int = 0, epoch: int = 7) -> state.Snapshot:
    values = torch.randn(NUM_VALUES, generator=torch.Generator().manual_seed(seed))
    return state.Snapshot.of(epoch, values, chunk_values=CHUNK_VALUES)


TRUE = random_snapshot()


class Donors:
    """Donor servers, each serving what its ``lookup`` returns; stopped at teardown."""

    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []
        self.channels: list[grpc.aio.Channel] = []
        self.servicers: dict[str, state.StateServicer] = {}

    async def add(
        self,
        name: str,
        snapshot: state.Snapshot | None = TRUE,
        pace: Callable[[int], Awaitable[None]] | None = None,
    ) -> tuple[str, grpc.aio.Channel]:
        servicer = state.StateServicer(
            run_id=RUN,
            spec_hash=SPEC_HASH,
            lookup=lambda root: (
                snapshot if snapshot is not None and root == TRUE.checksum else None
            ),
            verifier=Verifier(name),
            pace=pace,
        )
        server, port = await start_server(lambda s: state.add_to_server(servicer, s))
        channel = open_channel(f"127.0.0.1:{port}")
        self.servers.append(server)
        self.channels.append(channel)
        self.servicers[name] = servicer
        return name, channel


@pytest_asyncio.fixture(name="donors")
async def donors_fixture() -> AsyncIterator[Donors]:
    registry = Donors()
    try:
        yield registry
    finally:
        for channel in registry.channels:
            await channel.close()
        for server in registry.servers:
            await server.stop(None)
