"""Where faults come into a round from outside: hooks that tests and simulations pass in.

Production code never sets them; a malicious or faulty peer in a test or a simulation is the
real node with hooks passed to its rounds (``simulations/attacks.py``). A member's hooks see
every chunk it sends; an owner's see each chunk's result before it is published.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RoundHooks(Protocol):
    """Fault injection as a member: sees every outgoing chunk."""

    async def before_send(self, owner: int, index: int, payload: bytes) -> bytes:
        """Called with each encoded chunk before it goes to ``owner``; returns what to send."""
        ...


class OwnerHooks(Protocol):
    """Fault injection as an owner: a lying owner's results."""

    def result(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """Called with chunk ``index``'s aggregate; returns what the owner publishes."""
        ...
