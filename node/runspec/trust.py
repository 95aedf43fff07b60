"""``[trust]``: whom a run trusts (trusted, private, open) and how owners aggregate."""

from __future__ import annotations

from dataclasses import dataclass

from swarmgrad.node.runspec.errors import RunSpecError

TRUST_MODES = ("trusted", "private", "open")
#: Open runs' group size when the spec gives none: an owner's part then has 7 other members,
#: and two colluders stay a minority of them.
OPEN_GROUP_SIZE = 8
#: The smallest group whose parts' statistics judge members (``node/trust/observations.py``
#: ``MIN_JUDGED_MEMBERS`` other members, the owner's own values being out of its part).
OPEN_JUDGED_GROUP_SIZE = 6
#: The largest group of an open run: evidence against a part's owner lists the group's members,
#: and peers take no evidence listing more (``node/averaging/open/evidence.py``).
OPEN_MAX_GROUP_SIZE = 256
AGGREGATORS = ("mean", "centered_clip", "median", "trimmed_mean")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrustSection:
    """How far peers are trusted.

    ``trusted`` (the default): every peer is honest; owners take the weighted mean. ``open``:
    anyone may join and some may be malicious; owners weigh every member alike, aggregate
    robustly (CenteredClip by default), return results in fp16, score members and stop
    averaging with those whose updates are flagged (node/trust/ledger.py). ``private``: only
    the peers on the allowlist that ``run_key`` signs (``swarmgrad publish --allowlist``) take
    part; everyone else is refused at matchmaking and at every RPC (node/trust/allowlist.py).
    """

    mode: str = "trusted"
    #: "": the mode's own (mean when trusted or private, centered_clip when open).
    aggregator: str = ""
    #: The fingerprint (sg...) of the run key that signs a private run's allowlist.
    run_key: str = ""
    #: Open runs: members of its part each owner spot-checks a round, by the loss their values
    #: take off on windows drawn from (run, peer, round) (node/training/spot_check.py).
    spot_checks: int = 1

    def __post_init__(self) -> None:
        if self.mode not in TRUST_MODES:
            raise RunSpecError(
                f"trust.mode must be one of {', '.join(TRUST_MODES)}, got {self.mode!r}"
            )
        if self.aggregator and self.aggregator not in AGGREGATORS:
            raise RunSpecError(
                f"trust.aggregator must be one of {', '.join(AGGREGATORS)}, got {self.aggregator!r}"
            )
        if self.mode == "private" and not (
            self.run_key.startswith("sg") and 20 <= len(self.run_key) <= 64
        ):
            raise RunSpecError(
                'trust.mode = "private" needs trust.run_key: the fingerprint (sg...) of the run '
                "key that signs the allowlist (swarmgrad run-key FILE prints it)"
            )
        if not 0 <= self.spot_checks <= 64:
            raise RunSpecError(f"trust.spot_checks must be in [0, 64], got {self.spot_checks}")
        if self.mode == "open" and self.aggregator == "mean":
            raise RunSpecError(
                'trust.aggregator = "mean" in an open run: one malicious peer could move the '
                'average anywhere; use "centered_clip" or "median"'
            )

    @property
    def open(self) -> bool:
        return self.mode == "open"

    @property
    def private(self) -> bool:
        return self.mode == "private"

    @property
    def effective_aggregator(self) -> str:
        return self.aggregator or ("centered_clip" if self.open else "mean")
