"""What every section of the run spec raises, and the check most of them share."""

from __future__ import annotations

import math

from swarmgrad.protocol.errors import SetupError


class RunSpecError(SetupError, ValueError):
    """The run spec is invalid; the message names the key and what is wrong with it."""


def positive(section: str, **values: float) -> None:
    for key, value in values.items():
        if not value > 0 or not math.isfinite(value):
            raise RunSpecError(f"{section}.{key} must be positive, got {value!r}")
