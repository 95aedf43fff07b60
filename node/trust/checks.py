"""The projection check of an owner's result: the arithmetic, without the wire.

At CenteredClip's fixed point (and for the plain mean, with every clip 1) the owner's result
``v`` of a chunk satisfies ``sum_i c_i (x_i - v) = 0`` over its contributors ``i``, whose values
``x_i`` only they and the owner hold. After the owner has signed ``v`` and the clips ``c_i``
(its :class:`PartAccount`), every contributor projects its own ``c_i (x_i - v)`` on
:data:`PROJECTIONS` random sign vectors ``z_k`` (:func:`signs`) and reports the numbers; the
sums over the contributors must vanish, up to the return codec's rounding of ``v``. An owner
that shifts ``v`` by ``d`` moves each sum by ``-(sum_i c_i) <z_k, d>``, which it cannot aim at
zero: the vectors come from a seed made of the account it signed and secrets the contributors
committed to in their stream headers and reveal only after every account is out (commit and
reveal).

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
from collections.abc import Sequence

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
#: ``|c (x - v)|`` over the chunk: fp32 sums differ with the order of their additions (another
#: machine, another BLAS), by up to ~1e-7 of that in practice.
REPORT_SLACK = 1e-5
SECRET_BYTES = 32


def commitment(secret: bytes) -> bytes:
    return hashlib.sha256(b"swarmgrad/check-secret\0" + secret).digest()


def part_seed(account_body: bytes, secrets: Sequence[bytes]) -> bytes:
    """The seed of a part's projections: its signed account and the contributors' revealed
    secrets, in the account's member order."""
    digest = hashlib.sha256(b"swarmgrad/check-seed\0")
    digest.update(hashlib.sha256(account_body).digest())
    for secret in secrets:
        digest.update(hashlib.sha256(secret).digest())
    return digest.digest()


def signs(seed: bytes, chunk: int, numel: int) -> torch.Tensor:
    """The :data:`PROJECTIONS` random sign vectors of a chunk, from SHAKE-128 of the seed and the
    chunk: one byte per value (``numel`` uint8), whose bit ``k`` is the sign of vector ``k`` there
    (1: +1, 0: -1)."""
    stream = hashlib.shake_128(seed + chunk.to_bytes(4, "little")).digest(numel)
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8)


#: Row ``b``: the bits of byte ``b`` (which of the sign vectors are +1 where a value's byte is b).
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(PROJECTIONS)) & 1).double()


def project(
    values: torch.Tensor, result: torch.Tensor, clip: float, sign_bytes: torch.Tensor
) -> list[float]:
    """A contributor's report for one chunk: ``clip * <z_k, values - result>`` for every k
    (``sign_bytes`` from :func:`signs`). One pass: the centred values summed by their sign byte
    (fp64), then ``<z_k, c> = 2 * (sum where bit k is set) - (sum of all)``."""
    centred = (values - result).double()
    sums = torch.bincount(sign_bytes, weights=centred, minlength=256)
    total = float(sums.sum())
    return [clip * (2.0 * float(x) - total) for x in (sums @ _BITS).tolist()]


def report_slack(values: torch.Tensor, result: torch.Tensor, clip: float) -> float:
    """How far a correct report of one chunk may differ between two machines (see
    :data:`REPORT_SLACK`)."""
    return REPORT_SLACK * abs(clip) * float((values - result).abs().sum()) + 1e-9


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
    result: torch.Tensor, clips: Sequence[float], reports: Sequence[Sequence[float]]
) -> tuple[bool, float]:
    """Whether the contributors' reports of one chunk sum to zero within the tolerance, and the
    largest |sum| / tolerance (under 1 passes)."""
    if not reports:
        return True, 0.0
    bounds = tolerance(result, clips, reports)
    worst = 0.0
    for k, bound in enumerate(bounds):
        total = math.fsum(r[k] for r in reports)
        if not math.isfinite(total):
            return False, math.inf
        worst = max(worst, abs(total) / bound if bound > 0 else (0.0 if total == 0 else math.inf))
    return worst <= 1.0, worst
