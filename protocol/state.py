"""The State service: a peer serves its replicated state; a node that fell behind downloads it.

The state is one flat fp32 vector (the trainer decides what is in it) and the epoch it belongs to.
A donor streams a header, then the values in chunks. The receiver knows how many values the run's
model implies and what checksum the donor announced, and accepts the download only if the count,
every chunk's size, the values' finiteness and the checksum all match: a buggy or hostile donor
can waste a deadline, never plant a state.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from swarmgrad.protocol.errors import PeerUnavailable, ProtocolViolation, from_rpc_error
from swarmgrad.protocol.v1 import state_pb2, state_pb2_grpc
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

CHUNK_VALUES = 1 << 18  # 1 MiB of fp32 a message


def checksum(values: torch.Tensor) -> str:
    """Fingerprint of a flat fp32 state vector (16 hex digits), as announced in peer records."""
    data = values.detach().contiguous().cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A state as published by its trainer: never mutated after publication."""

    epoch: int
    values: torch.Tensor  # flat fp32, CPU
    checksum: str


class StateServicer(state_pb2_grpc.StateServicer):
    def __init__(
        self, *, run_id: str, spec_hash: bytes, snapshot: Callable[[], Snapshot | None]
    ) -> None:
        self._run_id, self._spec_hash = run_id, spec_hash
        self._snapshot = snapshot
        #: Downloads served in full, and the payload bytes sent.
        self.served = 0
        self.sent_bytes = 0

    async def Download(
        self,
        request: state_pb2.StateRequest,
        context: grpc.aio.ServicerContext[state_pb2.StateRequest, state_pb2.StateChunk],
    ) -> AsyncIterator[state_pb2.StateChunk]:
        if request.run_id != self._run_id or request.spec_hash != self._spec_hash:
            violation = ProtocolViolation(
                ResultCode.WRONG_RUN,
                f"this node serves run {self._run_id!r} spec {self._spec_hash.hex()[:12]}",
            )
            await context.abort(violation.status, str(violation))
        snapshot = self._snapshot()
        if snapshot is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no state to serve yet")
            return
        header = state_pb2.StateHeader(
            epoch=snapshot.epoch, num_values=snapshot.values.numel(), checksum=snapshot.checksum
        )
        yield state_pb2.StateChunk(header=header)
        values = snapshot.values
        for start in range(0, values.numel(), CHUNK_VALUES):
            chunk = values[start : start + CHUNK_VALUES].numpy().tobytes()
            yield state_pb2.StateChunk(values=chunk)
            self.sent_bytes += len(chunk)
        self.served += 1


def add_to_server(servicer: StateServicer, server: grpc.aio.Server) -> None:
    state_pb2_grpc.add_StateServicer_to_server(servicer, server)


async def download(
    channel: grpc.aio.Channel,
    *,
    peer: str,
    run_id: str,
    spec_hash: bytes,
    num_values: int,
    expected_checksum: str,
    timeout_seconds: float,
) -> Snapshot:
    """Download ``peer``'s state; raises PeerUnavailable or ProtocolViolation if it is not valid."""
    stub = state_pb2_grpc.StateStub(channel)
    request = state_pb2.StateRequest(run_id=run_id, spec_hash=spec_hash)
    values = torch.empty(num_values, dtype=torch.float32)
    target = values.numpy()
    filled = 0  # values so far
    header: state_pb2.StateHeader | None = None
    try:
        async for message in stub.Download(request, timeout=timeout_seconds):
            if header is None:
                if message.WhichOneof("body") != "header":
                    raise _bad(peer, "the download does not open with a header")
                header = message.header
                if header.num_values != num_values:
                    raise ProtocolViolation(
                        ResultCode.BAD_SHAPE,
                        f"{peer} offers {header.num_values} values, the model has {num_values}",
                    )
                if header.checksum != expected_checksum:
                    raise _bad(peer, "the offered state is not the one its record announced")
                continue
            if message.WhichOneof("body") != "values":
                raise _bad(peer, "a second header")
            chunk = message.values
            count = len(chunk) // 4
            if len(chunk) % 4 or filled + count > num_values:
                raise ProtocolViolation(
                    ResultCode.TOO_LARGE, f"{peer} sent more or other than {num_values} values"
                )
            target[filled : filled + count] = np.frombuffer(chunk, dtype="<f4")
            filled += count
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error, peer) from None
    if header is None or filled != num_values:
        raise PeerUnavailable(f"{peer} ended the download early ({filled}/{num_values} values)")
    if not bool(torch.isfinite(values).all()):
        raise ProtocolViolation(ResultCode.NON_FINITE, f"{peer} sent a state with NaN or Inf")
    if checksum(values) != expected_checksum:
        raise _bad(peer, "the state does not match its checksum")
    return Snapshot(epoch=header.epoch, values=values, checksum=expected_checksum)


def _bad(peer: str, what: str) -> ProtocolViolation:
    return ProtocolViolation(ResultCode.BAD_PAYLOAD, f"{peer}: {what}")
