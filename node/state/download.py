"""Downloading a state from several donors at once, every chunk checked (the State service's
client, ``protocol/state.py``).

The manifest comes from the first donor that gives a valid one (it must hash to the root the
swarm announces); then one worker per donor (two streams each) takes ranges of
``CHUNKS_PER_REQUEST`` chunks from a shared queue, checks each chunk against its digest, and on
its first failure gives its unfinished range back and stops: a bad or dead donor costs a retry,
never a corrupt state. Each request is signed and bounded by ``timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.errors import (
    PeerUnavailable,
    ProtocolViolation,
    SwarmgradError,
    from_rpc_error,
)
from swarmgrad.protocol.framing import parse_flat
from swarmgrad.protocol.state import (
    CHUNKS_PER_REQUEST,
    DIGEST_BYTES,
    DOWNLOAD_METHOD,
    MANIFEST_METHOD,
    MAX_CHUNK_VALUES,
    STREAMS_PER_DONOR,
    Snapshot,
    root_of,
    signed_request,
)
from swarmgrad.protocol.v1 import state_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode


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
                signed_request(signer, MANIFEST_METHOD, peer, template),
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
        MANIFEST_METHOD,
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
            DOWNLOAD_METHOD, request_serializer=state_pb2.StateRequest.SerializeToString
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
        request = signed_request(
            self.signer, DOWNLOAD_METHOD, peer, self.request, first_chunk=first, num_chunks=count
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
