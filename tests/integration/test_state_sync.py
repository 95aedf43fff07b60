"""State download from several donors at once (real gRPC servers on 127.0.0.1:0, then real donor
processes found through the DHT): every chunk is checked against the manifest, and a donor that
lies, serves a corrupt chunk, dies mid-stream or no longer holds the state costs a retry from the
others, never a corrupt state. (Who a donor serves: test_state_serving.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from swarmgrad.node import Swarm, SwarmConfig
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.download import Download, download
from swarmgrad.protocol import state
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.errors import PeerUnavailable, ProtocolViolation
from swarmgrad.protocol.server import open_channel, start_server
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode
from swarmgrad.simulations.swarm import DEMO_SPEC
from tests.integration.state_donors import (
    CHUNK_VALUES,
    JOINER,
    NUM_VALUES,
    RUN,
    SPEC_HASH,
    TRUE,
    Donors,
    donors_fixture,  # noqa: F401  (the fixture donors)
)
from tests.integration.state_donors import random_snapshot as _snapshot


async def _download(donors: list[tuple[str, grpc.aio.Channel]]) -> Download:
    return await download(
        donors,
        signer=JOINER,
        run_id=RUN,
        spec_hash=SPEC_HASH,
        root=TRUE.checksum,
        num_values=NUM_VALUES,
        timeout_seconds=10,
    )


def _corrupt_chunk(index: int) -> state.Snapshot:
    """The true state's manifest, with one value of one chunk changed."""
    values = TRUE.values.clone()
    values[index * CHUNK_VALUES + 5] += 1e-3
    return dataclasses.replace(TRUE, values=values)


async def test_chunks_come_from_every_donor_and_the_state_is_exact(donors: Donors) -> None:
    result = await _download([await donors.add(n) for n in "abc"])
    assert torch.equal(result.snapshot.values, TRUE.values)
    assert (result.snapshot.epoch, result.snapshot.checksum) == (7, TRUE.checksum)
    assert sum(result.chunks_by_donor.values()) == 20
    assert set(result.chunks_by_donor) == {"a", "b", "c"}  # the work was shared
    assert result.failures == {}


async def test_a_donor_serving_a_corrupt_chunk_is_dropped_and_its_chunks_refetched(
    donors: Donors,
) -> None:
    bad = await donors.add("bad", _corrupt_chunk(1))  # asked first: its range holds chunk 1
    result = await _download([bad, await donors.add("good")])
    assert torch.equal(result.snapshot.values, TRUE.values)
    assert "chunk 1 is not the manifest's" in result.failures["bad"]
    # Chunk 0 was good and is kept; its other stream may finish the range it holds, no more.
    assert 1 <= result.chunks_by_donor["bad"] <= 1 + state.CHUNKS_PER_REQUEST


async def test_a_lying_manifest_a_dying_donor_and_a_stale_one_cost_only_retries(
    donors: Donors,
) -> None:
    liar = await donors.add("liar", _snapshot(seed=1))  # another state, under the asked root
    served = 0

    async def die_after_two_chunks(num_bytes: int) -> None:
        nonlocal served
        served += 1
        if served > 2:
            raise RuntimeError("the donor's process died")

    dying = await donors.add("dying", pace=die_after_two_chunks)
    stale = await donors.add("stale", snapshot=None)  # moved on: no longer serves the root
    result = await _download([liar, dying, stale, await donors.add("good")])
    assert torch.equal(result.snapshot.values, TRUE.values)
    assert "a manifest that is not state" in result.failures["liar"]
    assert "dying" in result.failures
    assert result.chunks_by_donor.get("dying", 0) <= 2
    assert "UNKNOWN_STATE" in result.failures["stale"]
    assert result.chunks_by_donor["good"] >= 20 - 2


async def test_no_honest_donor_means_an_error_not_a_state(donors: Donors) -> None:
    with pytest.raises(PeerUnavailable, match="chunks could not be downloaded") as raised:
        await _download([await donors.add("bad", _corrupt_chunk(0))])
    assert "chunk 0 is not the manifest's" in str(raised.value)
    with pytest.raises(PeerUnavailable, match="no donor gave the manifest"):
        await _download([await donors.add("stale", snapshot=None)])


async def test_a_state_of_another_size_or_run_is_refused(donors: Donors) -> None:
    name, channel = await donors.add("a")
    with pytest.raises(PeerUnavailable, match="offers 20000 values, the model has 100"):
        await download(
            [(name, channel)],
            signer=JOINER,
            run_id=RUN,
            spec_hash=SPEC_HASH,
            root=TRUE.checksum,
            num_values=100,
            timeout_seconds=10,
        )
    with pytest.raises(PeerUnavailable, match="WRONG_RUN"):
        await download(
            [(name, channel)],
            signer=JOINER,
            run_id="other",
            spec_hash=SPEC_HASH,
            root=TRUE.checksum,
            num_values=NUM_VALUES,
            timeout_seconds=10,
        )


