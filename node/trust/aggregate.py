"""Robust aggregation of one chunk at its owner: screening, CenteredClip, coordinate median.

Pure torch on the CPU; the owner calls :func:`aggregate` off the event loop with every member's
decoded values of one chunk (an ``n x d`` fp32 stack) and gets back the value it publishes and
what it saw of each member (its clip coefficient, its cosine to the result, whether it was
screened out). Nothing here knows of rounds, peers or the wire.

Screening comes first: a member whose values are all zero, or whose largest magnitude is more
than :data:`SCALE_LIMIT` times the members' median, is left out of the chunk (NaN and Inf never
get here: decoding refuses them).

CenteredClip (Karimireddy et al. 2021; the per-part form is BTARD's) moves an estimate ``v``
towards every member by at most a radius ``tau``::

    v <- v + sum_i w_i * min(1, tau / |x_i - v|) * (x_i - v)

with ``tau = kappa * median_i |x_i - v|``, chosen again at every step, so the fixed point is
self-consistent: anyone holding the inputs can check it. Every iterate is the coordinate median
``m`` plus a combination of the centred inputs ``z_i = x_i - m``, so the iteration runs on the
``n`` coefficients with the Gram matrix of the ``z_i`` (one pass over the chunk), and the chunk
is touched once more to form the result: exact, and a few milliseconds per MiB.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: A member whose largest value exceeds this many times the members' median largest value is
#: not averaged (an update 1000x larger than its peers' is a bug or an attack, never progress).
SCALE_LIMIT = 1e3
#: The share of a chunk's members the trimmed mean leaves out at each end, coordinate by
#: coordinate (rounded down: with fewer than 5 members it is the mean).
TRIM = 0.2
#: Relative change of the estimate at which CenteredClip has reached its fixed point.
TOLERANCE = 1e-7
MAX_ITERATIONS = 1000


class Aggregator(enum.StrEnum):
    """An owner's rule for a chunk's members' values (the run spec's ``trust.aggregator``)."""

    MEAN = "mean"  # the weighted mean: trusted peers only
    CENTERED_CLIP = "centered_clip"
    MEDIAN = "median"  # coordinate-wise: cheaper, cruder
    TRIMMED_MEAN = "trimmed_mean"  # coordinate-wise: the mean of all but each end's TRIM

    @property
    def checkable(self) -> bool:
        """Whether its result is a fixed point ``sum_i c_i (x_i - v) = 0`` of the members'
        values with one clip coefficient each, which the members can check together without
        showing their values (``node/trust/checks.py``); open runs apply the others'
        results unchecked (audits still aggregate them again)."""
        return self in (Aggregator.MEAN, Aggregator.CENTERED_CLIP)


class Screen(enum.StrEnum):
    """Why a member's values of a chunk were left out before aggregation."""

    ZERO = "zero"
    SCALE = "scale"
    OUTSIZED = "outsized"  # its norm over the owner's ``bound``


@dataclass(frozen=True, slots=True)
class Aggregate:
    """One chunk's result and what each of the ``n`` members looked like in it."""

    value: torch.Tensor
    #: Members whose values went into ``value``.
    used: tuple[int, ...]
    #: Members screened out, and why.
    screened: dict[int, Screen]
    #: Per member (all n): CenteredClip's min(1, tau / distance) at the fixed point; 1 for the
    #: mean and the median; 0 for the screened.
    clip: tuple[float, ...]
    #: Per member: cosine of its values to what the *others* agree on (``value`` without the
    #: member's own pull: a member's influence must not vouch for itself); 0 if either is zero.
    cosine: tuple[float, ...]
    tau: float = 0.0
    iterations: int = 0


def aggregate(
    values: torch.Tensor,
    aggregator: Aggregator,
    *,
    weights: Sequence[float] | None = None,
    kappa: float = 1.0,
    bound: float | None = None,
) -> Aggregate:
    """Aggregate the rows of ``values`` (``n x d`` fp32); ``weights`` default to uniform; a row
    whose norm is over ``bound`` is left out (:attr:`Screen.OUTSIZED`)."""
    if values.dim() != 2 or values.shape[0] == 0:
        raise ValueError("values must be an n x d stack with n >= 1")
    n = values.shape[0]
    weights = [1.0] * n if weights is None else list(weights)
    if len(weights) != n or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError("one positive weight per member")
    screened = screen(values)
    if bound is not None:
        norms = values.norm(dim=1).tolist()
        screened |= {i: Screen.OUTSIZED for i in range(n) if i not in screened and norms[i] > bound}
    used = [i for i in range(n) if i not in screened]
    if not used:
        return Aggregate(
            value=torch.zeros(values.shape[1]),
            used=(),
            screened=screened,
            clip=(0.0,) * n,
            cosine=(0.0,) * n,
        )
    rows = values[used] if len(used) < n else values
    w = torch.tensor([weights[i] for i in used], dtype=torch.float64)
    w /= w.sum()
    clip_used = [1.0] * len(used)
    tau, iterations = 0.0, 0
    if aggregator is Aggregator.MEAN or len(used) == 1:
        value = (w.to(torch.float32) @ rows) if len(used) > 1 else rows[0].clone()
    elif aggregator is Aggregator.MEDIAN:
        value = coordinate_median(rows)
    elif aggregator is Aggregator.TRIMMED_MEAN:
        value, clip_used = trimmed_mean(rows)
    else:
        value, clip_used, tau, iterations = centered_clip(rows, w, kappa=kappa)
    clip = [0.0] * n
    pull = [0.0] * n  # each member's share of `value`, w_i c_i / sum_j w_j c_j
    if aggregator is not Aggregator.MEDIAN and len(used) > 1:
        shares = [float(w[k]) * clip_used[k] for k in range(len(used))]
        for k, i in enumerate(used):
            pull[i] = shares[k] / sum(shares)
    for k, i in enumerate(used):
        clip[i] = clip_used[k]
    return Aggregate(
        value=value,
        used=tuple(used),
        screened=screened,
        clip=tuple(clip),
        cosine=_cosines(values, value, pull),
        tau=tau,
        iterations=iterations,
    )


