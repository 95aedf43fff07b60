"""What one hostile address can hold of a node's gRPC server (``protocol/server.py``'s
``Admission``), on real servers on 127.0.0.1, where the flooder shares its address with every
honest peer: silent streams and silent unary calls are pushed out or cut, GetInfo and a real
4-member all-reduce go on during a flood, and a private run's Check refuses strangers first."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.averaging.allreduce import AllReduceConfig
from swarmgrad.node.averaging.averager import Averager, transport_limits
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.identity import Identity
from swarmgrad.node.transport.transport import Transport, TransportConfig
from swarmgrad.protocol import peer
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.averaging import (
    CHECK_STATEMENT,
    StreamHeader,
    aggregate_method,
    check_method,
    header_to_proto,
    seal,
)
from swarmgrad.protocol.errors import BindError, PeerUnavailable, ProtocolViolation
from swarmgrad.protocol.server import ServerLimits, open_channel
from swarmgrad.protocol.tensors import meta_to_proto
from swarmgrad.protocol.v1 import averaging_pb2

FLOODER = Path(__file__).with_name("grpc_flooder.py")
#: 600 silent calls at once (more than the server's 512 slots) from 6 connections, then 400 a
#: second: the finding's flooder reopened 552 as they timed out, about 110 a second.
FLOOD = ("--width", "600", "--channels", "6", "--rate", "400")
RUN, SPEC = "limits", b"\x02" * 32
CONFIG = AllReduceConfig(
    run_id=RUN,
    spec_hash=SPEC,
    codec="int8",
    chunk_values=4096,
    sender_timeout_seconds=6.0,
    reducer_timeout_seconds=12.0,
    round_timeout_seconds=30.0,
    # Long enough that a message parked for a round that never comes is plain to see.
    join_timeout_seconds=5.0,
)
SIZE = 4 * 4096 + 123


@functools.cache
def ident(name: str) -> Identity:
    return Identity.from_seed(f"test-grpc-limits/{name}")


def vector(seed: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(seed))


@contextlib.asynccontextmanager
async def node(
    name: str,
    *,
    admit: Callable[[str], bool] | None = None,
    limits: ServerLimits | None = None,
) -> AsyncIterator[tuple[Averager, Transport]]:
    """A node's transport serving Peer and Averaging (as a swarm's does), its Averager."""
    identity = ident(name)
    transport = Transport(TransportConfig(limits=limits or transport_limits(CONFIG)))
    verifier = Verifier(identity.peer_id, admit=admit)
    me = peer.PeerIdentity(
        peer_id=identity.peer_id,
        run_id=RUN,
        spec_hash=SPEC,
        software_version="test",
        codecs=("int8",),
    )
    servicer = peer.PeerServicer(me, signer=identity, verifier=verifier)
    transport.register(lambda server: peer.add_to_server(servicer, server))
    averager = Averager(identity, CONFIG, transport, verifier=verifier)
    async with averager, transport:
        yield averager, transport


class Flood:
    """``grpc_flooder.py`` at ``endpoint``, in a process of its own (as a remote flooder)."""

    def __init__(self, endpoint: str, *args: str) -> None:
        self._argv = [sys.executable, str(FLOODER), endpoint, *args]
        self._process: asyncio.subprocess.Process | None = None
        #: What the flooder saw of its calls (its JSON line), once it stopped.
        self.summary: dict[str, Any] = {}

    async def __aenter__(self) -> Flood:
        self._process = await asyncio.create_subprocess_exec(
            *self._argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        assert self._process.stdout is not None
        async with asyncio.timeout(30):
            line = await self._process.stdout.readline()
        assert line == b"flooding\n", line
        return self

    async def stop(self) -> None:
        """End the flood; its summary."""
        process = self._process
        assert process is not None
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.write(b"stop\n")
        await process.stdin.drain()
        async with asyncio.timeout(30):
            self.summary = json.loads(await process.stdout.readline())
            await process.wait()

    async def __aexit__(self, *exc_info: object) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self._process.wait()


async def get_infos(endpoint: str, count: int) -> Counter[str]:
    """``count`` GetInfo calls, one after another: how each went."""
    outcomes: Counter[str] = Counter()
    for _ in range(count):
        try:
            # A deadline for a busy test machine: a starved server refuses at once, whatever it is.
            await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
            outcomes["OK"] += 1
        except (ProtocolViolation, PeerUnavailable) as error:
            outcomes[str(error)[:80]] += 1
    return outcomes


def check_flood_refused_quickly(flood: Flood, transport: Transport) -> None:
    """The flooder's calls were pushed out (OVERLOADED), each before the server's first-message
    deadline had passed for it, and none was served or held a call slot for long (seen from
    the flooder, a call's time includes its wait in the flooder's own queue of 600)."""
    summary = flood.summary
    statuses = summary["statuses"]
    assert "OK" not in statuses, summary
    assert statuses.get("RESOURCE_EXHAUSTED", 0) > 0.9 * sum(statuses.values()), summary
    assert summary["overloaded"] == statuses["RESOURCE_EXHAUSTED"], summary
    assert summary["longest_seconds"] < transport.limits.header_timeout_seconds + 3.0, summary


async def test_a_flood_of_silent_streams_starves_neither_get_info_nor_a_4_member_round() -> None:
    names = ["a", "b", "c", "d"]
    async with contextlib.AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(node(n)) for n in names]
        target, transport = nodes[0]
        group = Group(
            round=1,
            members=tuple(
                Member(peer_id=averager.peer_id, endpoint=averager.endpoint, bandwidth=1.0)
                for averager, _ in nodes
            ),
        )
        # More silent streams than the server has call slots (512), from 6 connections of one
        # address (every honest peer's here too): they used to hold every slot, and GetInfo
        # failed 10 times out of 10 (RESOURCE_EXHAUSTED), as did the round's streams.
        async with Flood(target.endpoint, *FLOOD) as flood:
            rounds = asyncio.gather(
                *(averager.all_reduce(vector(i), group) for i, (averager, _) in enumerate(nodes))
            )
            assert await get_infos(target.endpoint, 10) == {"OK": 10}
            results = await rounds
            waiting = transport.admission.waiting("127.0.0.1")  # still flooded
            await flood.stop()
        for result in results:
            assert sorted(result.contributors) == sorted(a.peer_id for a, _ in nodes)
            assert result.missing == ()
            assert result.partial == ()
        assert all(torch.equal(results[0].averaged, r.averaged) for r in results)
        assert waiting > transport.limits.max_unauthenticated_per_address // 2
        check_flood_refused_quickly(flood, transport)
        # Once the flooder is gone, so is everything it held.
        async with asyncio.timeout(10):
            while transport.admission.in_flight or transport.admission.waiting("127.0.0.1"):  # noqa: ASYNC110 - server state
                await asyncio.sleep(0.02)


async def test_silent_unary_calls_are_cut_and_pushed_out() -> None:
    async with node("a") as (target, transport):
        # A unary call whose request never comes: gRPC itself waits for it until the caller's
        # own deadline (here 60 s), holding a call slot all along.
        method = f"/{peer.SERVICE}/GetInfo"
        async with Flood(target.endpoint, *FLOOD, "--unary", "--method", method) as flood:
            assert await get_infos(target.endpoint, 10) == {"OK": 10}
            await flood.stop()
        check_flood_refused_quickly(flood, transport)


async def test_one_address_holds_at_most_its_share_of_calls() -> None:
    # A burst of 16 streams may all wait for their headers at once: none is pushed out here.
    limits = replace(
        transport_limits(CONFIG), max_rpcs_per_address=16, max_unauthenticated_per_address=16
    )
    async with node("a", limits=limits) as (target, transport):
        # Authenticated streams for a round that has not started wait for it (join timeout),
        # each in flight: from as many members' keys, within every per-key limit.
        senders = [f"m{i}" for i in range(16)]
        group = Group(
            round=7,
            members=(
                Member(peer_id=target.peer_id, endpoint=target.endpoint, bandwidth=1.0),
                *(Member(peer_id=ident(s).peer_id, endpoint="127.0.0.1:9") for s in senders),
            ),
        )
        channel = open_channel(target.endpoint, own_connection=True)
        parked = [
            asyncio.create_task(_one_stream(channel, [header(group, s, target)])) for s in senders
        ]
        try:
            async with asyncio.timeout(10):
                while transport.admission.in_flight["127.0.0.1"] < 16:  # noqa: ASYNC110 - server state
                    await asyncio.sleep(0.02)
            [(refused, _)] = (await get_infos(target.endpoint, 1)).items()
            assert "OVERLOADED: 16 calls from 127.0.0.1" in refused, refused
        finally:
            for task in parked:
                task.cancel()
            await asyncio.gather(*parked, return_exceptions=True)
            await channel.close()
        async with asyncio.timeout(10):
            while transport.admission.in_flight:  # noqa: ASYNC110 - server state
                await asyncio.sleep(0.02)
        assert await get_infos(target.endpoint, 1) == {"OK": 1}
        assert transport.admission.rejections.by_code("Peer") == {"OVERLOADED": 1}


def header(group: Group, sender: str, owner: Averager) -> averaging_pb2.AggregateRequest:
    """``sender``'s signed header for ``owner``'s part of ``group``'s round."""
    part = [m.peer_id for m in group.members].index(owner.peer_id)
    return header_to_proto(
        StreamHeader(
            run_id=RUN,
            spec_hash=SPEC,
            round=group.round,
            group_id=group.group_id,
            sender=ident(sender).peer_id,
            receiver=owner.peer_id,
            part=part,
            weight=1.0,
        ),
        ident(sender),
    )


