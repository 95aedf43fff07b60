"""``[data]``: the corpus (the bundled demo, or shards and a tokenizer), batch size and seed."""

from __future__ import annotations

from dataclasses import dataclass

from swarmgrad.node.runspec.errors import RunSpecError, positive


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSection:
    source: str = "demo"  # "demo": the bundled corpus; "files": the shards in ``paths``
    #: Shards: text, .jsonl/.json or .parquet files, or glob patterns (node/training/shards.py).
    paths: tuple[str, ...] = ()
    #: A tokenizer.json to use (else a byte-level BPE is trained on the shards).
    tokenizer: str = ""
    #: Its SHA-256: pins the tokenizer for every peer (the path is then not part of the hash).
    tokenizer_sha256: str = ""
    text_field: str = "text"  # the column holding each row's text in jsonl / parquet shards
    batch_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in ("demo", "files"):
            raise RunSpecError(f"data.source must be 'demo' or 'files', got {self.source!r}")
        if self.source == "files" and not self.paths:
            raise RunSpecError("data.paths must list at least one file when data.source = 'files'")
        if (self.tokenizer or self.tokenizer_sha256) and self.source != "files":
            raise RunSpecError("data.tokenizer is for data.source = 'files'")
        if self.tokenizer_sha256 and not (
            self.tokenizer
            and len(self.tokenizer_sha256) == 64
            and all(c in "0123456789abcdef" for c in self.tokenizer_sha256)
        ):
            raise RunSpecError(
                "data.tokenizer_sha256 must be 64 lowercase hex digits, with data.tokenizer"
            )
        positive("data", batch_size=self.batch_size)
