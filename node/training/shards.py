"""``[data] source = "files"``: the run's own shards (text, jsonl, parquet), a tokenizer, and a
token cache that large corpora stream into and nodes memory-map.

Shards are the files and glob patterns in ``data.paths`` (sorted within a pattern). Text files
(``.txt``, ``.md``, anything else) are one document each; ``.jsonl``/``.json`` and ``.parquet``
hold one document per row, its text in the ``data.text_field`` column. Rows are read with Hugging
Face ``datasets`` in streaming mode (one batch at a time, never the whole corpus in memory) and
tokenized in batches into ``<cache>/files-<key>/tokens.bin`` (uint16, or uint32 for vocabularies
over 65,536), written to a temporary file and renamed, its manifest last. The key covers every
shard's path, size and modification time, the tokenizer's bytes and the text field, so a changed
shard or tokenizer builds a new cache; a start with a valid cache only maps the file.

The tokenizer is ``data.tokenizer`` (a ``tokenizer.json``; ``data.tokenizer_sha256`` pins it for
every peer), else a byte-level BPE trained on the shards, as for the demo corpus.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from swarmgrad.node.files import atomic_write, read_pinned
from swarmgrad.node.runspec import DataSection
from swarmgrad.protocol.errors import SetupError

log = logging.getLogger(__name__)

_FORMAT = 1
#: Shard suffixes read as rows (``datasets``' builder for each); anything else is one text.
ROWS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
#: Compressions Hugging Face datasets reads a json(l) shard through.
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
BATCH_DOCUMENTS = 1024


class DataError(SetupError):
    """The corpus could not be read or prepared; the message says what to do."""


def shard_paths(data: DataSection) -> list[Path]:
    """The shards ``data.paths`` names (patterns expanded, sorted), each once; DataError for a
    missing file or a pattern that matches nothing."""
    found: list[Path] = []
    for entry in data.paths:
        if glob.has_magic(entry):
            matches = sorted(Path(p) for p in glob.glob(entry, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"data.paths: {entry!r} matches no file")
            found += matches
        elif not Path(entry).is_file():
            raise DataError(f"data.paths: {entry} does not exist or is not a file")
        else:
            found.append(Path(entry))
    return list(dict.fromkeys(found))


def documents(paths: list[Path], text_field: str) -> Iterator[str]:
    """Every document of the shards, in order; DataError for an unreadable shard or a row
    without the text field."""
    for path in paths:
        kind = _kind(path)
        if kind is None:
            try:
                raw = path.read_bytes()
            except OSError as error:
                raise DataError(f"cannot read data file {path}: {error.strerror}") from None
            if b"\0" in raw[:65536]:
                raise DataError(
                    f"{path} is not text (a NUL byte near its start): text shards are UTF-8; "
                    f"jsonl and parquet shards are read by suffix ({', '.join(sorted(ROWS))}, "
                    f"jsonl/json also compressed: .gz, .bz2, .xz, .zst)"
                )
            yield raw.decode("utf-8", errors="replace")
            continue
        try:
            rows = _stream(kind, path)
            for index, row in enumerate(rows):
                text = row.get(text_field)
                if not isinstance(text, str):
                    raise DataError(
                        f"{path}: row {index} has no text in {text_field!r} (data.text_field); "
                        f"its columns: {', '.join(sorted(row))}"
                    )
                yield text
        except DataError:
            raise
        except Exception as error:  # datasets/pyarrow raise many kinds for a damaged file
            raise DataError(f"cannot read data file {path}: {error}") from None


def _kind(path: Path) -> str | None:
    """How a shard is read: ``json`` / ``parquet`` rows (``.jsonl.gz`` too), or None: text."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    if len(suffixes) >= 2 and suffixes[-1] in COMPRESSED and ROWS.get(suffixes[-2]) == "json":
        return "json"
    return ROWS.get(path.suffix.lower())


def _stream(kind: str, path: Path) -> Iterator[dict[str, Any]]:
    try:
        import datasets
    except ImportError as error:
        raise DataError(
            f"{path}: jsonl and parquet shards need Hugging Face datasets ({error}); "
            f'pip install "swarmgrad[data]"'
        ) from None
    datasets.logging.set_verbosity_error()
    stream = datasets.load_dataset(kind, data_files=[str(path)], split="train", streaming=True)
    yield from stream


