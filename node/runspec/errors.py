"""What every section of the run spec raises, and the check most of them share."""

from __future__ import annotations

import math
from collections.abc import Sequence

from swarmgrad.protocol.errors import SetupError


class RunSpecError(SetupError, ValueError):
    """The run spec is invalid; the message names the key and what is wrong with it (every
    problem found, one a line, when there are several: ``problems``)."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) or (message,)

    @classmethod
    def of(cls, problems: Sequence[str]) -> RunSpecError:
        """One error for all of ``problems``."""
        if len(problems) == 1:
            return cls(problems[0])
        listed = "\n".join(f"  - {problem}" for problem in problems)
        return cls(f"{len(problems)} problems:\n{listed}", problems)


def positive(section: str, **values: float) -> None:
    for key, value in values.items():
        if not value > 0 or not math.isfinite(value):
            raise RunSpecError(f"{section}.{key} must be positive, got {value!r}")
