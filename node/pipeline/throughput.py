"""A stage replica's throughput: samples over the compute seconds of their forwards and
backwards, what it announces (the stage's rebalancing compares it)."""

from __future__ import annotations

#: Weight of the newest inner step's rate (an EMA: a replica's first steps are slow, warming up,
#: and a cumulative average would remember them for minutes).
THROUGHPUT_ALPHA = 0.3


class Throughput:
    """An EMA over inner steps since the replica joined its stage; the first step (warm-up)
    is left out, so it reads 0 until the second."""

    def __init__(self) -> None:
        self._seconds, self._samples = 0.0, 0  # since the last inner step
        self._steps = 0
        self.samples_per_second = 0.0

    def work(self, samples: int, seconds: float) -> None:
        """A microbatch's backward (``samples`` in ``seconds`` of compute), or its forward (no
        samples: they count once, when their gradients are in)."""
        self._seconds += seconds
        self._samples += samples

    def step(self) -> None:
        """Fold the inner step just taken into the rate."""
        seconds, samples = self._seconds, self._samples
        self._seconds, self._samples = 0.0, 0
        self._steps += 1
        if self._steps == 1 or seconds <= 0:
            return
        rate, previous = samples / seconds, self.samples_per_second
        self.samples_per_second = (
            rate if not previous else THROUGHPUT_ALPHA * rate + (1 - THROUGHPUT_ALPHA) * previous
        )
