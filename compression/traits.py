"""What each codec is safe for, readable without torch (the run spec checks it when it loads).

A codec declares its :class:`Traits` as a class attribute (``traits = BUILTIN["int8"]`` for the
built-in ones, whose table is here so that ``swarmgrad status``, ``runs`` and ``publish`` check a
spec without importing torch). A codec registered from Python declares its own; one that
declares nothing is safe for neither open runs nor pipeline boundaries.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["BUILTIN", "Traits", "known_codecs", "refusal", "safe_for", "traits_of"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Traits:
    """Where a codec's values may go."""

    #: Each coordinate decodes on its own, the same on every peer: an open run's owner can
    #: screen and robustly aggregate its members' values coordinate by coordinate, and members
    #: can re-check its results. Per-member top-k indices and low-rank factors cannot be.
    open_runs: bool = False
    #: Stateless per message and accurate enough for a stage's forward activations.
    activations: bool = False
    #: The same for activation gradients, most of whose values lie far below 1 (fp16's smallest
    #: normal number, 6e-5, loses them).
    gradients: bool = False
    #: Why it is not safe where it is not (said when a spec asks for it there).
    limits: str = ""
    #: The options a run spec may give it (``[averaging] codec_options``), by name.
    options: tuple[str, ...] = ()
    #: A part's owner keeps what encoding its result dropped and adds it to its next result of
    #: those values (a top-k result keeps a fraction of the merged members' values: without
    #: this, the rest would be lost for good, though each member's own feedback counts it as
    #: sent).
    owner_feedback: bool = False


_DENSE = Traits(open_runs=True, activations=True, gradients=True)
_STATEFUL = (
    "its values (per-member top-k indices, low-rank factors) cannot be screened, robustly "
    "aggregated or checked coordinate by coordinate, and its error feedback keeps state "
    "across messages"
)

#: The built-in codecs (what importing ``swarmgrad.compression`` registers; a unit test keeps
#: this table and the classes' own ``traits`` equal).
BUILTIN: dict[str, Traits] = {
    "none": _DENSE,
    "fp16": Traits(
        open_runs=True,
        limits="activation gradients underflow fp16 (most lie below its smallest normal number)",
    ),
    "bf16": _DENSE,
    "int8": _DENSE,
    "int4": Traits(open_runs=True, limits="4 bits per value lose too much of a stage's signal"),
    "topk": Traits(limits=_STATEFUL, options=("fraction",), owner_feedback=True),
    "sparse": Traits(limits=_STATEFUL, options=("density", "bits", "chunk"), owner_feedback=True),
    "powersgd": Traits(limits=_STATEFUL, options=("rank",)),
}

_USES = {
    "open_runs": 'trust.mode = "open"',
    "activations": "pipeline activations",
    "gradients": "pipeline gradients",
}


def _registry() -> dict[str, Traits]:
    # Codecs registered from Python: only a process that imported the codecs (and torch) has
    # any, and only it can have asked for one.
    base = sys.modules.get("swarmgrad.compression.base")
    if base is None:
        return {}
    return base.registered_traits()  # type: ignore[no-any-return]


def known_codecs() -> list[str]:
    """Every codec name a spec may give: the built-in ones, then any registered from Python."""
    return list(dict.fromkeys([*BUILTIN, *_registry()]))


def traits_of(codec: str) -> Traits | None:
    """``codec``'s traits, or None for a name nobody registered."""
    return BUILTIN.get(codec) or _registry().get(codec)


def safe_for(use: str) -> list[str]:
    """The known codecs safe for ``use`` (a :class:`Traits` field), for error messages."""
    return [name for name in known_codecs() if getattr(traits_of(name), use)]


def refusal(codec: str, use: str) -> str | None:
    """Why ``codec`` may not be used for ``use`` (a :class:`Traits` field), or None if it may."""
    traits = traits_of(codec)
    if traits is None:
        return f"codec {codec!r} is unknown; choose one of {', '.join(known_codecs())}"
    if getattr(traits, use):
        return None
    limits = f" ({traits.limits})" if traits.limits else ""
    return f"codec {codec!r} is not safe for {_USES[use]}{limits}; use {', '.join(safe_for(use))}"
