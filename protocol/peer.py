"""The Peer service: who a node is (GetInfo), dial-back (how a node learns if it is reachable),
and the rendezvous of hole punching.

A node asks a few peers to ``DialBack`` its gRPC port. Each opens a fresh connection to that port
at the address the request came from (so nobody can aim it at a third party), asks ``GetInfo``
there with a random challenge within :data:`DIAL_BACK_TIMEOUT_SECONDS`, and answers whether the
caller's own key signed the answer, and from which address it saw the caller. ``Punch`` starts a
simultaneous open towards the address the call came from (for a call through this node's relay:
the address the relay saw), never towards a host the caller merely names. DialBack and Punch act
for the caller, so they carry its signature (``protocol/auth.py``); both are bounded per node.
Every refusal has its documented status and is counted in ``rejections``.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from swarmgrad.protocol import PROTOCOL_VERSION
from swarmgrad.protocol.addresses import endpoint_of, host_of, is_ipv4, local_endpoint, port_of
from swarmgrad.protocol.auth import Signer, Verifier, sign_request, signed_bytes
from swarmgrad.protocol.errors import (
    PeerUnavailable,
    ProtocolViolation,
    SwarmgradError,
    from_rpc_error,
    quote,
)
from swarmgrad.protocol.keys import peer_id_of, verify_signature
from swarmgrad.protocol.server import Rejections, open_channel, unary
from swarmgrad.protocol.v1 import peer_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

DIAL_BACK_TIMEOUT_SECONDS = 3.0
MAX_DIAL_BACKS = 8  # under way at once, per node
MAX_CHALLENGE_BYTES = 64
MAX_GROUP_ID_BYTES = 32
SERVICE = "swarmgrad.v1.Peer"
_GET_INFO, _DIAL_BACK, _PUNCH = (f"/{SERVICE}/{m}" for m in ("GetInfo", "DialBack", "Punch"))


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerIdentity:
    peer_id: str
    run_id: str
    spec_hash: bytes
    software_version: str
    codecs: tuple[str, ...]


class PunchHandler(Protocol):
    """The node's side of hole punching (``node/reachability/punch.py``)."""

    def can_punch(self) -> bool:
        """Whether this node knows a public address of its own to punch from."""
        ...

    def try_start(self, remote: tuple[str, int], requester: str) -> tuple[str, int] | None:
        """Begin connecting to ``remote`` for the peer ``requester`` (whose signature was
        checked; the links it holds are bounded): this node's public address and punching port,
        or None when too many punches are under way (the check and the start are one step)."""
        ...


#: The address a connection really came from, for one this node's relay client spliced to its
#: gRPC server: given ``host:port`` of the local end gRPC sees, the host the relay saw (or None).
Origin = Callable[[str], str | None]
#: Whether this node has left the round ``(round, group id)``: it finished it or gave up on it,
#: and sends nothing more in it (the averager's registry of rounds).
RoundLeft = Callable[[tuple[int, bytes]], bool]


def _info_fields(
    challenge: bytes,
    info: peer_pb2.PeerInfo,
    run_id: str,
    spec_hash: bytes,
    round_key: tuple[int, bytes] | None,
) -> list[str | bytes | int]:
    fields: list[str | bytes | int] = [challenge, info.peer_id, run_id, spec_hash]
    if info.left_round and round_key is not None:  # signed only when said, as before otherwise
        fields += ["left round", *round_key]
    return fields


def dial_back_fields(request: peer_pb2.DialBackRequest) -> list[str | bytes | int]:
    return [request.run_id, request.spec_hash, request.port, request.peer_id]


def punch_fields(request: peer_pb2.PunchRequest) -> list[str | bytes | int]:
    return [request.run_id, request.spec_hash, request.peer_id, request.host, request.port]


