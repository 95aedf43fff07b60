"""What an all-reduce round is run with and what it returns: the run's agreed settings
(:class:`AllReduceConfig`), one member's :class:`RoundPlan` (with the fault-injection hooks
passed in from outside, ``hooks.py``), and the :class:`RoundResult` (``allreduce.py`` says what
a round guarantees)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import grpc
import torch

from swarmgrad.compression import Codec, get_codec
from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.hooks import RoundHooks
from swarmgrad.node.averaging.reducer import OwnerRules, PartReducer
from swarmgrad.node.averaging.sides import MemberSide, TrustedMember
from swarmgrad.node.kinds import Failure, Presence
from swarmgrad.node.trust.aggregate import Aggregator
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.v1 import averaging_pb2

_MIN_CHUNK_VALUES = 1024
#: Open runs: how long each step of the owner checks waits for the other members' messages, and
#: how many steps there are (reveals, reports, accusations).
CHECK_TIMEOUT_SECONDS = 5.0
CHECK_STEPS = 3
_MAX_CHUNK_VALUES = 1 << 24


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReduceConfig:
    """What every member of a run must agree on for its all-reduce rounds."""

    run_id: str
    spec_hash: bytes
    codec: str = "int8"
    codec_options: Mapping[str, float] = field(default_factory=dict)
    #: Values per streamed chunk (1 Mi fp32 = 4 MiB before compression).
    chunk_values: int = 1 << 20
    round_timeout_seconds: float = 60.0
    sender_timeout_seconds: float = 10.0
    reducer_timeout_seconds: float = 20.0
    #: How long a stream that arrives before the local round has started may wait for it.
    join_timeout_seconds: float = 5.0
    max_chunks_ahead: int = 4
    #: How owners combine members' values ("mean", "centered_clip" or "median").
    aggregator: str = "mean"
    #: Ignore members' declared weights (open runs: a weight is a claim nobody can check).
    uniform_weights: bool = False
    #: The codec owners send results in ("": the round's codec).
    result_codec: str = ""
    #: Owners keep an Observation of every member for the trust ledger, sign an account of
    #: each part, and members check every owner's result after the round (open runs).
    observe: bool = False
    #: How long each step of those checks waits for the other members' messages.
    check_timeout_seconds: float = CHECK_TIMEOUT_SECONDS
    #: Open runs: the chance a member audits one other owner's part after a round (None: one
    #: over the group's size, about one audit per group and round).
    audit_probability: float | None = None
    #: Open runs: members of its part an owner spot-checks a round (with a loss probe set).
    spot_checks: int = 0

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("run_id must not be empty")
        if self.audit_probability is not None and not 0.0 <= self.audit_probability <= 1.0:
            raise ValueError(f"audit_probability must be in [0, 1], got {self.audit_probability}")
        get_codec(self.codec, **self.codec_options)  # raises ValueError for a bad codec
        if self.result_codec:
            get_codec(self.result_codec)
        Aggregator(self.aggregator)  # raises ValueError for an unknown one
        if not _MIN_CHUNK_VALUES <= self.chunk_values <= _MAX_CHUNK_VALUES:
            raise ValueError(
                f"chunk_values must be in [{_MIN_CHUNK_VALUES}, {_MAX_CHUNK_VALUES}], "
                f"got {self.chunk_values}"
            )
        timeouts = (
            self.sender_timeout_seconds,
            self.reducer_timeout_seconds,
            self.round_timeout_seconds,
            self.join_timeout_seconds,
        )
        if not all(math.isfinite(t) and t > 0 for t in timeouts):
            raise ValueError("timeouts must be positive and finite")
        if not self.sender_timeout_seconds < self.reducer_timeout_seconds:
            raise ValueError(
                "reducer_timeout_seconds must exceed sender_timeout_seconds: an owner may wait "
                "a whole sender timeout for the slowest member before it can answer"
            )
        if not self.reducer_timeout_seconds <= self.round_timeout_seconds:
            raise ValueError("round_timeout_seconds must be at least reducer_timeout_seconds")
        if self.max_chunks_ahead < 1:
            raise ValueError("max_chunks_ahead must be at least 1")

    def make_codec(self) -> Codec:
        return get_codec(self.codec, **self.codec_options)

    def make_result_codec(self) -> Codec:
        """The codec owners' results travel in."""
        return get_codec(self.result_codec) if self.result_codec else self.make_codec()

    def owner_rules(self, *, abstains: bool = False) -> OwnerRules:
        """How owners aggregate (``abstains``: their own values stay out of their parts)."""
        return OwnerRules(
            aggregator=Aggregator(self.aggregator),
            uniform_weights=self.uniform_weights,
            result_codec=get_codec(self.result_codec) if self.result_codec else None,
            owner_abstains=abstains,
            open_timeout_seconds=self.sender_timeout_seconds,
            max_chunks_ahead=self.max_chunks_ahead,
        )

    @property
    def max_chunk_bytes(self) -> int:
        """Largest payload a chunk may have: uncompressed fp32 plus slack for codec metadata."""
        return 4 * self.chunk_values + 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    """What a round produced. See the module docstring for the exact guarantees."""

    averaged: torch.Tensor
    #: Members whose values are in every averaged chunk.
    contributors: tuple[str, ...]
    #: Members whose values are in some averaged chunks but not all (they failed mid-round).
    partial: tuple[str, ...]
    #: [start, end) ranges that were not averaged: they hold the caller's own values.
    missing: tuple[tuple[int, int], ...]
    #: Why each failed peer failed, as seen from this member.
    failures: Mapping[str, str]
    #: Each failed peer's kind of failure (timeout, protocol violation or dropped member).
    failure_kinds: Mapping[str, Failure] = field(default_factory=dict)
    #: With ``keep_sent``: this member's contribution as its owners decode it (its own part
    #: exact, every other chunk as encoded once and sent, chunks never sent exact).
    #: ``vector - sent`` is what the codec lost: the error feedback a caller carries on.
    sent: torch.Tensor | None = None
    #: Owners that answered a chunk of their part without this member's values in it, though
    #: they took them (screened, or an owner that leaves members out: open runs dispute it).
    excluded_by: tuple[str, ...] = ()
    #: The contributors of each averaged chunk, by (part, chunk index).
    chunk_contributors: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    #: With an ``owner_residual``: where this node's part starts in the vector, and the
    #: owner's error feedback over that part after the round (the caller's own tensor is only
    #: read: it moves this on when it applies the result, so an aborted round changes nothing).
    owner_residual: tuple[int, torch.Tensor] | None = None

    @property
    def complete(self) -> bool:
        return not self.missing and not self.partial


