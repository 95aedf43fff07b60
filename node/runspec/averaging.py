"""``[averaging]``: how a round's values travel (codec, chunks), its groups and deadlines."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmgrad.compression.traits import known_codecs, traits_of
from swarmgrad.node.averaging.matchmaking import MAX_MATCHMAKING_TIMEOUT_SECONDS
from swarmgrad.node.runspec.errors import RunSpecError, positive


@dataclass(frozen=True, slots=True, kw_only=True)
class AveragingSection:
    codec: str = "int8"
    #: The codec's own options (``sparse``: density, bits, chunk; ``topk``: fraction;
    #: ``powersgd``: rank); their values are checked when the codec is built.
    codec_options: dict[str, float] = field(default_factory=dict)
    #: The codec part owners send results in, with its default options ("": the codec's own;
    #: open runs: fp16). With ``sparse`` values and ``int8`` results a member's values go out
    #: sparse, but each owner sends its part's result in int8 to every other member: a peer's
    #: upload and download are each about one int8 vector a round (a loss/bytes trade-off,
    #: docs/benchmarks.md, "The sparse codec, second pass").
    result_codec: str = ""
    group_size: int = 4
    chunk_values: int = 1 << 20
    matchmaking_timeout_seconds: float = 15.0
    round_timeout_seconds: float = 60.0
    sender_timeout_seconds: float = 10.0
    reducer_timeout_seconds: float = 20.0

    def __post_init__(self) -> None:
        traits = traits_of(self.codec)
        if traits is None:
            known = ", ".join(known_codecs())
            raise RunSpecError(f"averaging.codec {self.codec!r} is unknown; choose one of {known}")
        unknown = sorted(set(self.codec_options) - set(traits.options))
        if unknown:
            takes = ", ".join(traits.options) or "none"
            raise RunSpecError(
                f"averaging.codec_options {', '.join(unknown)}: codec {self.codec!r} takes {takes}"
            )
        for key, value in self.codec_options.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RunSpecError(f"averaging.codec_options.{key} must be a number")
        if self.result_codec and traits_of(self.result_codec) is None:
            known = ", ".join(known_codecs())
            raise RunSpecError(
                f"averaging.result_codec {self.result_codec!r} is unknown; choose one of {known} "
                f'(or "": the codec\'s own)'
            )
        if self.group_size < 2:
            raise RunSpecError(f"averaging.group_size must be at least 2, got {self.group_size}")
        positive(
            "averaging",
            chunk_values=self.chunk_values,
            matchmaking_timeout_seconds=self.matchmaking_timeout_seconds,
            round_timeout_seconds=self.round_timeout_seconds,
            sender_timeout_seconds=self.sender_timeout_seconds,
            reducer_timeout_seconds=self.reducer_timeout_seconds,
        )
        if self.matchmaking_timeout_seconds > MAX_MATCHMAKING_TIMEOUT_SECONDS:
            raise RunSpecError(
                f"averaging.matchmaking_timeout_seconds must be at most "
                f"{MAX_MATCHMAKING_TIMEOUT_SECONDS:g} (readiness records must fit the DHT's "
                f"lifetime cap), got {self.matchmaking_timeout_seconds:g}"
            )
        if not self.sender_timeout_seconds < self.reducer_timeout_seconds:
            raise RunSpecError(
                "averaging.reducer_timeout_seconds must exceed averaging.sender_timeout_seconds"
            )
        if not self.reducer_timeout_seconds <= self.round_timeout_seconds:
            raise RunSpecError(
                "averaging.round_timeout_seconds must be at least averaging.reducer_timeout_seconds"
            )
