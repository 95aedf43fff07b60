"""Open runs: the members' check reports, the stand-ins for missing ones, and the check of a part.

Every contributor of a part reports ``c_i <z_k, x_i>`` for its chunks (``node/trust/checks.py``
has the arithmetic), under the part's seed as it fixed it from the reveals it got; the report
says which seed. A checker sums, chunk by chunk, the rows of every contributor under its own
seed and the result it holds. A row it lacks (a member that sent no report, or reported under
another seed because it saw other reveals) is stood in for by the member's own signed chunks,
which the checker fetches from the part's owner (the same ``AuditRequest`` audits use): anyone
can check a member's signature and the hash the owner's account lists, and project the values
itself. An owner that cannot show them leaves its part unchecked, and an unchecked part is not
applied: so no member's silence, and no owner's withholding, lets a result through unchecked.

A report that contradicts the member's signed chunks is false; the owner proves it with an
:class:`~swarmgrad.protocol.v1.averaging_pb2.Accusation` (``checks.py``), checked here under the
seed the report itself names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import grpc
import torch

from swarmgrad.compression import CodecError, decode
from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.plan import AllReduceConfig, round_key
from swarmgrad.node.trust.checks import PROJECTIONS, holds, project, report_slack, signs
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.averaging import CHECK_STATEMENT, check_method, chunk_signed_by, seal
from swarmgrad.protocol.keys import KEY_BYTES, peer_id_of
from swarmgrad.protocol.tensors import meta_from_proto
from swarmgrad.protocol.v1 import averaging_pb2

__all__ = [
    "Rows",
    "agree",
    "check_part",
    "fetch_chunk",
    "listed_values",
    "own_report",
    "reported",
    "signed_values",
    "true_projections",
]

#: A member's projections of its chunks of a part, one row of PROJECTIONS per chunk it is in.
Rows = list[list[float]]


def own_report(
    part: CheckedPart,
    me: int,
    sent: torch.Tensor,
    digests: Mapping[tuple[int, int], bytes],
) -> averaging_pb2.PartReport:
    """This member's report of its chunks of ``part`` (``sent``: its whole vector as the owners
    decoded it; ``digests``: the SHA-256 of each payload it sent, by (part, chunk))."""
    out = averaging_pb2.PartReport(part=part.part, seed=part.seed)
    for index in part.chunks_of(me):
        start, end = (part.start + at for at in part.span(index))
        vectors = signs(part.seed, index, part.numels[index])
        out.projections.extend(project(sent[start:end], part.clip(index, me), vectors))
        out.payload_sha256.append(digests.get((part.part, index), b""))
    return out


def reported(
    report: averaging_pb2.Report | None, part: CheckedPart, member: int, seed: bytes = b""
) -> Rows | None:
    """A member's projections of its chunks of ``part`` under ``seed`` (default: the part's),
    or None: it sent no report of the part, or one under another seed, or of another shape."""
    if report is None:
        return None
    entry = next((p for p in report.parts if p.part == part.part), None)
    count = len(part.chunks_of(member))
    # Exactly PROJECTIONS a chunk, as every honest member computes them: a report of another
    # shape is no report (rows of the wrong length would break every sum over them).
    if (
        entry is None
        or not count
        or entry.seed != (seed or part.seed)
        or len(entry.projections) != PROJECTIONS * count
    ):
        return None
    values = list(entry.projections)
    return [values[i * PROJECTIONS : (i + 1) * PROJECTIONS] for i in range(count)]


def true_projections(
    part: CheckedPart, member: int, values: Mapping[int, torch.Tensor], seed: bytes = b""
) -> tuple[Rows, list[float]]:
    """What ``member`` should have reported for its chunks of ``part`` under ``seed`` (default:
    the part's; ``values``: its values by chunk index), and each chunk's slack."""
    seed = seed or part.seed
    rows: Rows = []
    slack: list[float] = []
    for index in part.chunks_of(member):
        clip = part.clip(index, member)
        rows.append(project(values[index], clip, signs(seed, index, part.numels[index])))
        slack.append(report_slack(values[index], clip))
    return rows, slack


def agree(claimed: Sequence[Sequence[float]], truth: Rows, slack: Sequence[float]) -> bool:
    """Whether a member's reported projections are the ones its values give, within each
    chunk's ``slack`` (:func:`~swarmgrad.node.trust.checks.report_slack`: the recomputation may
    run on another machine)."""
    return all(
        abs(x - y) <= bound
        for row_a, row_b, bound in zip(claimed, truth, slack, strict=True)
        for x, y in zip(row_a, row_b, strict=True)
    )


def check_part(
    part: CheckedPart,
    rows: Mapping[int, Rows],
    result: Callable[[int], torch.Tensor],
    chunks: Iterable[int],
) -> tuple[bool, float]:
    """Whether ``chunks`` of ``part`` pass: every contributor's row (``rows``, by member, in
    the order of its chunks) and the chunk's ``result`` sum to zero; and the largest
    |sum| / tolerance among them."""
    passed, worst = True, 0.0
    for index in sorted(chunks):
        chunk = part.account.chunks[index]
        members = list(chunk.contributors)
        lines = [rows[m][part.chunks_of(m).index(index)] for m in members]
        vectors = signs(part.seed, index, part.numels[index])
        ok, ratio = holds(result(index), list(chunk.clip), lines, vectors)
        passed &= ok
        worst = max(worst, ratio)
    return passed, worst


def listed_values(
    part: CheckedPart, index: int, member: int, chunk: averaging_pb2.Chunk
) -> torch.Tensor | None:
    """``member``'s values of chunk ``index``, if ``chunk`` is the payload the part's account
    lists for it and decodes to the chunk's size (None otherwise)."""
    account = part.account.chunks[index]
    position = list(account.contributors).index(member)
    if hashlib.sha256(chunk.payload).digest() != account.payload_sha256[position]:
        return None
    try:
        values = decode(chunk.payload, meta_from_proto(chunk.meta), max_numel=part.numels[index])
    except (CodecError, ValueError):
        return None
    return values if values.numel() == part.numels[index] else None


