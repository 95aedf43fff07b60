"""The State service: peers serve their replicated state; a node that joins or fell behind
downloads it from several of them at once, checking every chunk.

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

import asyncio
import hashlib
import math
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from swarmgrad.protocol.auth import Signer, Verifier, sign_request
from swarmgrad.protocol.errors import (
    PeerUnavailable,
    ProtocolViolation,
    SwarmgradError,
    from_rpc_error,
    quote,
)
from swarmgrad.protocol.framing import bytes_message, parse_flat
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
_DOWNLOAD = f"/{SERVICE}/Download"
_MANIFEST = f"/{SERVICE}/Manifest"


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
        _, snapshot = self._snapshot(_MANIFEST, request)
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
        peer, snapshot = self._snapshot(_DOWNLOAD, request)
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


def _signed(
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


@dataclass(slots=True)
class Download:
    """A finished download: the state, and who served what."""

    snapshot: Snapshot
    #: Chunks each donor delivered (verified).
    chunks_by_donor: dict[str, int]
    #: Donors dropped along the way, and why.
    failures: dict[str, str]


async def download(
    donors: Sequence[tuple[str, grpc.aio.Channel]],
    *,
    signer: Signer,
    run_id: str,
    spec_hash: bytes,
    root: str,
    num_values: int,
    timeout_seconds: float,
) -> Download:
    """The state ``root`` (of ``num_values`` values), from ``donors`` (peer id, channel) at once.

    Raises PeerUnavailable or ProtocolViolation if no donor gives a valid manifest, or the donors
    still standing cannot deliver every chunk. ``timeout_seconds`` bounds each request; every
    request is signed by ``signer``.
    """
    failures: dict[str, str] = {}
    manifest: state_pb2.StateManifest | None = None
    template = state_pb2.StateRequest(run_id=run_id, spec_hash=spec_hash, root=root)
    for peer, channel in donors:
        try:
            manifest = await _manifest(
                channel,
                peer,
                _signed(signer, _MANIFEST, peer, template),
                num_values,
                timeout_seconds,
            )
            break
        except SwarmgradError as error:
            failures[peer] = str(error)
    if manifest is None:
        raise _failed(f"no donor gave the manifest of state {root}", failures)
    job = _Job(
        manifest=manifest,
        request=template,
        signer=signer,
        timeout_seconds=timeout_seconds,
        failures=failures,
    )
    await asyncio.gather(
        *(
            job.work(peer, channel)
            for peer, channel in list(donors) * STREAMS_PER_DONOR
            if peer not in failures
        )
    )
    if job.missing:
        raise _failed(f"state {root}: {job.missing} chunks could not be downloaded", failures)
    if not _all_finite(job.values):  # digests matched: every donor agreed on it
        raise ProtocolViolation(ResultCode.NON_FINITE, f"state {root} holds NaN or Inf")
    snapshot = Snapshot(
        manifest.epoch, job.values, root, manifest.digests, int(manifest.chunk_values)
    )
    return Download(snapshot=snapshot, chunks_by_donor=job.delivered, failures=failures)


async def _manifest(
    channel: grpc.aio.Channel,
    peer: str,
    request: state_pb2.StateRequest,
    num_values: int,
    timeout_seconds: float,
) -> state_pb2.StateManifest:
    call = channel.unary_unary(
        _MANIFEST,
        request_serializer=state_pb2.StateRequest.SerializeToString,
        response_deserializer=state_pb2.StateManifest.FromString,
    )
    root = request.root
    try:
        manifest: state_pb2.StateManifest = await call(request, timeout=timeout_seconds)
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error, peer) from None
    chunk_values = manifest.chunk_values
    if manifest.num_values != num_values:
        raise ProtocolViolation(
            ResultCode.BAD_SHAPE,
            f"{peer} offers {manifest.num_values} values, the model has {num_values}",
        )
    if not 0 < chunk_values <= MAX_CHUNK_VALUES:
        raise _bad(peer, f"chunks of {chunk_values} values")
    if len(manifest.digests) != DIGEST_BYTES * math.ceil(num_values / chunk_values):
        raise _bad(peer, "a manifest with the wrong number of digests")
    if root_of(manifest.epoch, num_values, chunk_values, manifest.digests) != root:
        raise _bad(peer, f"a manifest that is not state {root}")
    return manifest


@dataclass(slots=True)
class _Job:
    """Chunks left to fetch, shared by one worker per donor."""

    manifest: state_pb2.StateManifest
    request: state_pb2.StateRequest
    signer: Signer
    timeout_seconds: float
    failures: dict[str, str]
    values: torch.Tensor = field(init=False)
    pending: deque[tuple[int, int]] = field(init=False)  # (first chunk, count)
    missing: int = field(init=False)
    delivered: dict[str, int] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def __post_init__(self) -> None:
        total = len(self.manifest.digests) // DIGEST_BYTES
        self.values = torch.empty(self.manifest.num_values, dtype=torch.float32)
        self.pending = deque(
            (first, min(CHUNKS_PER_REQUEST, total - first))
            for first in range(0, total, CHUNKS_PER_REQUEST)
        )
        self.missing = total

    async def work(self, peer: str, channel: grpc.aio.Channel) -> None:
        """Fetch ranges from ``peer`` until none are left; on its first failure give its
        unfinished range back to the others and stop."""
        stub = channel.unary_stream(
            _DOWNLOAD, request_serializer=state_pb2.StateRequest.SerializeToString
        )
        while True:
            async with self.changed:
                # Wait while others hold the last ranges: one may fail and give its back.
                await self.changed.wait_for(lambda: bool(self.pending) or not self.missing)
                if not self.missing:
                    return
                first, count = self.pending.popleft()
            try:
                done = await self._fetch(stub, peer, first, count)
            except _Partial as partial:
                self.failures[peer] = str(partial.error)
                done = partial.done
            finally:
                async with self.changed:
                    if done < count:
                        self.pending.appendleft((first + done, count - done))
                    self.changed.notify_all()
            if peer in self.failures:
                return

    async def _fetch(
        self, stub: grpc.aio.UnaryStreamMultiCallable, peer: str, first: int, count: int
    ) -> int:
        """Chunks ``[first, first + count)`` from ``peer``, each checked; returns how many."""
        request = _signed(
            self.signer, _DOWNLOAD, peer, self.request, first_chunk=first, num_chunks=count
        )
        step = self.manifest.chunk_values
        target = self.values.numpy()
        done = 0
        try:
            async for raw in stub(request, timeout=self.timeout_seconds):
                index = first + done
                start, end = index * step, min((index + 1) * step, self.manifest.num_values)
                digest = self.manifest.digests[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]
                try:
                    varints, blobs = parse_flat(raw)
                except ValueError as error:
                    raise _Partial(_bad(peer, f"a malformed chunk ({error})"), done) from None
                sent_index, values = varints.get(1, 0), blobs.get(2, memoryview(b""))
                if (
                    done == count
                    or sent_index != index
                    or len(values) != 4 * (end - start)
                    or hashlib.sha256(values).digest() != digest
                ):
                    raise _Partial(_bad(peer, f"chunk {sent_index} is not the manifest's"), done)
                target[start:end] = np.frombuffer(values, dtype="<f4")
                done += 1
                self.missing -= 1
                self.delivered[peer] = self.delivered.get(peer, 0) + 1
        except grpc.aio.AioRpcError as error:
            raise _Partial(from_rpc_error(error, peer), done) from None
        if done < count:
            raise _Partial(PeerUnavailable(f"{peer} ended after {done} of {count} chunks"), done)
        return done


class _Partial(SwarmgradError):
    """A donor's failure after ``done`` good chunks of its range."""

    def __init__(self, error: SwarmgradError, done: int) -> None:
        super().__init__(str(error))
        self.error, self.done = error, done


def _all_finite(values: torch.Tensor) -> bool:
    # A finite sum proves every value finite (a NaN or Inf makes the sum NaN or Inf) and costs a
    # tenth of isfinite(); only a sum that overflowed needs the exact check.
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())


def _failed(what: str, failures: dict[str, str]) -> SwarmgradError:
    reasons = "; ".join(f"{peer}: {why}" for peer, why in failures.items()) or "no donors"
    return PeerUnavailable(f"{what} ({reasons})")


def _bad(peer: str, what: str) -> ProtocolViolation:
    return ProtocolViolation(ResultCode.BAD_PAYLOAD, f"{peer} sent {what}")
