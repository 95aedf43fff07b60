"""The State service: peers serve their replicated state, chunk by chunk, against a manifest.

A node that joins or fell behind downloads it from several donors at once, checking every
chunk (the client and its scheduler: ``node/state/download.py``).

A state is one flat fp32 vector (the trainer decides what is in it) and the epoch it belongs to,
cut into chunks of :data:`CHUNK_VALUES`. Its manifest holds a SHA-256 digest per chunk (SHA-256,
not BLAKE2b: with the CPU's SHA extensions it hashes ~1.8 GB/s here, BLAKE2b ~1.2); its *root*, a
digest of the epoch, sizes and chunk digests, is what peer records announce as the state's
checksum. A downloader gets the manifest from any donor and accepts it only if it hashes
to the root most peers announce; then every chunk, from whichever donor, must match its digest.
A donor that lies (a bad manifest or chunk) or fails (an error, a deadline) is dropped and its
remaining chunks go to the others: a bad donor costs a retry, never a corrupt state.

Chunks travel as plain bytes on both ends (``StateChunk``'s encoding written and read by hand,
:mod:`swarmgrad.protocol.framing`): protobuf's own path copied each megabyte three times more.

Donors keep the last few states they published (:class:`StateServicer` looks them up by root),
so a download that started before a donor moved on still completes.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from swarmgrad.protocol.auth import Signer, Verifier, sign_request
from swarmgrad.protocol.errors import (
    ProtocolViolation,
    quote,
)
from swarmgrad.protocol.framing import bytes_message
from swarmgrad.protocol.server import Rejections, unary, unary_stream
from swarmgrad.protocol.v1 import state_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

CHUNK_VALUES = 1 << 18  # 1 MiB of fp32 a chunk
MAX_CHUNK_VALUES = 1 << 22
DIGEST_BYTES = 32
CHUNKS_PER_REQUEST = 4  # a donor's unit of work: small enough to spread, large enough to stream
STREAMS_PER_DONOR = 2  # a second range in flight hides each request's round trip (~1.6x faster)


def chunk_digests(values: torch.Tensor, chunk_values: int = CHUNK_VALUES) -> bytes:
    """The manifest's digests: SHA-256 of each chunk of ``values``, concatenated."""
    data = values.detach().contiguous().cpu().numpy().data.cast("B")
    step = 4 * chunk_values
    return b"".join(
        hashlib.sha256(data[start : start + step]).digest() for start in range(0, len(data), step)
    )