def screen(values: torch.Tensor) -> dict[int, Screen]:
    """Members to leave out: all zeros, or an absurd scale next to the others."""
    absmax = values.abs().amax(dim=1).tolist()
    out: dict[int, Screen] = {i: Screen.ZERO for i, a in enumerate(absmax) if a == 0.0}
    rest = [a for i, a in enumerate(absmax) if i not in out]
    if len(rest) >= 3:  # with two, neither is the odd one out
        limit = SCALE_LIMIT * statistics.median(rest)
        out |= {i: Screen.SCALE for i, a in enumerate(absmax) if i not in out and a > limit}
    return out


def coordinate_median(values: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of the rows (the mean of the middle two for an even count).

    An odd-even transposition network over whole rows: n(n-1)/2 vectorized min/max pairs, 3-4x
    faster than sorting along the short axis for the group sizes a round has.
    """
    n = values.shape[0]
    rows: list[torch.Tensor] = [row.clone() for row in values]
    low = torch.empty_like(rows[0])
    for phase in range(n):
        for i in range(phase % 2, n - 1, 2):
            torch.minimum(rows[i], rows[i + 1], out=low)
            torch.maximum(rows[i], rows[i + 1], out=rows[i + 1])
            rows[i], low = low, rows[i]
    if n % 2:
        return rows[n // 2]
    return rows[n // 2 - 1].add_(rows[n // 2]).mul_(0.5)


def trimmed_mean(values: torch.Tensor, trim: float = TRIM) -> tuple[torch.Tensor, list[float]]:
    """Each coordinate's mean without its ``floor(trim * n)`` largest and smallest values, and
    each row's share of coordinates it was kept in (its "clip": 1 is never trimmed)."""
    n, d = values.shape
    k = int(trim * n)
    if k == 0:
        return values.mean(0), [1.0] * n
    ordered, order = values.sort(dim=0)
    kept = torch.bincount(order[k : n - k].flatten(), minlength=n).double() / d
    return ordered[k : n - k].mean(0), kept.tolist()


def centered_clip(
    values: torch.Tensor, weights: torch.Tensor, *, kappa: float = 1.0
) -> tuple[torch.Tensor, list[float], float, int]:
    """CenteredClip's self-consistent fixed point: (value, clip per row, tau, iterations)."""
    if not kappa > 0:
        raise ValueError("kappa must be positive")
    median = coordinate_median(values)
    centred = values - median
    gram = (centred @ centred.T).double()
    n = values.shape[0]
    b = torch.zeros(n, dtype=torch.float64)  # v = median + centred.T @ b
    scale = float(gram.diagonal().mean().clamp_min(1e-300).sqrt())
    clip = torch.ones(n, dtype=torch.float64)
    tau = 0.0
    iterations = 0
    for iterations in range(1, MAX_ITERATIONS + 1):  # noqa: B007 - reported
        distance = _distances(gram, b)
        tau = kappa * float(distance.median()) if n % 2 else kappa * _even_median(distance)
        clip = torch.where(distance > tau, tau / distance.clamp_min(1e-300), 1.0)
        pull = weights * clip
        step = pull - b * pull.sum()  # sum_i w_i c_i (e_i - b)
        b += step
        moved = float((step @ gram @ step).clamp_min(0.0).sqrt())
        if moved <= TOLERANCE * scale:
            break
    value = median.add_(b.to(torch.float32) @ centred)
    return value, clip.tolist(), tau, iterations


def _distances(gram: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|z_i - Z^T b| for every row i, from the Gram matrix."""
    gb = gram @ b
    squared = gram.diagonal() - 2 * gb + b @ gb
    return squared.clamp_min(0.0).sqrt()


def _even_median(values: torch.Tensor) -> float:
    ordered = values.sort().values
    k = values.numel() // 2
    return float(ordered[k - 1] + ordered[k]) / 2


def _cosines(values: torch.Tensor, value: torch.Tensor, pull: list[float]) -> tuple[float, ...]:
    """Each row's cosine to ``value`` with the row's own share ``pull`` taken out of it.

    ``value`` is (at the fixed point) the pull-weighted mean of the rows, so without row i it
    is ``(value - p_i x_i) / (1 - p_i)``. That vector is formed in fp64: worked out from dot
    products alone, a row far larger than the others cancels their part away (at a 1e4 scale
    ratio, a cosine of 0.7 came out as 0.1).
    """
    target = value.double()
    out = []
    for row, p in zip(values, pull, strict=True):
        if p >= 1.0:
            out.append(0.0)
            continue
        x = row.double()
        others = target - p * x  # scaled by (1 - p), which the cosine does not see
        denominator = float(torch.linalg.vector_norm(others) * torch.linalg.vector_norm(x))
        out.append(float(others @ x) / denominator if denominator > 0 else 0.0)
    return tuple(out)