async def _one_stream(channel: grpc.aio.Channel, messages: list[Any]) -> tuple[str, str]:
    """Send ``messages`` on one Aggregate stream: its status name and details."""
    try:
        async for _ in aggregate_method(channel)(iter(messages), timeout=30):
            pass
    except grpc.aio.AioRpcError as error:
        return error.code().name, error.details() or ""
    return "OK", ""


async def test_a_huge_codec_name_is_refused_as_bad_codec_with_a_short_detail() -> None:
    async with node("a") as (owner, _), node("b") as (honest, _):
        group = Group(
            round=3,
            members=(
                Member(peer_id=owner.peer_id, endpoint=owner.endpoint, bandwidth=1.0),
                Member(peer_id=honest.peer_id, endpoint=honest.endpoint, bandwidth=0.0),
                Member(peer_id=ident("evil").peer_id, endpoint="127.0.0.1:9", bandwidth=0.0),
            ),
        )
        rounds = asyncio.gather(
            owner.all_reduce(vector(1), group), honest.all_reduce(vector(2), group)
        )
        payload, meta = get_codec("int8").encode(vector(3)[:4096])
        chunk = averaging_pb2.Chunk(index=0, meta=meta_to_proto(meta), payload=payload)
        chunk.meta.codec = "z" * 100_000
        channel = open_channel(owner.endpoint, own_connection=True)
        try:
            status, details = await _one_stream(
                channel, [header(group, "evil", owner), averaging_pb2.AggregateRequest(chunk=chunk)]
            )
        finally:
            await channel.close()
        assert status == "INVALID_ARGUMENT", (status, details[:200])
        assert details.startswith("BAD_CODEC"), details[:200]
        assert len(details) < 200, len(details)
        for result in await rounds:  # the evil member's part is missing; the others average
            assert sorted(result.contributors) == sorted([owner.peer_id, honest.peer_id])


