"""``[run]``: the run's id, and the protocol version its nodes speak."""

from __future__ import annotations

from dataclasses import dataclass

from swarmgrad.node.runspec.errors import RunSpecError
from swarmgrad.protocol import PROTOCOL_VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    id: str
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not self.id or len(self.id) > 64 or not all(c.isalnum() or c in "-_." for c in self.id):
            raise RunSpecError(
                f"run.id must be 1-64 letters, digits, '-', '_' or '.', got {self.id!r}"
            )
        if self.protocol_version != PROTOCOL_VERSION:
            raise RunSpecError(
                f"run.protocol_version {self.protocol_version} is not supported "
                f"(this swarmgrad speaks {PROTOCOL_VERSION})"
            )