#: Is peer ``peer_id`` still there at ``endpoint``, and still in the round ``(round, group
#: id)``? (Returns within its own deadline.)
Alive = Callable[[str, str, tuple[int, bytes]], Awaitable[Presence]]


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan:
    """Who this member is in one round, and what it runs the round with."""

    me: int  # this member's index in the group
    group: Group
    #: This member's key: signs the header of every stream.
    signer: Signer
    config: AllReduceConfig
    #: Reduces this member's own part (None: it owns none).
    reducer: PartReducer | None
    #: The channel to an owner's endpoint (the node's transport).
    channel: Callable[[str], grpc.aio.Channel]
    #: Payload bytes this member sends ("sent") and receives ("received") as a client; the
    #: servicer counts its own side.
    traffic: Counter[str]
    #: This member's side of the round's policy (``sides.py``): trusted by default.
    side: MemberSide = field(default_factory=TrustedMember)
    #: Whether an owner's own values stay out of its part (the policy's rule).
    owner_abstains: bool = False
    hooks: RoundHooks | None = None
    #: Waits until so many bytes may go up the node's link (its upload cap), if any.
    pace: Callable[[int], Awaitable[None]] | None = None
    #: Report what the owners decode of this member's values (``RoundResult.sent``).
    keep_sent: bool = False
    #: Whether a peer of the round still answers at its endpoint, as itself, within the
    #: question's own deadline, and is still in the round: asked of an owner or a member that
    #: went quiet in it (None: the round's timeouts alone find a frozen peer).
    alive: Alive | None = None


def round_key(config: AllReduceConfig, group: Group) -> averaging_pb2.RoundKey:
    """The key every message of ``group``'s round carries."""
    return averaging_pb2.RoundKey(
        run_id=config.run_id,
        spec_hash=config.spec_hash,
        round=group.round,
        group_id=group.group_id,
    )
