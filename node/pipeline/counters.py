"""What a pipeline trainer counts per stage: calls, retries, resends, failures, bytes each way,
waits and failovers (its status file's ``stages``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swarmgrad.protocol import stage as stage_protocol
from swarmgrad.protocol.v1 import stage_pb2

#: The requests that carry a microbatch (Sync carries none).
MicrobatchRequest = (
    stage_pb2.ForwardRequest | stage_pb2.ForwardLossRequest | stage_pb2.BackwardRequest
)


@dataclass(slots=True)
class StageCounters:
    """What one stage's traffic and failures were, seen from the trainer."""

    calls: int = 0
    retries: int = 0  # calls repeated on another replica
    resends: int = 0  # inputs sent again for a backward
    failures: dict[str, int] = field(default_factory=dict)
    #: Payload bytes the trainer sent the stage, and received from it, by kind: "tokens" (ids
    #: and labels), "activations", "gradients", "resent" (inputs sent again for a backward).
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    wait_seconds: float = 0.0  # waiting for a live replica
    #: Samples of steps that failed at this stage (no live replica): their work at every stage
    #: is done again when the step is.
    lost_samples: int = 0
    #: Per call that failed over: seconds from its first failure to its answer elsewhere, and
    #: the trainer step it belonged to.
    failover_seconds: list[float] = field(default_factory=list)
    failover_steps: list[int] = field(default_factory=list)

    def count(self, into: dict[str, int], kind: str, size: int) -> None:
        if size:
            into[kind] = into.get(kind, 0) + size

    def request(self, message: MicrobatchRequest) -> None:
        """Count what ``message`` sends the stage."""
        backward = isinstance(message, stage_pb2.BackwardRequest)
        for kind, size in stage_protocol.payload_sizes(message):
            resent = backward and kind != "gradients"  # a backward's inputs are sent again
            self.count(self.sent, "resent" if resent else kind, size)

    def reply(self, reply: Any) -> None:
        """Count what the stage's ``reply`` brought back."""
        if isinstance(reply, stage_pb2.ForwardReply):
            self.count(self.received, "activations", len(reply.outputs.payload))
        else:
            self.count(self.received, "gradients", len(reply.grad_inputs.payload))

    def as_dict(self, samples: int) -> dict[str, Any]:
        per = max(samples, 1)
        return {
            "calls": self.calls,
            "retries": self.retries,
            "resends": self.resends,
            "failures": dict(self.failures),
            "bytes_up_per_sample": sum(self.sent.values()) / per,
            "bytes_down_per_sample": sum(self.received.values()) / per,
            "sent_per_sample": {k: v / per for k, v in self.sent.items()},
            "received_per_sample": {k: v / per for k, v in self.received.items()},
            "wait_seconds": self.wait_seconds,
            "lost_samples": self.lost_samples,
            "failover_seconds": list(self.failover_seconds),
            "failover_steps": list(self.failover_steps),
        }