class PeerServicer:
    def __init__(
        self,
        me: PeerIdentity,
        *,
        signer: Signer,
        verifier: Verifier,
        rejections: Rejections | None = None,
        punch: PunchHandler | None = None,
        origin: Origin | None = None,
        round_left: RoundLeft | None = None,
    ) -> None:
        """``round_left``: how GetInfo answers a question about a round (None: never left)."""
        if signer.peer_id != me.peer_id:
            raise ValueError("the Peer service answers with its own node's key")
        self._me, self._signer, self._verifier = me, signer, verifier
        self.rejections = rejections if rejections is not None else Rejections()
        self._punch, self._origin, self._round_left = punch, origin, round_left
        self._dialing = 0
        #: Dial-backs answered, by verdict ("reachable", "unreachable"), and punches started.
        self.dial_backs: dict[str, int] = {"reachable": 0, "unreachable": 0}
        self.punches = 0

    def _relayed(self, context: grpc.aio.ServicerContext[object, object]) -> bool:
        return self._origin is not None and self._origin(local_endpoint(context.peer())) is not None

    def _caller(self, context: grpc.aio.ServicerContext[object, object]) -> str:
        """The host that made this call. A call relayed to this node reaches its server from its
        own relay client (a local address): the caller is the host the relay saw dial, and a
        relayed call whose dialer the relay did not name is refused (dialing or punching towards
        the local address would reach this machine's own sockets)."""
        relayed = self._origin(local_endpoint(context.peer())) if self._origin else None
        if relayed is None:
            return host_of(context.peer())
        if not relayed:
            raise ProtocolViolation(
                ResultCode.WRONG_ADDRESS, "a relayed call from an address the relay did not name"
            )
        return relayed

    def _check_run(self, run_id: str, spec_hash: bytes) -> None:
        if run_id != self._me.run_id or spec_hash != self._me.spec_hash:
            raise ProtocolViolation(
                ResultCode.WRONG_RUN,
                f"this peer trains run {self._me.run_id} spec {self._me.spec_hash.hex()[:12]}",
            )

    async def GetInfo(
        self, request: peer_pb2.GetInfoRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> peer_pb2.PeerInfo:
        self._check_run(request.run_id, request.spec_hash)
        if len(request.challenge) > MAX_CHALLENGE_BYTES:
            raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "a challenge over 64 bytes")
        if len(request.group_id) > MAX_GROUP_ID_BYTES:
            raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "a group id over 32 bytes")
        round_key = (request.round, request.group_id) if request.group_id else None
        info = peer_pb2.PeerInfo(
            protocol_version=PROTOCOL_VERSION,
            peer_id=self._me.peer_id,
            software_version=self._me.software_version,
            codecs=list(self._me.codecs),
            public_key=self._signer.public_key,
            left_round=round_key is not None
            and self._round_left is not None
            and self._round_left(round_key),
        )
        if request.challenge:
            fields = _info_fields(
                request.challenge, info, self._me.run_id, self._me.spec_hash, round_key
            )
            info.signature = self._signer.sign(signed_bytes(_GET_INFO, info.peer_id, fields))
        return info

    async def DialBack(
        self, request: peer_pb2.DialBackRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> peer_pb2.DialBackReply:
        self._check_run(request.run_id, request.spec_hash)
        host = self._caller(context)
        if not 0 < request.port < 65536 or not host:
            raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "bad port or caller address")
        self._verifier.verify(
            _DIAL_BACK,
            request.auth,
            receiver=request.receiver,
            fields=dial_back_fields(request),
            sender=request.peer_id,
        )
        if self._dialing >= MAX_DIAL_BACKS:
            raise ProtocolViolation(ResultCode.OVERLOADED, "too many dial-backs under way")
        self._dialing += 1
        endpoint = endpoint_of(host, request.port)
        # The port the call came from (its NAT's mapping): how callers tell their NAT's kind.
        # A relayed call came from the relay's socket, whose port says nothing about the caller.
        seen_port = 0 if self._relayed(context) else port_of(context.peer())
        try:
            await get_info(
                endpoint,
                run_id=self._me.run_id,
                spec_hash=self._me.spec_hash,
                timeout_seconds=DIAL_BACK_TIMEOUT_SECONDS,
                expected_peer=request.peer_id,
            )
        except SwarmgradError as error:
            self.dial_backs["unreachable"] += 1
            return peer_pb2.DialBackReply(
                reachable=False, observed_host=host, observed_port=seen_port, detail=str(error)
            )
        finally:
            self._dialing -= 1
        self.dial_backs["reachable"] += 1
        return peer_pb2.DialBackReply(reachable=True, observed_host=host, observed_port=seen_port)

    async def Punch(
        self, request: peer_pb2.PunchRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> peer_pb2.PunchReply:
        self._check_run(request.run_id, request.spec_hash)
        if not is_ipv4(request.host) or not 0 < request.port < 65536:
            raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "bad punching address")
        requester = self._verifier.verify(
            _PUNCH,
            request.auth,
            receiver=request.receiver,
            fields=punch_fields(request),
            sender=request.peer_id,
        )
        came_from = self._caller(context)
        if request.host != came_from:
            raise ProtocolViolation(
                ResultCode.WRONG_ADDRESS,
                f"asked to punch towards {quote(request.host)}, but the call came from "
                f"{came_from}: this peer punches only towards its caller",
            )
        punch = self._punch
        if punch is None or not punch.can_punch():
            raise ProtocolViolation(ResultCode.CANNOT_PUNCH, "this peer cannot punch now")
        started = punch.try_start((request.host, request.port), requester)
        if started is None:
            raise ProtocolViolation(ResultCode.OVERLOADED, "too many punches under way")
        self.punches += 1
        return peer_pb2.PunchReply(host=started[0], port=started[1])


