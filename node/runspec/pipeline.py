"""``[pipeline]``: the model cut into stages served by stage replicas, and their codecs."""

from __future__ import annotations

from dataclasses import dataclass

from swarmgrad.compression.traits import refusal
from swarmgrad.node.runspec.errors import RunSpecError, positive


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSection:
    """Pipeline stages across peers (``node/pipeline/``): the model's layers cut into ``stages``
    spans, each served by stage replicas; trainers own the data and no parameters. One stage
    (the default) is a plain run: every node holds the whole model."""

    stages: int = 1
    #: The first layer of each stage after the first (S - 1 increasing layer indices); empty:
    #: an even split (the first stages take one layer more when it does not divide).
    boundaries: tuple[int, ...] = ()
    #: Microbatches per trainer step (``data.batch_size`` is the step's samples).
    microbatches: int = 4
    #: Codec of the activations sent forward, and of their gradients sent back. fp16 is refused
    #: for gradients: most activation-gradient values lie below its smallest normal number.
    activations: str = "bf16"
    gradients: str = "int8"
    #: A trainer waits this long for a stage with no live replica, then fails the step.
    wait_seconds: float = 30.0
    #: Deadline of one call to a stage replica.
    call_timeout_seconds: float = 20.0
    #: Stage servers check the stages' balance about this often (0: never move).
    rebalance_seconds: float = 60.0
    #: A replica moves only if the weakest stage's capacity grows past 1 / hysteresis.
    hysteresis: float = 0.75

    def __post_init__(self) -> None:
        positive(
            "pipeline",
            stages=self.stages,
            microbatches=self.microbatches,
            wait_seconds=self.wait_seconds,
            call_timeout_seconds=self.call_timeout_seconds,
        )
        if self.rebalance_seconds < 0 or not 0 < self.hysteresis < 1:
            raise RunSpecError(
                "pipeline.rebalance_seconds must be >= 0 (0: never) and pipeline.hysteresis "
                "in (0, 1)"
            )
        for key in ("activations", "gradients"):
            # What may cross a stage boundary is what the codec says it is safe for.
            why = refusal(getattr(self, key), key)
            if why is not None:
                raise RunSpecError(f"pipeline.{key}: {why}")
        if self.boundaries and len(self.boundaries) != self.stages - 1:
            raise RunSpecError(
                f"pipeline.boundaries needs {self.stages - 1} layer indices (where stages 2.."
                f"{self.stages} start), got {len(self.boundaries)}"
            )
        if any(b <= a for a, b in zip((0, *self.boundaries), self.boundaries, strict=False)):
            raise RunSpecError(
                f"pipeline.boundaries must increase from above 0, got {list(self.boundaries)}"
            )

    @property
    def enabled(self) -> bool:
        return self.stages > 1

    def spans(self, n_layers: int) -> list[tuple[int, int]]:
        """Each stage's layers ``[start, end)``."""
        if self.boundaries:
            starts = [0, *self.boundaries]
        else:
            base, extra = divmod(n_layers, self.stages)
            starts = [k * base + min(k, extra) for k in range(self.stages)]
        return list(zip(starts, [*starts[1:], n_layers], strict=True))