async def test_a_private_runs_check_refuses_a_stranger_before_anything_else() -> None:
    allowed = {ident("a").peer_id, ident("member").peer_id}
    async with node("a", admit=allowed.__contains__) as (target, _):
        channel = open_channel(target.endpoint, own_connection=True)
        call = check_method(channel)

        def statement(sender: str, run_id: str = RUN) -> averaging_pb2.Signed:
            key = averaging_pb2.RoundKey(run_id=run_id, spec_hash=SPEC, round=5, group_id=b"g")
            body = averaging_pb2.CheckStatement(
                key=key, sender=ident(sender).peer_id, reveal=averaging_pb2.Reveal()
            )
            return seal(ident(sender), CHECK_STATEMENT, body)

        async def status_of(signed: averaging_pb2.Signed) -> tuple[str, str, float]:
            started = time.monotonic()
            try:
                await call(signed, timeout=30)
            except grpc.aio.AioRpcError as error:
                return error.code().name, error.details() or "", time.monotonic() - started
            return "OK", "", time.monotonic() - started

        try:
            # A stranger's message for a round that may still come: refused at once, not
            # parked in a slot for the join timeout (5 s here) as a member's would be.
            code, details, seconds = await status_of(statement("stranger"))
            assert (code, details.split(":")[0]) == ("PERMISSION_DENIED", "NOT_ALLOWED"), details
            assert seconds < 2.0, seconds
            # An allowed member gets past the gate (and is told its run is another).
            code, details, _ = await status_of(statement("member", run_id="other"))
            assert (code, details.split(":")[0]) == ("FAILED_PRECONDITION", "WRONG_RUN"), details
        finally:
            await channel.close()
        assert target.servicer.rejections.by_code("Averaging") == {
            "NOT_ALLOWED": 1,
            "WRONG_RUN": 1,
        }


async def test_a_port_another_server_holds_is_refused_not_shared() -> None:
    """gRPC binds with SO_REUSEPORT unless told not to: a second node on a taken port started
    without a word and the two shared its connections (issue 46). Now it is a BindError, and a
    plain gRPC server (SO_REUSEPORT on, as other programs may set it) is refused the port too."""
    first = Transport(TransportConfig())
    async with first:
        with pytest.raises(BindError, match="in use"):
            async with Transport(TransportConfig(port=first.port)):
                pass
        with pytest.raises(RuntimeError):
            grpc.aio.server().add_insecure_port(f"127.0.0.1:{first.port}")
