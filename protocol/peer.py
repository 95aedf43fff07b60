"""The Peer service: who a node is (GetInfo), and dial-back: how a node learns if it is reachable.

A node asks a few peers to ``DialBack`` its gRPC port. Each opens a fresh connection to that port
at the address the request came from (so nobody can aim it at a third party), asks ``GetInfo``
there within :data:`DIAL_BACK_TIMEOUT_SECONDS`, and answers whether the caller's own peer id
answered, and from which address it saw the caller. Dial-backs under way are bounded per node.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass
from typing import Protocol

import grpc

from swarmgrad.protocol.errors import PeerUnavailable, SwarmgradError, from_rpc_error
from swarmgrad.protocol.server import open_channel
from swarmgrad.protocol.v1 import peer_pb2, peer_pb2_grpc

PROTOCOL_VERSION = 1
DIAL_BACK_TIMEOUT_SECONDS = 3.0
MAX_DIAL_BACKS = 8  # under way at once, per node


def host_of(peer: str) -> str:
    """The address in a gRPC ``context.peer()`` string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return ""


def endpoint_of(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerIdentity:
    peer_id: str
    run_id: str
    spec_hash: bytes
    software_version: str
    codecs: tuple[str, ...]


class PunchHandler(Protocol):
    """The node's side of hole punching (``node/punch.py``)."""

    def can_punch(self) -> bool: ...

    def start(self, remote: tuple[str, int]) -> tuple[str, int]:
        """Begin connecting to ``remote``; this node's public address and punching port."""
        ...


class PeerServicer(peer_pb2_grpc.PeerServicer):
    def __init__(self, me: PeerIdentity) -> None:
        self._me = me
        #: Set by the node once it can punch (it knows its public address).
        self.punch: PunchHandler | None = None
        self._dialing = asyncio.Semaphore(MAX_DIAL_BACKS)
        #: Dial-backs answered, by verdict ("reachable", "unreachable", "refused").
        self.dial_backs: dict[str, int] = {"reachable": 0, "unreachable": 0, "refused": 0}

    async def _check_run(
        self, run_id: str, spec_hash: bytes, context: grpc.aio.ServicerContext[object, object]
    ) -> None:
        if run_id != self._me.run_id or spec_hash != self._me.spec_hash:
            self.dial_backs["refused"] += 1
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"WRONG_RUN: this peer trains run {self._me.run_id} spec "
                f"{self._me.spec_hash.hex()[:12]}",
            )

    async def GetInfo(
        self,
        request: peer_pb2.GetInfoRequest,
        context: grpc.aio.ServicerContext[peer_pb2.GetInfoRequest, peer_pb2.PeerInfo],
    ) -> peer_pb2.PeerInfo:
        await self._check_run(request.run_id, request.spec_hash, context)
        return peer_pb2.PeerInfo(
            protocol_version=PROTOCOL_VERSION,
            peer_id=self._me.peer_id,
            software_version=self._me.software_version,
            codecs=list(self._me.codecs),
        )

    async def DialBack(
        self,
        request: peer_pb2.DialBackRequest,
        context: grpc.aio.ServicerContext[peer_pb2.DialBackRequest, peer_pb2.DialBackReply],
    ) -> peer_pb2.DialBackReply:
        await self._check_run(request.run_id, request.spec_hash, context)
        host = host_of(context.peer())
        if not 0 < request.port < 65536 or not 0 < len(request.peer_id) <= 128 or not host:
            self.dial_backs["refused"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad port, peer id or caller")
        if self._dialing.locked():
            self.dial_backs["refused"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many dial-backs")
        async with self._dialing:
            endpoint = endpoint_of(host, request.port)
            try:
                info = await get_info(
                    endpoint,
                    run_id=self._me.run_id,
                    spec_hash=self._me.spec_hash,
                    timeout_seconds=DIAL_BACK_TIMEOUT_SECONDS,
                )
            except SwarmgradError as error:
                self.dial_backs["unreachable"] += 1
                return peer_pb2.DialBackReply(
                    reachable=False, observed_host=host, detail=str(error)
                )
        if info.peer_id != request.peer_id:
            self.dial_backs["unreachable"] += 1
            return peer_pb2.DialBackReply(
                reachable=False,
                observed_host=host,
                detail=f"{endpoint} answered as {info.peer_id}, not {request.peer_id}",
            )
        self.dial_backs["reachable"] += 1
        return peer_pb2.DialBackReply(reachable=True, observed_host=host)

    async def Punch(
        self,
        request: peer_pb2.PunchRequest,
        context: grpc.aio.ServicerContext[peer_pb2.PunchRequest, peer_pb2.PunchReply],
    ) -> peer_pb2.PunchReply:
        await self._check_run(request.run_id, request.spec_hash, context)
        try:
            address = ipaddress.ip_address(request.host)
        except ValueError:
            address = None
        if address is None or address.version != 4 or not 0 < request.port < 65536:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad punching address")
        punch = self.punch
        if punch is None or not punch.can_punch():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION
                if punch is None
                else grpc.StatusCode.RESOURCE_EXHAUSTED,
                "this peer cannot punch now",
            )
        assert punch is not None  # abort raised otherwise
        host, port = punch.start((request.host, request.port))
        return peer_pb2.PunchReply(host=host, port=port)


def add_to_server(servicer: PeerServicer, server: grpc.aio.Server) -> None:
    peer_pb2_grpc.add_PeerServicer_to_server(servicer, server)


async def get_info(
    endpoint: str, *, run_id: str, spec_hash: bytes, timeout_seconds: float
) -> peer_pb2.PeerInfo:
    """Ask ``endpoint`` who it is, over a connection of its own (never a shared channel: a
    dial-back must prove that a new connection gets through)."""
    channel = open_channel(endpoint)
    try:
        stub = peer_pb2_grpc.PeerStub(channel)
        request = peer_pb2.GetInfoRequest(run_id=run_id, spec_hash=spec_hash)
        info: peer_pb2.PeerInfo = await stub.GetInfo(request, timeout=timeout_seconds)
        return info
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error, endpoint) from None
    finally:
        await channel.close()