async def test_nan_in_an_agreed_state_is_refused(donors: Donors) -> None:
    values = TRUE.values.clone()
    values[3] = float("nan")
    poisoned = state.Snapshot.of(7, values, chunk_values=CHUNK_VALUES)
    servicer = state.StateServicer(
        run_id=RUN, spec_hash=SPEC_HASH, lookup=lambda root: poisoned, verifier=Verifier("nan")
    )
    server, port = await start_server(lambda s: state.add_to_server(servicer, s))
    donors.servers.append(server)
    channel = open_channel(f"127.0.0.1:{port}")
    donors.channels.append(channel)
    with pytest.raises(ProtocolViolation) as raised:
        await download(
            [("nan", channel)],
            signer=JOINER,
            run_id=RUN,
            spec_hash=SPEC_HASH,
            root=poisoned.checksum,
            num_values=NUM_VALUES,
            timeout_seconds=10,
        )
    assert raised.value.code == ResultCode.NON_FINITE


async def test_a_finite_state_whose_sum_overflows_is_accepted(donors: Donors) -> None:
    values = torch.full((NUM_VALUES,), 3e38)  # finite values; their fp32 sum is inf
    huge = state.Snapshot.of(7, values, chunk_values=CHUNK_VALUES)
    servicer = state.StateServicer(
        run_id=RUN, spec_hash=SPEC_HASH, lookup=lambda root: huge, verifier=Verifier("huge")
    )
    server, port = await start_server(lambda s: state.add_to_server(servicer, s))
    donors.servers.append(server)
    channel = open_channel(f"127.0.0.1:{port}")
    donors.channels.append(channel)
    result = await download(
        [("huge", channel)],
        signer=JOINER,
        run_id=RUN,
        spec_hash=SPEC_HASH,
        root=huge.checksum,
        num_values=NUM_VALUES,
        timeout_seconds=10,
    )
    assert torch.equal(result.snapshot.values, values)


class _Garbler(state.StateServicer):
    """Serves bytes that are no StateChunk (a length running past the message's end)."""

    async def Download(self, request: Any, context: Any) -> AsyncIterator[bytes]:
        yield b"\x08\x00\x12\xff\x01abc"


async def test_a_donor_sending_malformed_chunks_is_dropped(donors: Donors) -> None:
    garbler = _Garbler(
        run_id=RUN, spec_hash=SPEC_HASH, lookup=lambda root: TRUE, verifier=Verifier("garbler")
    )
    server, port = await start_server(lambda s: state.add_to_server(garbler, s))
    donors.servers.append(server)
    channel = open_channel(f"127.0.0.1:{port}")
    donors.channels.append(channel)
    result = await _download([("garbler", channel), await donors.add("good")])
    assert torch.equal(result.snapshot.values, TRUE.values)
    assert "a malformed chunk" in result.failures["garbler"]
    assert "garbler" not in result.chunks_by_donor


@pytest.mark.slow
async def test_a_run_with_small_averaging_chunks_still_serves_its_state() -> None:
    # The transport's message limit once followed [averaging] chunk_values alone: below ~115k
    # values it was smaller than a 1 MiB state chunk, and every download failed.
    spec = RunSpec.from_toml(
        DEMO_SPEC.replace('codec = "int8"', 'codec = "int8"\nchunk_values = 4096')
    )
    values = torch.randn(3 * state.CHUNK_VALUES, generator=torch.Generator().manual_seed(3))
    async with Swarm(spec, Identity.generate(), SwarmConfig()) as donor:
        donor.publish(state.Snapshot.of(4, values), throughput=1.0)
        bootstrap = tuple(donor.visible_maddrs())
        async with Swarm(spec, Identity.generate(), SwarmConfig(bootstrap=bootstrap)) as joiner:
            async with asyncio.timeout(30):
                while not (donors := await joiner.find_donors(0, "")):  # noqa: ASYNC110 - DHT
                    await asyncio.sleep(0.2)
            got = await joiner.download_state(donors, values.numel())
    assert got is not None
    assert torch.equal(got.values, values)
    assert got.epoch == 4


# -- across processes: donors and a joiner, each its own process, found through the DHT ---------


async def _peer(tmp_path: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "swarmgrad.simulations.state_peer",
        "--run-spec",
        str(tmp_path / "run.toml"),
        "--values",
        str(DONOR_VALUES),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _line(process: asyncio.subprocess.Process) -> dict[str, Any]:
    assert process.stdout is not None
    async with asyncio.timeout(120):
        while line := await process.stdout.readline():
            if line.startswith(b"{"):
                return dict(json.loads(line))
    raise AssertionError(f"the process exited with {await process.wait()}")


DONOR_VALUES = 3_000_000  # 12 MB: 12 chunks


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_joiner_catches_a_corrupt_donor_process_and_ends_correct(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('[run]\nid = "donors"\n')
    started: list[asyncio.subprocess.Process] = []
    try:
        started.append(await _peer(tmp_path, "--corrupt-chunk", "0"))  # lies from chunk 0 on
        liar = await _line(started[0])
        for _ in range(2):
            started.append(await _peer(tmp_path, "--bootstrap", *liar["maddrs"]))
        for donor in started[1:]:
            assert (await _line(donor))["checksum"] == liar["checksum"]
        # The joiner asks the liar first, so that the liar is given chunks to serve.
        started.append(
            await _peer(
                tmp_path, "--join", "3", "--first", liar["endpoint"], "--bootstrap", *liar["maddrs"]
            )
        )
        result = await _line(started[-1])
    finally:
        for process in started:
            if process.stdin is not None:
                process.stdin.close()
        for process in started:
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
    assert result["exact"]  # every value of the known state, none of the liar's
    assert result["epoch"] == 5
    assert result["failures"] == {"state_download": 1}  # the liar, dropped; not the download
