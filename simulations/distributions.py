"""Distributions a ``[[peer]]`` profile may give instead of a number, sampled with a seed.

A value is a number (every peer of that table gets it) or an inline table naming a
distribution::

    slowdown = { dist = "lognormal", median = 1.0, sigma = 0.5 }
    upload_bytes_per_second = { dist = "uniform", low = 1e6, high = 1e7 }
    session_seconds = { dist = "exponential", mean = 3600 }
    nat = { dist = "choice", values = ["direct", "relayed"], weights = [0.7, 0.3] }

``choice`` also draws numbers (``values = [1.0, 2.0, 4.0]``). Draws come from one
``random.Random`` per simulation seed, in a fixed order, so a seed gives the same swarm.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Each distribution and the parameters it takes.
KINDS: dict[str, tuple[str, ...]] = {
    "constant": ("value",),
    "uniform": ("low", "high"),
    "lognormal": ("median", "sigma"),
    "normal": ("mean", "std"),
    "exponential": ("mean",),
    "choice": ("values", "weights"),
}


class DistributionError(ValueError):
    """A profile value is neither a number nor a distribution this module knows."""


@dataclass(frozen=True, slots=True)
class Distribution:
    kind: str
    params: tuple[tuple[str, Any], ...]

    def sample(self, rng: random.Random) -> Any:
        p = dict(self.params)
        if self.kind == "constant":
            return p["value"]
        if self.kind == "uniform":
            return rng.uniform(p["low"], p["high"])
        if self.kind == "lognormal":
            return p["median"] * math.exp(rng.gauss(0.0, p["sigma"]))
        if self.kind == "normal":
            return rng.gauss(p["mean"], p["std"])
        if self.kind == "exponential":
            return rng.expovariate(1.0 / p["mean"])
        values, weights = p["values"], p.get("weights")
        return rng.choices(values, weights=weights)[0]


def parse(value: Any, what: str) -> Distribution:
    """``value`` from a profile as a distribution (a plain value is a constant)."""
    if not isinstance(value, Mapping):
        return Distribution("constant", (("value", value),))
    table = dict(value)
    kind = table.pop("dist", None)
    if kind not in KINDS:
        raise DistributionError(f"{what}: dist must be one of {', '.join(KINDS)}, got {kind!r}")
    allowed = KINDS[kind]
    required = set(allowed) - ({"weights"} if kind == "choice" else set())
    if set(table) - set(allowed) or required - set(table):
        raise DistributionError(f"{what}: a {kind} distribution takes {', '.join(allowed)}")
    if kind == "choice":
        values = table["values"]
        if not isinstance(values, Sequence) or isinstance(values, str) or not values:
            raise DistributionError(f"{what}: choice needs a non-empty list of values")
        weights = table.get("weights")
        if weights is not None and (
            not isinstance(weights, Sequence)
            or isinstance(weights, str)
            or len(weights) != len(values)
            or not all(_number(w) and w >= 0 for w in weights)
            or not sum(weights) > 0
        ):
            raise DistributionError(f"{what}: weights must be one number >= 0 per value, not all 0")
        return Distribution(kind, (("values", tuple(values)), ("weights", weights)))
    if not all(_number(v) for v in table.values()):
        raise DistributionError(f"{what}: the parameters of {kind} must be finite numbers")
    if kind == "uniform" and not table["low"] <= table["high"]:
        raise DistributionError(f"{what}: uniform needs low <= high")
    if kind in ("lognormal", "exponential") and not min(table.values()) > 0:
        raise DistributionError(f"{what}: the parameters of {kind} must be positive")
    if kind == "normal" and table["std"] < 0:
        raise DistributionError(f"{what}: std must be >= 0")
    return Distribution(kind, tuple(sorted(table.items())))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