@dataclass(frozen=True, slots=True)
class DialBack:
    """One helper's answer: was this node reachable on ``port`` at ``observed_host``?"""

    helper: str  # the helper's endpoint
    reachable: bool
    observed_host: str
    detail: str


async def ask_dial_back(
    helper: str,
    *,
    port: int,
    peer_id: str,
    run_id: str,
    spec_hash: bytes,
    timeout_seconds: float = DIAL_BACK_TIMEOUT_SECONDS + 2.0,
) -> DialBack:
    """Ask the peer at ``helper`` to dial this node back on ``port``; raises PeerUnavailable if
    the helper itself cannot be asked, ProtocolViolation if it refuses."""
    channel = open_channel(helper)
    try:
        stub = peer_pb2_grpc.PeerStub(channel)
        request = peer_pb2.DialBackRequest(
            run_id=run_id, spec_hash=spec_hash, port=port, peer_id=peer_id
        )
        reply: peer_pb2.DialBackReply = await stub.DialBack(request, timeout=timeout_seconds)
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error, helper) from None
    finally:
        await channel.close()
    try:
        ipaddress.ip_address(reply.observed_host)
    except ValueError:
        raise PeerUnavailable(f"{helper} answered with a malformed address") from None
    return DialBack(helper, reply.reachable, reply.observed_host, reply.detail[:500])


async def ask_punch(
    endpoint: str,
    *,
    peer_id: str,
    host: str,
    port: int,
    run_id: str,
    spec_hash: bytes,
    timeout_seconds: float = 5.0,
) -> tuple[str, int]:
    """Ask the peer at ``endpoint`` (its relayed one) to punch with us; its host and port."""
    channel = open_channel(endpoint)
    try:
        stub = peer_pb2_grpc.PeerStub(channel)
        request = peer_pb2.PunchRequest(
            run_id=run_id, spec_hash=spec_hash, peer_id=peer_id, host=host, port=port
        )
        reply: peer_pb2.PunchReply = await stub.Punch(request, timeout=timeout_seconds)
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error, endpoint) from None
    finally:
        await channel.close()
    try:
        address = ipaddress.ip_address(reply.host)
    except ValueError:
        address = None
    if address is None or address.version != 4 or not 0 < reply.port < 65536:
        raise PeerUnavailable(f"{endpoint} answered a punch with a bad address")
    return reply.host, reply.port