def add_to_server(servicer: PeerServicer, server: grpc.aio.Server) -> None:
    def handler(method: Any, parse: Callable[[bytes], Any]) -> grpc.RpcMethodHandler:
        return unary(method, parse=parse, rejections=servicer.rejections, service="Peer")

    handlers = {
        "GetInfo": handler(servicer.GetInfo, peer_pb2.GetInfoRequest.FromString),
        "DialBack": handler(servicer.DialBack, peer_pb2.DialBackRequest.FromString),
        "Punch": handler(servicer.Punch, peer_pb2.PunchRequest.FromString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def _call(
    endpoint: str,
    method: str,
    request: object,
    parse: Callable[[bytes], object],
    timeout_seconds: float,
) -> object:
    """One unary call over a connection of its own (a dial-back must prove that a new
    connection gets through), translated into the error tree."""
    channel = open_channel(endpoint, own_connection=True)
    try:
        call = channel.unary_unary(
            method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=parse,
        )
        return await call(request, timeout=timeout_seconds)
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error, endpoint) from None
    finally:
        await channel.close()


async def get_info(
    endpoint: str,
    *,
    run_id: str,
    spec_hash: bytes,
    timeout_seconds: float,
    expected_peer: str | None = None,
    round_key: tuple[int, bytes] | None = None,
) -> peer_pb2.PeerInfo:
    """Ask ``endpoint`` who it is. With ``expected_peer``, the answer must be signed by that
    peer's key over a fresh challenge (ProtocolViolation otherwise): whoever answers there holds
    the key, not merely knows the id. With ``round_key`` (a round both are in: its number and
    group id), the answer's ``left_round`` says whether the peer has left that round (signed
    with the rest, when it says so)."""
    challenge = secrets.token_bytes(16) if expected_peer is not None else b""
    request = peer_pb2.GetInfoRequest(run_id=run_id, spec_hash=spec_hash, challenge=challenge)
    if round_key is not None:
        request.round, request.group_id = round_key
    info = await _call(endpoint, _GET_INFO, request, peer_pb2.PeerInfo.FromString, timeout_seconds)
    assert isinstance(info, peer_pb2.PeerInfo)
    if expected_peer is None:
        return info
    if info.peer_id != expected_peer:
        raise ProtocolViolation(
            ResultCode.UNAUTHENTICATED,
            f"{endpoint} answered as {quote(info.peer_id)}, not {expected_peer}",
        )
    fields = _info_fields(challenge, info, run_id, spec_hash, round_key)
    try:
        genuine = peer_id_of(info.public_key) == expected_peer and verify_signature(
            info.public_key, info.signature, signed_bytes(_GET_INFO, expected_peer, fields)
        )
    except ValueError:
        genuine = False
    if not genuine:
        raise ProtocolViolation(
            ResultCode.UNAUTHENTICATED, f"{endpoint} could not prove the key of {expected_peer}"
        )
    return info


@dataclass(frozen=True, slots=True)
class DialBack:
    """One helper's answer: was this node reachable on ``port`` at ``observed_host``?"""

    helper: str  # the helper's endpoint
    reachable: bool
    observed_host: str
    detail: str
    #: The port the call came from, as the helper saw it (0: not known, a relayed call).
    observed_port: int = 0


async def ask_dial_back(
    helper: str,
    *,
    signer: Signer,
    helper_id: str,
    port: int,
    run_id: str,
    spec_hash: bytes,
    timeout_seconds: float = DIAL_BACK_TIMEOUT_SECONDS + 2.0,
) -> DialBack:
    """Ask the peer ``helper_id`` at ``helper`` to dial this node (``signer``) back on ``port``;
    raises PeerUnavailable if the helper itself cannot be asked, ProtocolViolation if it
    refuses."""
    request = peer_pb2.DialBackRequest(
        run_id=run_id, spec_hash=spec_hash, port=port, peer_id=signer.peer_id, receiver=helper_id
    )
    request.auth.CopyFrom(sign_request(signer, _DIAL_BACK, helper_id, dial_back_fields(request)))
    reply = await _call(
        helper, _DIAL_BACK, request, peer_pb2.DialBackReply.FromString, timeout_seconds
    )
    assert isinstance(reply, peer_pb2.DialBackReply)
    try:
        ipaddress.ip_address(reply.observed_host)
    except ValueError:
        raise PeerUnavailable(f"{helper} answered with a malformed address") from None
    if reply.observed_port > 65535:
        raise PeerUnavailable(f"{helper} answered with a malformed port") from None
    return DialBack(
        helper, reply.reachable, reply.observed_host, reply.detail[:500], reply.observed_port
    )


async def ask_punch(
    endpoint: str,
    *,
    signer: Signer,
    callee: str,
    host: str,
    port: int,
    run_id: str,
    spec_hash: bytes,
    timeout_seconds: float = 5.0,
) -> tuple[str, int]:
    """Ask the peer ``callee`` at ``endpoint`` (its relayed one) to punch with us (``signer``,
    punching from ``host:port``); its host and port."""
    request = peer_pb2.PunchRequest(
        run_id=run_id,
        spec_hash=spec_hash,
        peer_id=signer.peer_id,
        host=host,
        port=port,
        receiver=callee,
    )
    request.auth.CopyFrom(sign_request(signer, _PUNCH, callee, punch_fields(request)))
    reply = await _call(endpoint, _PUNCH, request, peer_pb2.PunchReply.FromString, timeout_seconds)
    assert isinstance(reply, peer_pb2.PunchReply)
    if not is_ipv4(reply.host) or not 0 < reply.port < 65536:
        raise PeerUnavailable(f"{endpoint} answered a punch with a bad address")
    return reply.host, reply.port
