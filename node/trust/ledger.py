"""What this node has seen of each peer's updates as an owner, and whom it no longer averages with.

Every round, the owner of a part learns something of each member from its values of that part
(``aggregate.py``): its clip coefficient and cosine to the result, whether it was screened out
(all zeros, an absurd scale), whether it sent NaN or Inf, whether its values repeat an earlier
update (a *replay*: an old update sent again, its own or another peer's) or another member's
values this round (a *duplicate*). :class:`TrustLedger` turns these into flags, keeps a score
per peer (EMAs of clip and cosine) and decides local bans:

* zeros, NaN/Inf and an absurd scale ban at once: no honest update looks like that;
* misaligned (cosine < ``misaligned_below``), heavily clipped (clip < ``clipped_below``),
  replayed and duplicated updates ban after ``consecutive`` flagged rounds in a row, or
  ``window_flags`` flagged rounds of the last ``window`` (an attacker who alternates).

A round is one judgement: whatever flags a peer in one round (the owner's statistics, the
checks, an audit) counts once toward these rules. The ledger forgets an unbanned peer it has
not seen for ``forget_after_rounds`` rounds (peer ids come and go in an open run).

A member also notes the owners whose averaged chunks left its own values out (an *inclusion*
check): a dispute, counted per owner (``disputes`` in :meth:`TrustLedger.table`, a metric),
never a ban: the member cannot prove it, and an owner may have screened its values.

A ban is this node's own decision: it refuses the peer's streams, and its readiness records
name the peer as avoided, so no node groups the two (``node/averaging/grouping.py``).
Statistics are not proof, and a peer that bans on another's word can be made to ban an honest
peer, so a ban is published only with *evidence*: signed statements any peer checks for itself
(``node/averaging/open/evidence.py``), kept with the ban (:attr:`Ban.evidence`); a ban adopted
from such evidence names the peer it came from (:attr:`Ban.source`, ``node/trust/board.py``).
With a ``store`` path the ledger's bans outlive the process: written atomically at each new ban,
read back at start (``bans.py``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from swarmgrad.node.trust.bans import Ban, load_bans, save_bans, shown
from swarmgrad.node.trust.flags import DECISIVE, RELATIVE, Flag
from swarmgrad.node.trust.observations import Observation

log = logging.getLogger(__name__)

# The flags, bans and observations the ledger speaks of, where its callers have found them.
__all__ = ["Ban", "Flag", "Observation", "PeerScore", "TrustLedger", "TrustPolicy"]

#: Earlier fingerprints kept per chunk position.
SKETCH_MEMORY = 64
#: Chunk positions with fingerprints kept, the least recently used forgotten first. Positions
#: follow the parts' bounds, which members' declared bandwidths move, so without a bound a peer
#: could grow them every round. At most SKETCH_POSITIONS * SKETCH_MEMORY fingerprints of
#: SKETCH_VALUES fp64 values are kept: 256 MiB. That covers every chunk of a part of 256
#: chunks (256 Mi values at the default chunk size); beyond, replays are looked for in the
#: chunks seen most recently.
SKETCH_POSITIONS = 256
#: Rounds after which an unbanned peer this node has not seen is forgotten (its scores and
#: flags; a ban stays). Peer ids come and go in an open run, and each one kept costs memory and
#: a series per score on the metrics page.
FORGET_AFTER_ROUNDS = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class TrustPolicy:
    misaligned_below: float = 0.05
    clipped_below: float = 0.2
    replay_above: float = 0.999
    consecutive: int = 3
    window: int = 10
    window_flags: int = 5
    #: Weight of the newest round in a peer's clip and cosine EMAs.
    ema: float = 0.2
    #: See :data:`FORGET_AFTER_ROUNDS` and :data:`SKETCH_POSITIONS`.
    forget_after_rounds: int = FORGET_AFTER_ROUNDS
    sketch_positions: int = SKETCH_POSITIONS

    def __post_init__(self) -> None:
        if not (-1 <= self.misaligned_below < 1 and 0 <= self.clipped_below < 1):
            raise ValueError("misaligned_below must be in [-1, 1) and clipped_below in [0, 1)")
        if not 0 < self.replay_above < 1 or not 0 < self.ema <= 1:
            raise ValueError("replay_above must be in (0, 1) and ema in (0, 1]")
        if self.consecutive < 1 or not 1 <= self.window_flags <= self.window:
            raise ValueError("consecutive >= 1 and 1 <= window_flags <= window")
        if self.forget_after_rounds < self.window or self.sketch_positions < 1:
            raise ValueError("forget_after_rounds must be >= window and sketch_positions >= 1")


@dataclass(slots=True)
class PeerScore:
    #: Rounds in which this node judged the peer (its statistics and the checks of one round
    #: are one judgement), the last of them, and that round's flags.
    rounds: int = 0
    last_round: int = -1
    round_flags: set[Flag] = field(default_factory=set)
    #: Flagged rounds in a row before the last one.
    streak_before: int = 0
    #: The last round it was in a group with this node (judged, or a dispute): a peer not seen
    #: for ``forget_after_rounds`` is forgotten.
    seen_round: int = -1
    clip_ema: float = 1.0
    cosine_ema: float = 0.0
    consecutive: int = 0
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=64))
    flags: dict[Flag, int] = field(default_factory=dict)
    #: Rounds in which it, as an owner, left this node's values out.
    disputes: list[int] = field(default_factory=list)
    #: Spot checks of its values (``node/training/spot_check.py``), and the EMA of the loss
    #: they took off (positive: its update helps).
    spot_checks: int = 0
    loss_gain_ema: float = 0.0


class TrustLedger:
    """Scores and local bans of the peers this node has aggregated."""

    def __init__(self, policy: TrustPolicy | None = None, *, store: Path | None = None) -> None:
        """``store``: a file that keeps the bans across restarts (None: memory only)."""
        self.policy = policy or TrustPolicy()
        self.scores: dict[str, PeerScore] = {}
        self.store = store
        self.bans: dict[str, Ban] = load_bans(store) if store is not None else {}
        #: Flags raised, by kind (every round, banned or not).
        self.flag_counts: dict[Flag, int] = dict.fromkeys(Flag, 0)
        #: Fingerprints by chunk position, the least recently used position first.
        self._sketches: OrderedDict[tuple[int, int], deque[tuple[int, str, torch.Tensor]]] = (
            OrderedDict()
        )
        #: The same fingerprints stacked, with their norms and rounds, per position.
        self._stacked: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()  # a metrics scrape reads from another thread
        #: Inclusion disputes noted, all owners together.
        self.dispute_count = 0
        #: Bans adopted from evidence other peers published.
        self.adopted = 0
        #: Statistical bans not made because they would have isolated this node, and of whom.
        self.reconsidered = 0
        self._reconsidered: set[str] = set()

    def banned(self, peer_id: str) -> bool:
        return peer_id in self.bans

    def newest_bans(self) -> list[str]:
        """The banned peers, newest ban first (a node's readiness record names the first few
        as peers it avoids: ``node/averaging/grouping.py``)."""
        with self._lock:
            return [ban.peer_id for ban in self._newest_first()]

    def observe(self, round_: int, observations: Mapping[str, Observation]) -> list[Ban]:
        """Take one round's observations (this node as owner), and return the new bans."""
        self._mark_replays(round_, observations)
        new: list[Ban] = []
        with self._lock:
            for peer_id, seen in observations.items():
                ban = self._judge(round_, peer_id, seen)
                if ban is not None:
                    new.append(ban)
            self._forget(round_)
        return new

    def note(
        self, round_: int, flags: Mapping[str, Flag], evidence: Mapping[str, bytes] | None = None
    ) -> list[Ban]:
        """Take what the owner checks of ``round_`` found of some peers (one flag each), with
        the evidence that proves some of them."""
        new: list[Ban] = []
        proof = evidence or {}
        with self._lock:
            for peer_id, flag in flags.items():
                ban = self._judge(round_, peer_id, Observation(flags={flag}), proof.get(peer_id))
                if ban is not None:
                    new.append(ban)
            self._forget(round_)
        return new

    def adopt(self, peer_id: str, flag: Flag, round_: int, evidence: bytes, source: str) -> bool:
        """Ban ``peer_id`` on ``evidence`` published by ``source`` (already verified); whether
        that changed anything (a ban this node held without evidence gains it)."""
        with self._lock:
            held = self.bans.get(peer_id)
            if held is not None and held.evidence:
                return False
            if held is None:
                self.bans[peer_id] = Ban(peer_id, round_, (flag,), evidence, source)
                self.adopted += 1
                log.warning("banned %s (%s in round %d): evidence published by %s",
                            peer_id, flag, round_, source)  # fmt: skip
            else:
                self.bans[peer_id] = replace(held, evidence=evidence, source=source)
            self._save()
            return True

    def evidence(self) -> list[bytes]:
        """The evidence behind this node's bans, newest ban first."""
        with self._lock:
            return [ban.evidence for ban in self._newest_first() if ban.evidence]

    def _newest_first(self) -> list[Ban]:
        """The bans, newest first (under the lock)."""
        return sorted(self.bans.values(), key=lambda b: -b.round)

    def spot(self, peer_id: str, gain: float) -> None:
        """Note a spot check of ``peer_id``'s values: the loss they took off (a score, never a
        ban: one part on a few windows is noisy)."""
        if not math.isfinite(gain):
            return
        with self._lock:
            score = self.scores.setdefault(peer_id, PeerScore())
            first = score.spot_checks == 0
            score.spot_checks += 1
            score.loss_gain_ema += (1.0 if first else self.policy.ema) * (
                gain - score.loss_gain_ema
            )

    def dispute(
        self,
        round_: int,
        owners: Iterable[str],
        why: str = "left this node's values out of its part",
    ) -> None:
        """Note owners that left this node's values out of ``round_``, or that others say broke
        a rule towards them (never a ban: nobody can prove it)."""
        with self._lock:
            for owner in owners:
                score = self.scores.setdefault(owner, PeerScore())
                score.seen_round = max(score.seen_round, round_)
                disputes = score.disputes
                disputes.append(round_)
                del disputes[:-64]
                self.dispute_count += 1
                log.warning("round %d: %s %s", round_, owner, why)

    def _judge(
        self, round_: int, peer_id: str, seen: Observation, evidence: bytes | None = None
    ) -> Ban | None:
        policy = self.policy
        flags = set(seen.flags)
        if seen.numel:
            if seen.cosine < policy.misaligned_below:
                flags.add(Flag.MISALIGNED)
            if seen.clip < policy.clipped_below:
                flags.add(Flag.CLIPPED)
        score = self.scores.setdefault(peer_id, PeerScore())
        # One round is one judgement, however many parts of it (the owner's statistics, the
        # checks, the audits) flag the peer: the rules count rounds, as the flags' meaning does.
        score.seen_round = max(score.seen_round, round_)
        if round_ > score.last_round:
            score.rounds += 1
            score.last_round = round_
            score.round_flags = set()
            score.streak_before = score.consecutive
            score.recent.append(False)
        if round_ == score.last_round:
            new_flags = flags - score.round_flags
            score.round_flags |= flags
            score.consecutive = score.streak_before + 1 if score.round_flags else 0
            score.recent[-1] = bool(score.round_flags)
        else:  # an earlier round's audit, done late: its flags count, the streak stays
            new_flags = flags
        if seen.numel and not flags & DECISIVE:
            score.clip_ema += policy.ema * (seen.clip - score.clip_ema)
            score.cosine_ema += policy.ema * (seen.cosine - score.cosine_ema)
        for flag in new_flags:
            score.flags[flag] = score.flags.get(flag, 0) + 1
            self.flag_counts[flag] += 1
        held = self.bans.get(peer_id)
        if held is not None and evidence and not held.evidence:
            self.bans[peer_id] = replace(held, evidence=evidence)
            self._save()
        if held is not None or not new_flags:
            return None
        window = list(score.recent)[-policy.window :]
        if (
            flags & DECISIVE
            or score.consecutive >= policy.consecutive
            or sum(window) >= policy.window_flags
        ):
            if flags <= RELATIVE and not evidence and self._isolating(peer_id):
                return None
            ban = Ban(peer_id, round_, tuple(sorted(flags)), evidence or b"")
            self.bans[peer_id] = ban
            log.warning("round %d: banned %s (%s)", round_, peer_id, ban.reason)
            self._save()
            return ban
        return None

    def _isolating(self, peer_id: str) -> bool:
        """Whether banning ``peer_id`` for how it compares with the others (:data:`RELATIVE`)
        would leave this node refusing half or more of the peers it knows: then its own view is
        the odd one out (an honest node among colluders sees the honest as outliers), and the
        flags stay flags."""
        local = sum(1 for b in self.bans.values() if not b.evidence and set(b.flags) <= RELATIVE)
        if 2 * (local + 1) <= len(self.scores):
            return False
        self.reconsidered += 1
        if peer_id not in self._reconsidered:
            self._reconsidered.add(peer_id)
            log.warning(
                "not banning %s on its statistics: this node would then refuse %d of the %d "
                "peers it knows", peer_id, local + 1, len(self.scores),
            )  # fmt: skip
        return True

    def _mark_replays(self, round_: int, observations: Mapping[str, Observation]) -> None:
        """Flag fingerprints that match one from an earlier round (anyone's), then remember
        this round's."""
        for seen in observations.values():
            if any(self._replayed(round_, p, f) for p, f in seen.sketches.items()):
                seen.flags.add(Flag.REPLAY)
        for peer_id, seen in observations.items():
            for position, fingerprint in seen.sketches.items():
                memory = self._sketches.get(position)
                if memory is None:
                    memory = self._sketches[position] = deque(maxlen=SKETCH_MEMORY)
                    while len(self._sketches) > self.policy.sketch_positions:
                        self._sketches.popitem(last=False)
                self._sketches.move_to_end(position)
                memory.append((round_, peer_id, fingerprint))
        self._stacked.clear()  # built again next round from the memory as it is then

    def _replayed(self, round_: int, position: tuple[int, int], fingerprint: torch.Tensor) -> bool:
        """Whether ``fingerprint`` is (nearly) one remembered at ``position`` from an earlier
        round: their cosine above ``replay_above`` (all earlier ones at once)."""
        stacked = self._stacked.get(position)
        if stacked is None:  # built once a round per position, as the memory changes
            memory = [(r, old) for r, _, old in self._sketches.get(position, ())]
            if not memory or any(old.shape != fingerprint.shape for _, old in memory):
                return False
            olds = torch.stack([old for _, old in memory])
            rounds = torch.tensor([r for r, _ in memory])
            stacked = self._stacked[position] = (
                olds,
                torch.linalg.vector_norm(olds, dim=1),
                rounds,
            )
        olds, norms, rounds = stacked
        denominators = norms * torch.linalg.vector_norm(fingerprint)
        cosines = (olds @ fingerprint) / denominators
        usable = (rounds < round_) & torch.isfinite(cosines) & (denominators > 0)
        return bool((cosines[usable] > self.policy.replay_above).any())

    def _forget(self, round_: int) -> None:
        """Drop the scores of unbanned peers not seen in ``forget_after_rounds`` rounds."""
        oldest = round_ - self.policy.forget_after_rounds
        gone = [
            peer_id
            for peer_id, score in self.scores.items()
            if score.seen_round < oldest and peer_id not in self.bans
        ]
        for peer_id in gone:
            del self.scores[peer_id]
            self._reconsidered.discard(peer_id)

    def table(self, peers: Iterable[str] | None = None) -> dict[str, dict[str, object]]:
        """Per peer: rounds seen, clip and cosine EMAs, flags, ban (status files, display)."""
        with self._lock:
            names = list(dict.fromkeys([*self.scores, *self.bans]) if peers is None else peers)
            out: dict[str, dict[str, object]] = {}
            for peer_id in names:
                ban = self.bans.get(peer_id)
                score = self.scores.get(peer_id)
                if score is None and ban is None:
                    continue
                score = score or PeerScore()  # banned on published evidence, never aggregated
                out[peer_id] = {
                    "rounds": score.rounds,
                    "seen_round": score.seen_round if score.seen_round >= 0 else None,
                    "clip_ema": round(score.clip_ema, 4),
                    "cosine_ema": round(score.cosine_ema, 4),
                    "flags": {str(k): v for k, v in sorted(score.flags.items())},
                    "disputes": len(score.disputes),
                    "spot_checks": score.spot_checks,
                    "loss_gain_ema": round(score.loss_gain_ema, 5) if score.spot_checks else None,
                    "banned": None if ban is None else shown(ban),
                }
            return out

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(flags raised by kind and "dispute" for inclusion disputes, bans by reason), safe
        from another thread."""
        with self._lock:
            reasons: dict[str, int] = {}
            for ban in self.bans.values():
                reasons[ban.reason] = reasons.get(ban.reason, 0) + 1
            flags = {str(k): v for k, v in self.flag_counts.items()}
            return flags | {"dispute": self.dispute_count}, reasons

    def _save(self) -> None:
        if self.store is None:
            return
        try:
            save_bans(self.store, self.bans.values())
        except OSError as error:  # the ban holds in memory; say it will not survive a restart
            log.warning("could not save the bans to %s: %s", self.store, error)