def signed_values(
    part: CheckedPart,
    group: Group,
    key: averaging_pb2.RoundKey,
    index: int,
    member: int,
    chunk: averaging_pb2.Chunk | None,
) -> torch.Tensor | None:
    """``member``'s values of chunk ``index``, if ``chunk`` carries its signature (in the key
    its stream header was signed with, which the account shows) and is the payload the account
    lists (None otherwise)."""
    account = part.account
    keys = dict(zip(account.members, (a.public_key for a in account.header_auths), strict=True))
    public_key = keys.get(member, b"")
    peer = group.members[member].peer_id
    if (
        chunk is None
        or chunk.index != index
        or len(public_key) != KEY_BYTES
        or peer_id_of(public_key) != peer
        or not chunk_signed_by(public_key, key, peer, part.part, chunk)
    ):
        return None
    return listed_values(part, index, member, chunk)


async def fetch_chunk(
    *,
    signer: Signer,
    config: AllReduceConfig,
    group: Group,
    channel: Callable[[str], grpc.aio.Channel],
    part: int,
    index: int,
    member: int,
) -> averaging_pb2.Chunk | None:
    """``member``'s chunk ``index`` of ``part`` as its owner received it (None: the owner does
    not hold it), within the check deadline; gRPC errors and timeouts are the caller's."""
    statement = averaging_pb2.CheckStatement(
        key=round_key(config, group),
        sender=signer.peer_id,
        audit=averaging_pb2.AuditRequest(part=part, chunk=index, member=member),
    )
    call = check_method(channel(group.members[part].endpoint))
    reply = await call(
        seal(signer, CHECK_STATEMENT, statement), timeout=config.check_timeout_seconds
    )
    return reply.payloads[0] if len(reply.payloads) == 1 else None
