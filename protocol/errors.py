"""swarmgrad's error tree, and the network layer's mapping to gRPC status codes.

::

    SwarmgradError
    +-- PeerUnavailable      a peer could not be reached, hung up, or missed a deadline
    |   +-- DiscoveryError   the DHT did not answer, or took no store (node/discovery/base.py)
    |   +-- RelayError       a relay refused or dropped this node (node/reachability/relay.py)
    |   +-- PortMapError     no router mapped a port (node/reachability/portmap.py)
    +-- ProtocolViolation    a peer sent something invalid; carries a ResultCode
    +-- RoundAborted         a round could not produce a result; the caller's tensors are untouched
    +-- SetupError           this node cannot start as configured; the message says what to fix
        +-- ConfigError, RunSpecError, IdentityError, CheckpointError, DataError,
        |   InitWeightsError, ExportError          (each in its module under node/)
        +-- SpecMismatch     the run's peers train another spec (node/discovery/directory.py)
        +-- BindError        the gRPC server cannot listen where it was told (protocol/server.py)

A failed round is never raised to a trainer: it is an outcome (node/averaging/rounds.py). The
CLI maps the three roots a node's start can raise to its exit codes (node/cli.py). Codecs raise
their own ``CodecError`` (compression/ knows nothing of this tree); the servicer turns it into a
ProtocolViolation.

Errors are translated at the network boundary: a servicer turns a ProtocolViolation into the
status in :data:`STATUS_OF` (with the code's name opening the details), and a client turns a
failed call back into one of the classes above with :func:`from_rpc_error`. Nothing above the
boundary sees a ``grpc.aio.AioRpcError``.
"""

from __future__ import annotations

import grpc

from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

STATUS_OF: dict[int, grpc.StatusCode] = {
    ResultCode.WRONG_RUN: grpc.StatusCode.FAILED_PRECONDITION,
    ResultCode.UNKNOWN_ROUND: grpc.StatusCode.NOT_FOUND,
    ResultCode.NOT_A_MEMBER: grpc.StatusCode.PERMISSION_DENIED,
    ResultCode.BAD_CODEC: grpc.StatusCode.INVALID_ARGUMENT,
    ResultCode.BAD_SHAPE: grpc.StatusCode.INVALID_ARGUMENT,
    ResultCode.BAD_PAYLOAD: grpc.StatusCode.INVALID_ARGUMENT,
    ResultCode.NON_FINITE: grpc.StatusCode.INVALID_ARGUMENT,
    ResultCode.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ResultCode.DUPLICATE_PART: grpc.StatusCode.ALREADY_EXISTS,
    ResultCode.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ResultCode.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ResultCode.ABORTED: grpc.StatusCode.ABORTED,
    ResultCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ResultCode.UNKNOWN_STATE: grpc.StatusCode.NOT_FOUND,
    ResultCode.WRONG_ADDRESS: grpc.StatusCode.PERMISSION_DENIED,
    ResultCode.CANNOT_PUNCH: grpc.StatusCode.FAILED_PRECONDITION,
    ResultCode.BANNED: grpc.StatusCode.PERMISSION_DENIED,
    ResultCode.NOT_ALLOWED: grpc.StatusCode.PERMISSION_DENIED,
    ResultCode.NEED_INPUTS: grpc.StatusCode.FAILED_PRECONDITION,
    ResultCode.STALE_VERSION: grpc.StatusCode.ABORTED,
    ResultCode.DRAINING: grpc.StatusCode.UNAVAILABLE,
    ResultCode.WRONG_STAGE: grpc.StatusCode.FAILED_PRECONDITION,
}

_REJECTION_NAMES = frozenset(ResultCode.Name(code) for code in STATUS_OF)
_UNAVAILABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}


def quote(value: object, limit: int = 40) -> str:
    """A peer's string as an error message may show it: repr'd and cut to ``limit`` characters,
    so what a peer sends is never echoed back or logged at length."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SwarmgradError(Exception):
    """Base of every error swarmgrad raises."""


class SetupError(SwarmgradError):
    """This node cannot start as configured (a file, a setting, a run spec, a key, a
    checkpoint); the message says what to fix."""


class BindError(SetupError, OSError):
    """The gRPC server cannot listen on the address and port it was given (in use, or not an
    address of this machine). An OSError too, as a failed bind is."""


class PeerUnavailable(SwarmgradError):
    """A peer could not be reached, closed the stream, or missed its deadline."""


class RoundAborted(SwarmgradError):
    """A round produced no usable result. The caller's tensors were not modified."""


#: The longest detail a ProtocolViolation keeps. Its text goes back to the peer as a status
#: detail, which gRPC carries in a header of bounded size (a longer one reaches the caller as
#: RESOURCE_EXHAUSTED, its code lost), and into logs: a backstop behind :func:`quote`.
MAX_DETAIL_CHARS = 1000


class ProtocolViolation(SwarmgradError):
    """A peer sent something invalid. ``code`` says what; :attr:`status` is the gRPC status."""

    def __init__(self, code: int, detail: str) -> None:
        if len(detail) > MAX_DETAIL_CHARS:
            detail = detail[: MAX_DETAIL_CHARS - 3] + "..."
        super().__init__(f"{ResultCode.Name(code)}: {detail}")
        self.code = code
        self.detail = detail

    @property
    def status(self) -> grpc.StatusCode:
        return STATUS_OF.get(self.code, grpc.StatusCode.INVALID_ARGUMENT)

    @property
    def code_name(self) -> str:
        return str(ResultCode.Name(self.code))


def from_rpc_error(error: grpc.aio.AioRpcError, peer: str) -> SwarmgradError:
    """The error tree's view of a failed call to ``peer``."""
    status, details = error.code(), error.details() or ""
    name = details.split(":", 1)[0]
    if name in _REJECTION_NAMES:
        return ProtocolViolation(ResultCode.Value(name), f"{peer} says {details}")
    if status in _UNAVAILABLE:
        return PeerUnavailable(f"{peer}: {status.name} {details}".strip())
    return ProtocolViolation(ResultCode.BAD_PAYLOAD, f"{peer} failed with {status.name}: {details}")
