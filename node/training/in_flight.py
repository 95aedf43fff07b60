"""An overlapped round in flight, as a checkpoint keeps it: which round and range it was, its
weight, and the local parameters of its range when it started (its boundary). A restart cannot
collect it, so the replica that resumes does not know whether it landed: ``DiLoCo`` decides
that from the swarm's epoch (``diloco.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class Restored:
    """A round that was in flight when the checkpoint it came back from was written: its outcome
    is unknown (it may have landed in the swarm with this replica's progress in it, or not)."""

    epoch: int
    fragment: int | None
    offset: int
    weight: int
    boundary: torch.Tensor  # the local parameters of its range when it started

    def record(self) -> dict[str, Any]:
        """What the checkpoint's metadata keeps (the boundary goes with its tensors)."""
        return {
            "epoch": self.epoch,
            "fragment": self.fragment,
            "offset": self.offset,
            "weight": self.weight,
        }

    @classmethod
    def from_checkpoint(
        cls,
        record: object,
        boundary: torch.Tensor | None,
        bounds: list[tuple[int, int]],
        device: torch.device,
    ) -> Restored | None:
        """The round a checkpoint kept (None: none, or a checkpoint from before the boundary was
        kept, whose round a resync drops), checked against the replica's fragment ``bounds``.
        Raises ValueError (KeyError, TypeError) for one that does not match the model."""
        if not isinstance(record, dict) or boundary is None:
            return None
        fragment = None if record["fragment"] is None else int(record["fragment"])
        offset, weight = int(record["offset"]), int(record["weight"])
        if fragment is not None and not 0 <= fragment < len(bounds):
            raise ValueError("the round in flight in the state does not match the model")
        start, end = bounds[fragment or 0]
        if offset != start or boundary.shape != (end - start,):
            raise ValueError("the round in flight in the state does not match the model")
        return cls(
            epoch=int(record["epoch"]),
            fragment=fragment,
            offset=offset,
            weight=weight,
            boundary=boundary.to(device, torch.float32, copy=True),
        )
