"""What a node can hold against a peer: the flags its trust ledger counts (``ledger.py``), and
which of them ban at once or only say how a peer compares with the others."""

from __future__ import annotations

import enum

__all__ = ["DECISIVE", "RELATIVE", "Flag"]


class Flag(enum.StrEnum):
    ZERO = "zero"  # all zeros
    NON_FINITE = "non_finite"  # NaN or Inf
    SCALE = "scale"  # largest value absurdly above the others'
    MISALIGNED = "misaligned"  # points away from the result
    CLIPPED = "clipped"  # far outside the others' radius
    REPLAY = "replay"  # an earlier update sent again
    DUPLICATE = "duplicate"  # the same values as another member's this round
    OUTSIZED = "outsized"  # far above the owner's own values (open/owner.py's OWN_SCALE_LIMIT)
    # Owner checks (node/averaging/open/checks.py): the first three rest on signed evidence.
    LYING_OWNER = "lying_owner"  # its result failed the members' projection check
    EQUIVOCATION = "equivocation"  # it signed two accounts of one part
    FALSE_REPORT = "false_report"  # its check report or secret contradicts what it signed
    FORGERY = "forgery"  # as an owner, it listed a commitment a member never signed
    FAILED_AUDIT = "failed_audit"  # its part, aggregated again from the signed chunks, differs
    SILENT = "silent"  # it revealed or reported nothing in time
    WITHHELD = "withheld"  # as an owner, it sent this node every result but no account of them


#: Flags no honest peer raises: one is enough to ban.
DECISIVE = frozenset(
    {
        Flag.ZERO,
        Flag.NON_FINITE,
        Flag.SCALE,
        Flag.LYING_OWNER,
        Flag.EQUIVOCATION,
        Flag.FALSE_REPORT,
        Flag.FORGERY,
        Flag.FAILED_AUDIT,
    }
)


#: Flags that say how a member's values compare with the other members' (not what they are):
#: only where honest members are most of a part do they point at the right peer.
RELATIVE = frozenset({Flag.CLIPPED, Flag.MISALIGNED})