def load_tokenizer(data: DataSection, vocab_size: int) -> Tokenizer:
    """``data.tokenizer``, after checking its hash (if pinned) and that its ids fit the model."""
    path = Path(data.tokenizer)
    raw = read_pinned(
        path,
        data.tokenizer_sha256,
        key="data.tokenizer",
        what="the tokenizer this run uses",
        error=DataError,
    )
    try:
        tokenizer = Tokenizer.from_str(raw.decode())
    except Exception as error:  # tokenizers raises a plain Exception for a bad file
        raise DataError(f"data.tokenizer: {path} is not a tokenizer.json: {error}") from None
    check_ids(tokenizer, vocab_size, f"data.tokenizer: {path}")
    return tokenizer


def largest_id(tokenizer: Tokenizer) -> int:
    """The largest token id (ids need not be dense: a tokenizer may skip some)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)


def check_ids(tokenizer: Tokenizer, vocab_size: int, what: str) -> None:
    """DataError unless every id of ``tokenizer`` is below ``model.vocab_size`` (the model's
    embedding has that many rows: a larger id crashes the first step)."""
    top = largest_id(tokenizer)
    if top >= vocab_size:
        raise DataError(
            f"{what}: token ids reach {top}, but model.vocab_size is {vocab_size}: "
            f"set model.vocab_size to at least {top + 1}"
        )


def cache_key(paths: list[Path], tokenizer: Tokenizer, text_field: str) -> str:
    """What the token cache depends on: the shards (path, size, mtime), tokenizer, field."""
    digest = hashlib.sha256(f"{_FORMAT}\0{text_field}\0".encode())
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    digest.update(tokenizer.to_str().encode())
    return digest.hexdigest()[:24]


def token_dtype(tokenizer: Tokenizer) -> np.dtype[Any]:
    return np.dtype("<u2") if largest_id(tokenizer) < 1 << 16 else np.dtype("<u4")


def build_cache(
    folder: Path, paths: list[Path], tokenizer: Tokenizer, text_field: str, key: str
) -> None:
    """Tokenize the shards batch by batch into ``folder`` (temporary file, fsync, rename; the
    manifest last, vouching for the tokens)."""
    folder.mkdir(parents=True, exist_ok=True)
    _sweep_partials(folder)
    dtype = token_dtype(tokenizer)
    target = folder / "tokens.bin"
    partial = folder / f".tokens.bin.{os.getpid()}"
    count, docs = 0, 0
    try:
        with open(partial, "wb") as out:
            batch: list[str] = []
            for document in documents(paths, text_field):
                batch.append(document)
                if len(batch) >= BATCH_DOCUMENTS:
                    count += _write(out, tokenizer, batch, dtype)
                    docs += len(batch)
                    batch = []
            if batch:
                count += _write(out, tokenizer, batch, dtype)
                docs += len(batch)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    manifest = {
        "format": _FORMAT,
        "key": key,
        "shards": [str(p) for p in paths],
        "documents": docs,
        "num_tokens": count,
        "dtype": dtype.str,
    }
    atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1).encode())
    log.info("data: %d documents, %d tokens, cached in %s", docs, count, folder)


def _sweep_partials(folder: Path) -> None:
    """Delete the partial token files of builds killed before they could (their process is
    gone); a build still running elsewhere keeps its own."""
    for path in folder.glob(".tokens.bin.*"):
        pid = path.name.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def encode(tokenizer: Tokenizer, texts: Sequence[str], dtype: np.dtype[Any]) -> np.ndarray:
    """``texts`` tokenized and concatenated, as ``dtype`` ids."""
    ids = [np.asarray(e.ids, dtype=dtype) for e in tokenizer.encode_batch(list(texts))]
    return np.concatenate(ids) if ids else np.empty(0, dtype=dtype)


def _write(out: Any, tokenizer: Tokenizer, batch: list[str], dtype: np.dtype[Any]) -> int:
    tokens = encode(tokenizer, batch, dtype)
    out.write(tokens.tobytes())
    return len(tokens)


def load_cache(folder: Path, key: str) -> np.ndarray | None:
    """The cached tokens (memory-mapped, read-only), or None if absent, stale or damaged."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        dtype = np.dtype(manifest["dtype"])
        expected = int(manifest["num_tokens"])
        if manifest.get("format") != _FORMAT or manifest.get("key") != key:
            return None
        size = (folder / "tokens.bin").stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if size != expected * dtype.itemsize:
        log.warning("data cache in %s does not match its manifest; rebuilding", folder)
        return None
    if expected == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(folder / "tokens.bin", dtype=dtype, mode="r")