def root_of(epoch: int, num_values: int, chunk_values: int, digests: bytes) -> str:
    """A state's root (16 hex digits): what peer records announce as its checksum."""
    header = np.array([epoch, num_values, chunk_values], dtype="<u8").tobytes()
    return hashlib.sha256(header + digests).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A state as published by its trainer: never mutated after publication."""

    epoch: int
    values: torch.Tensor  # flat fp32, CPU
    checksum: str  # the root
    digests: bytes = field(repr=False)
    chunk_values: int = CHUNK_VALUES

    @classmethod
    def of(cls, epoch: int, values: torch.Tensor, chunk_values: int = CHUNK_VALUES) -> Snapshot:
        digests = chunk_digests(values, chunk_values)
        root = root_of(epoch, values.numel(), chunk_values, digests)
        return cls(epoch, values, root, digests, chunk_values)

    @property
    def num_chunks(self) -> int:
        return len(self.digests) // DIGEST_BYTES


SERVICE = "swarmgrad.v1.State"
#: Request size limit on both ends: a chunk of the largest size a manifest may declare.
MAX_MESSAGE_BYTES = 4 * MAX_CHUNK_VALUES + 1024
DOWNLOAD_METHOD = f"/{SERVICE}/Download"
MANIFEST_METHOD = f"/{SERVICE}/Manifest"


class StateServicer:
    """Serves the states ``lookup`` finds by root to peers whose requests are signed; ``pace``
    (if any) is awaited before each chunk with its size (a token bucket on a slow uplink).

    Refusals (each counted in ``rejections``): a malformed request is INVALID_ARGUMENT, another
    run FAILED_PRECONDITION, an unsigned, stale or replayed request UNAUTHENTICATED, an unknown
    root NOT_FOUND, a chunk range outside the state INVALID_ARGUMENT, and more than
    ``max_downloads_per_peer`` downloads at once from one peer RESOURCE_EXHAUSTED.
    """

    def __init__(
        self,
        *,
        run_id: str,
        spec_hash: bytes,
        lookup: Callable[[str], Snapshot | None],
        verifier: Verifier,
        rejections: Rejections | None = None,
        pace: Callable[[int], Awaitable[None]] | None = None,
        max_downloads_per_peer: int = 2 * STREAMS_PER_DONOR,
    ) -> None:
        self._run_id, self._spec_hash = run_id, spec_hash
        #: Finds a served state by root (replaceable: fault injection serves a lie through it).
        self.lookup = lookup
        self._verifier = verifier
        self.rejections = rejections if rejections is not None else Rejections()
        self._pace = pace
        self._max_downloads = max_downloads_per_peer
        self._downloads: Counter[str] = Counter()
        #: Chunks and payload bytes served.
        self.chunks_served = 0
        self.sent_bytes = 0

    def _snapshot(self, method: str, request: state_pb2.StateRequest) -> tuple[str, Snapshot]:
        """The requesting peer and the state it asks for."""
        if request.run_id != self._run_id or request.spec_hash != self._spec_hash:
            raise ProtocolViolation(
                ResultCode.WRONG_RUN,
                f"this node serves run {self._run_id!r} spec {self._spec_hash.hex()[:12]}",
            )
        peer = self._verifier.verify(
            method, request.auth, receiver=request.receiver, fields=request_fields(request)
        )
        snapshot = self.lookup(request.root)
        if snapshot is None:
            raise ProtocolViolation(
                ResultCode.UNKNOWN_STATE,
                f"state {quote(request.root)} is not served here (any more)",
            )
        return peer, snapshot

    async def Manifest(
        self, request: state_pb2.StateRequest, context: object
    ) -> state_pb2.StateManifest:
        _, snapshot = self._snapshot(MANIFEST_METHOD, request)
        return state_pb2.StateManifest(
            epoch=snapshot.epoch,
            num_values=snapshot.values.numel(),
            chunk_values=snapshot.chunk_values,
            digests=snapshot.digests,
        )

    async def Download(
        self, request: state_pb2.StateRequest, context: object
    ) -> AsyncIterator[bytes]:
        """The chunks asked for, as serialized ``StateChunk`` messages."""
        peer, snapshot = self._snapshot(DOWNLOAD_METHOD, request)
        first, count = request.first_chunk, request.num_chunks
        if count < 1 or first + count > snapshot.num_chunks:
            raise ProtocolViolation(
                ResultCode.BAD_SHAPE,
                f"chunks [{first}, {first + count}) are not in 0..{snapshot.num_chunks}",
            )
        if self._downloads[peer] >= self._max_downloads:
            raise ProtocolViolation(
                ResultCode.OVERLOADED, f"{peer} already has {self._downloads[peer]} downloads"
            )
        self._downloads[peer] += 1
        try:
            step = snapshot.chunk_values
            data = snapshot.values.contiguous().numpy().data.cast("B")
            for index in range(first, first + count):
                chunk = data[4 * index * step : 4 * (index + 1) * step]
                if self._pace is not None:
                    await self._pace(len(chunk))
                yield bytes_message({1: index}, 2, chunk)
                self.chunks_served += 1
                self.sent_bytes += len(chunk)
        finally:
            self._downloads[peer] -= 1
            if self._downloads[peer] <= 0:
                del self._downloads[peer]


def request_fields(request: state_pb2.StateRequest) -> list[str | bytes | int]:
    """What a state request's signature covers besides its auth."""
    return [
        request.run_id,
        request.spec_hash,
        request.root,
        request.first_chunk,
        request.num_chunks,
    ]


def signed_request(
    signer: Signer,
    method: str,
    receiver: str,
    template: state_pb2.StateRequest,
    *,
    first_chunk: int = 0,
    num_chunks: int = 0,
) -> state_pb2.StateRequest:
    """A copy of ``template`` for ``receiver``, for these chunks, signed."""
    request = state_pb2.StateRequest()
    request.CopyFrom(template)
    request.receiver, request.first_chunk, request.num_chunks = receiver, first_chunk, num_chunks
    request.auth.CopyFrom(sign_request(signer, method, receiver, request_fields(request)))
    return request


def add_to_server(servicer: StateServicer, server: grpc.aio.Server) -> None:
    parse, rejections = state_pb2.StateRequest.FromString, servicer.rejections
    handlers = {
        "Manifest": unary(servicer.Manifest, parse=parse, rejections=rejections, service="State"),
        "Download": unary_stream(
            servicer.Download, parse=parse, rejections=rejections, service="State"
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
