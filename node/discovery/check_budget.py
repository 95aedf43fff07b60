"""How many new values a DHT node checks for each peer that stores values in it.

Every value a DHT node is asked to store has its seal's signature checked (``envelope.py``),
and keys cost nothing: one client that re-signs a flood of readiness records under the coming
round keys had each of three honest DHT processes checking ~400 signatures a second, ~40% of a
core each on a 2-core machine, and the honest swarm's epochs ran at 57% of its calm pace
(``benchmarks/readiness_flood.py``). The signing side costs the attacker one signature per
value; the swarm paid one check per replica.

So each storing peer (the transport's authenticated peer id: hivemind's libp2p caller, the
sidecar's stream peer) gets a token bucket of values to check: :data:`CHECKS_PER_SECOND`, with
bursts up to :data:`CHECKS_BURST`. Each value new to the node costs one, whether it passes or
not, and a value past the budget is refused before any check (parsing its record cost as much
as its signature, measured); a value the node has opened before (the same bytes) costs nothing.
A refused store is refused like any other, and the storer tries again later. An honest node
stores a few values per round (its readiness, its withdrawal, a peer record every few
seconds), well inside the budget; hivemind's cache copies of whole answers (``in_cache``) draw
on a bucket of their own, so relaying a flooded answer never costs an honest node the room for
its own records.

What it does not bound: a flood spread over many peer ids costs their connections (a libp2p
handshake each) and a bucket each. :data:`MAX_STORERS` buckets are kept; the least recently
used gives way (a returning peer starts with a full bucket again). Pure Python: both backends'
processes import it.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable

#: Signature checks per second a storing peer may cost a DHT node, sustained, and at once.
CHECKS_PER_SECOND = 64.0
CHECKS_BURST = 512
#: Storing peers whose buckets a node keeps.
MAX_STORERS = 4096
#: Storers whose refusals are counted by name between two reports (``take_refusals``).
MAX_NAMED_REFUSERS = 256


class CheckBudget:
    """Token buckets of signature checks, one per storing peer, bounded in number."""

    def __init__(
        self,
        *,
        per_second: float = CHECKS_PER_SECOND,
        burst: int = CHECKS_BURST,
        most_storers: int = MAX_STORERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_second <= 0 or burst < 1 or most_storers < 1:
            raise ValueError("a check budget needs a positive rate, burst and table size")
        self._per_second, self._burst, self._most = per_second, float(burst), most_storers
        self._clock = clock
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # tokens, at
        #: Checks refused in all, and since the last report by storer (the node's log).
        self.refused = 0
        self._refusers: Counter[Hashable] = Counter()

    def take(self, storer: Hashable) -> bool:
        """Whether ``storer`` may have one more new value checked now (and it is counted)."""
        now = self._clock()
        tokens, at = self._buckets.pop(storer, (self._burst, now))
        tokens = min(self._burst, tokens + (now - at) * self._per_second)
        allowed = tokens >= 1.0
        self._buckets[storer] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self._most:
            self._buckets.popitem(last=False)  # the least recently seen storer
        if not allowed:
            self.refused += 1
            if storer in self._refusers or len(self._refusers) < MAX_NAMED_REFUSERS:
                self._refusers[storer] += 1
        return allowed

    def take_refusals(self, most: int = 3) -> tuple[int, list[tuple[Hashable, int]]]:
        """How many storers were refused since the last call (counted up to
        :data:`MAX_NAMED_REFUSERS`), and the ``most`` refused most, with their counts."""
        refusers, self._refusers = self._refusers, Counter()
        return len(refusers), refusers.most_common(most)

    def for_storer(self, storer: Hashable | None) -> Callable[[], bool] | None:
        """What ``records.validate`` asks before it checks a new value for ``storer`` (None: a
        value this node asked for, or its own: never refused)."""
        if storer is None:
            return None
        return lambda: self.take(storer)
