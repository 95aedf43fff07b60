"""The projection check of an owner's result: the arithmetic, without the wire.

At CenteredClip's fixed point (and for the plain mean, with every clip 1) the owner's result
``v`` of a chunk satisfies ``sum_i c_i (x_i - v) = 0`` over its contributors ``i``, whose values
``x_i`` only they and the owner hold. After the owner has signed the clips ``c_i`` (its
:class:`PartAccount`), every contributor projects its own ``c_i x_i`` on :data:`PROJECTIONS`
random sign vectors ``z_k`` (:func:`signs`) and reports the numbers; anyone holding ``v`` then
checks that ``sum_i c_i <z_k, x_i> - (sum_i c_i) <z_k, v>`` vanishes, up to the return codec's
rounding of ``v``. A report does not depend on ``v``: a member the owner sent no result (or no
account, which others forward) still reports, so an owner cannot take a contributor out of the
check by withholding. An owner that shifts ``v`` by ``d`` moves each sum by
``-(sum_i c_i) <z_k, d>``, which it cannot aim at zero: the vectors come from a seed made of the
account it signed and secrets the contributors committed to in their stream headers and reveal
only after every account is out (commit and reveal).

The tolerance comes from fp16's rounding: every value of ``v`` is off by at most ``2^-11`` of
itself, so ``<z, v - fp16(v)>`` has a spread of at most ``2^-11 |v|``, and the sum's is that
times ``sum_i c_i``. :data:`SIGMAS` spreads is the bound (a false alarm is a ~1e-9 event per
projection); a small relative term absorbs floating-point arithmetic in the reports. Measured in
``tests/unit/test_owner_checks.py``: honest results use a few percent of the bound; a lie of
1% of ``|v|`` fails every time.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch

#: Random projections per chunk (one per bit of a byte: see :func:`signs`).
PROJECTIONS = 8
#: The tolerance, in spreads of the return codec's rounding.
SIGMAS = 6.0
#: fp16's unit roundoff: every result value is within this fraction of itself.
FP16_ROUNDOFF = 2.0**-11
#: Slack relative to the reports' own magnitude (fp32 arithmetic in x - v and the dot products).
RELATIVE_SLACK = 1e-5
#: How far a report recomputed elsewhere may be from the member's own, relative to the sum of
#: ``|c x|`` over the chunk: fp64 sums of fp32 values differ with the order of their additions
#: (another machine, another BLAS), by far less than that in practice.
REPORT_SLACK = 1e-5
SECRET_BYTES = 32


def commitment(secret: bytes) -> bytes:
    return hashlib.sha256(b"swarmgrad/check-secret\0" + secret).digest()


def part_seed(account_body: bytes, secrets: Mapping[int, bytes]) -> bytes:
    """The seed of a part's projections: its signed account and the revealed secrets of its
    committed members, by member index. Which members' secrets are in is part of the seed (a
    member that never revealed is left out: its silence cannot stop the check); every report
    says which seed it used, so members that saw different reveals never mix their numbers."""
    digest = hashlib.sha256(b"swarmgrad/check-seed/2\0")
    digest.update(hashlib.sha256(account_body).digest())
    for member in sorted(secrets):
        digest.update(member.to_bytes(4, "little"))
        digest.update(hashlib.sha256(secrets[member]).digest())
    return digest.digest()


def signs(seed: bytes, chunk: int, numel: int) -> torch.Tensor:
    """The :data:`PROJECTIONS` random sign vectors of a chunk, from SHAKE-128 of the seed and the
    chunk: one byte per value (``numel`` uint8), whose bit ``k`` is the sign of vector ``k`` there
    (1: +1, 0: -1)."""
    stream = hashlib.shake_128(seed + chunk.to_bytes(4, "little")).digest(numel)
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8)


#: Row ``b``: the bits of byte ``b`` (which of the sign vectors are +1 where a value's byte is b).
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(PROJECTIONS)) & 1).double()


def project(values: torch.Tensor, clip: float, sign_bytes: torch.Tensor) -> list[float]:
    """``clip * <z_k, values>`` for every k (``sign_bytes`` from :func:`signs`): a contributor's
    report of one chunk (its values as the owner decoded them), or with ``clip`` 1 the result's
    own projections. One pass: the values summed by their sign byte (fp64), then
    ``<z_k, x> = 2 * (sum where bit k is set) - (sum of all)``."""
    sums = torch.bincount(sign_bytes, weights=values.double(), minlength=256)
    total = float(sums.sum())
    return [clip * (2.0 * float(x) - total) for x in (sums @ _BITS).tolist()]


def report_slack(values: torch.Tensor, clip: float) -> float:
    """How far a correct report of one chunk may differ between two machines (see
    :data:`REPORT_SLACK`)."""
    return REPORT_SLACK * abs(clip) * float(values.abs().sum()) + 1e-9


def centred(
    reports: Sequence[Sequence[float]], clips: Sequence[float], result: Sequence[float]
) -> list[list[float]]:
    """Each contributor's ``c_i <z_k, x_i - v>`` from its report ``c_i <z_k, x_i>`` and the
    result's projections ``<z_k, v>``."""
    return [
        [a - clip * b for a, b in zip(row, result, strict=True)]
        for row, clip in zip(reports, clips, strict=True)
    ]


def tolerance(
    result: torch.Tensor, clips: Sequence[float], reports: Sequence[Sequence[float]]
) -> list[float]:
    """How far from zero each projection's sum may be for an honest owner."""
    spread = FP16_ROUNDOFF * float(torch.linalg.vector_norm(result))  # fp32: ample here
    base = SIGMAS * sum(clips) * spread
    return [
        base + RELATIVE_SLACK * sum(abs(r[k]) for r in reports)
        for k in range(len(reports[0]) if reports else 0)
    ]


def holds(
    result: torch.Tensor,
    clips: Sequence[float],
    reports: Sequence[Sequence[float]],
    sign_bytes: torch.Tensor,
) -> tuple[bool, float]:
    """Whether the contributors' reports (``c_i <z_k, x_i>``) of one chunk and its ``result``
    sum to zero within the tolerance, and the largest |sum| / tolerance (under 1 passes)."""
    if not reports:
        return True, 0.0
    rows = centred(reports, clips, project(result, 1.0, sign_bytes))
    bounds = tolerance(result, clips, rows)
    worst = 0.0
    for k, bound in enumerate(bounds):
        total = math.fsum(r[k] for r in rows)
        if not math.isfinite(total):
            return False, math.inf
        worst = max(worst, abs(total) / bound if bound > 0 else (0.0 if total == 0 else math.inf))
    return worst <= 1.0, worst
