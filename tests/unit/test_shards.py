"""``[data] source = "files"``: shards of text, jsonl and parquet with a given tokenizer,
tokenized once into a cache; a peer's batches resume exactly from a checkpoint's cursor; bad input
is named."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models

from swarmgrad.node.runspec import DataSection, RunSpec, RunSpecError
from swarmgrad.node.training.data import DataError, load_corpus, train_tokenizer
from swarmgrad.node.training.device import Prefetched
from swarmgrad.node.training.shards import token_dtype

LINES = [
    f"Line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i * 3}." for i in range(400)
]


def make_shards(folder: Path) -> tuple[Path, str]:
    """A text shard, two jsonl shards and a parquet shard; a tokenizer trained on other text."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("\n".join(LINES[:100]))
    for part in (0, 1):
        rows = LINES[100 + 100 * part : 200 + 100 * part]
        (folder / f"b-{part}.jsonl").write_text(
            "".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(rows))
        )
    pq.write_table(pa.table({"text": LINES[300:], "n": list(range(100))}), folder / "c.parquet")
    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog 0123456789:."], 300)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def files_section(folder: Path, tokenizer: Path, digest: str) -> DataSection:
    return DataSection(
        source="files",
        paths=(str(folder / "a.txt"), str(folder / "b-*.jsonl"), str(folder / "c.parquet")),
        tokenizer=str(tokenizer),
        tokenizer_sha256=digest,
    )


def test_shards_of_every_kind_are_tokenized_once_with_the_given_tokenizer(tmp_path: Path) -> None:
    tokenizer_path, digest = make_shards(tmp_path / "data")
    data = files_section(tmp_path / "data", tokenizer_path, digest)
    corpus = load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    documents = ["\n".join(LINES[:100]), *LINES[100:]]  # the text file is one document
    expected = np.concatenate([tokenizer.encode(d).ids for d in documents])
    assert np.array_equal(np.asarray(corpus.tokens), expected)
    assert corpus.tokens.dtype == np.dtype("<u2")
    (cache,) = (tmp_path / "cache").glob("files-*")
    built = (cache / "tokens.bin").stat().st_mtime_ns
    again = load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache")  # mapped, not rebuilt
    assert (cache / "tokens.bin").stat().st_mtime_ns == built
    assert np.array_equal(np.asarray(again.tokens), expected)
    (tmp_path / "data" / "a.txt").write_text("changed")  # a changed shard: a new cache
    load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("files-*"))) == 2


def test_a_peers_batches_resume_exactly_from_the_checkpointed_cursor(tmp_path: Path) -> None:
    tokenizer_path, digest = make_shards(tmp_path / "data")
    data = files_section(tmp_path / "data", tokenizer_path, digest)
    corpus = load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache")
    kwargs = {"seq_len": 16, "batch_size": 4, "seed": 3, "peer_id": "peer-a"}
    run = Prefetched(corpus.batches(**kwargs), torch.device("cpu"))
    uninterrupted = [next(run)[0] for _ in range(9)]
    drawn = corpus.batches(**kwargs)
    feed = Prefetched(drawn, torch.device("cpu"))
    for _ in range(5):
        next(feed)
    cursor = feed.cursor  # what the checkpoint's data_cursor holds
    restarted = load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache").batches(**kwargs)
    assert restarted.resume(cursor, drawn.train_tokens) is None  # the same data
    resumed = Prefetched(restarted, torch.device("cpu"), cursor=restarted.cursor)
    assert all(torch.equal(next(resumed)[0], uninterrupted[i]) for i in range(5, 9))
    other = corpus.batches(**{**kwargs, "peer_id": "peer-b"})
    assert not torch.equal(next(other)[0], uninterrupted[0])  # another peer, other windows


def test_a_cursor_resumed_over_other_data_is_named(tmp_path: Path) -> None:
    """A glob that matches one more shard after a restart: the cursor's batch sequence is not
    the one the checkpoint was counting through, and the restart says so."""
    tokenizer_path, digest = make_shards(tmp_path / "data")
    data = files_section(tmp_path / "data", tokenizer_path, digest)
    kwargs = {"seq_len": 16, "batch_size": 4, "seed": 3, "peer_id": "peer-a"}
    before = load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache").batches(**kwargs)
    (tmp_path / "data" / "b-2.jsonl").write_text(json.dumps({"text": LINES[0]}) + "\n")
    after = load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache").batches(**kwargs)
    warning = after.resume(5, before.train_tokens)
    assert warning is not None
    assert f"{before.train_tokens} tokens then, {after.train_tokens} now" in warning
    assert after.cursor == 5  # it resumes all the same
    assert after.resume(5, None) is None  # a checkpoint from before the count was kept


def test_bad_files_and_tokenizers_are_named(tmp_path: Path) -> None:
    tokenizer_path, digest = make_shards(tmp_path / "data")
    folder, cache = tmp_path / "data", tmp_path / "cache"

    def load(**changes: object) -> None:
        base = files_section(folder, tokenizer_path, digest)
        values = {
            "source": "files",
            "paths": base.paths,
            "tokenizer": base.tokenizer,
            "tokenizer_sha256": base.tokenizer_sha256,
        }
        load_corpus(DataSection(**(values | changes)), vocab_size=512, cache_dir=cache)  # type: ignore[arg-type]

    with pytest.raises(DataError, match=r"missing\.txt does not exist"):
        load(paths=(str(folder / "missing.txt"),))
    with pytest.raises(DataError, match="matches no file"):
        load(paths=(str(folder / "*.csv"),))
    with pytest.raises(DataError, match="not the tokenizer this run uses"):
        load(tokenizer_sha256="0" * 64)
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(600)}, unk_token="w0"))
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(DataError, match=r"ids reach 599, but model\.vocab_size is 512"):
        load(tokenizer=str(tmp_path / "big.json"), tokenizer_sha256="")
    # Few tokens, but ids beyond the model's embedding (ids need not be dense).
    sparse = Tokenizer(models.WordLevel({"fox": 0, "dog": 1, "cat": 5000}, unk_token="fox"))
    sparse.save(str(tmp_path / "sparse.json"))
    with pytest.raises(DataError, match=r"ids reach 5000, but model\.vocab_size is 512"):
        load(tokenizer=str(tmp_path / "sparse.json"), tokenizer_sha256="")
    # A BPE trained on the shards has the 256 bytes at least.
    with pytest.raises(DataError, match=r"trained on data\.paths .* at least 2\d\d"):
        load_corpus(
            DataSection(source="files", paths=(str(folder / "a.txt"),)),
            vocab_size=128,
            cache_dir=cache,
        )
    # Compressed or binary shards are not read as text.
    (folder / "packed.txt.gz").write_bytes(gzip.compress(b"the quick brown fox"))
    with pytest.raises(DataError, match=r"packed\.txt\.gz is not text"):
        load(paths=(str(folder / "packed.txt.gz"),))
    (folder / "bad.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(DataError, match="row 0 has no text in 'text'"):
        load(paths=(str(folder / "bad.jsonl"),))
    (folder / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match=r"cannot read data file .*broken\.parquet"):
        load(paths=(str(folder / "broken.parquet"),))
    with pytest.raises(RunSpecError, match=r"data\.tokenizer is for data\.source = 'files'"):
        DataSection(tokenizer="t.json")


def test_large_vocabularies_are_stored_in_32_bits() -> None:
    small = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    large = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    sparse = Tokenizer(models.WordLevel({"w0": 0, "w1": 70_000}, unk_token="w0"))  # by id
    assert (token_dtype(small), token_dtype(large), token_dtype(sparse)) == (
        np.dtype("<u2"),
        np.dtype("<u4"),
        np.dtype("<u4"),
    )


def test_compressed_jsonl_shards_are_read_as_rows(tmp_path: Path) -> None:
    tokenizer_path, digest = make_shards(tmp_path / "data")
    rows = "".join(json.dumps({"text": line}) + "\n" for line in LINES[:50])
    (tmp_path / "data" / "z.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    data = DataSection(
        source="files",
        paths=(str(tmp_path / "data" / "z.jsonl.gz"),),
        tokenizer=str(tokenizer_path),
        tokenizer_sha256=digest,
    )
    corpus = load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    expected = np.concatenate([tokenizer.encode(line).ids for line in LINES[:50]])
    assert np.array_equal(np.asarray(corpus.tokens), expected)


def test_a_pinned_tokenizer_is_hashed_by_content_not_by_where_it_lies(tmp_path: Path) -> None:
    def spec(path: str, digest: str = "a" * 64) -> RunSpec:
        return RunSpec.from_toml(
            f'[run]\nid = "x"\n[data]\nsource = "files"\npaths = ["d.txt"]\n'
            f'tokenizer = "{path}"\ntokenizer_sha256 = "{digest}"\n'
        )

    assert spec("/a/tokenizer.json").hash == spec("/b/tokenizer.json").hash
    assert spec("/a/tokenizer.json").hash != spec("/a/tokenizer.json", "b" * 64).hash
    plain = RunSpec.from_toml('[run]\nid = "x"\n')
    assert b"text_field" not in plain.canonical()  # runs from before keep their hash


def test_a_killed_builds_partial_file_is_swept_by_the_next_build(tmp_path: Path) -> None:
    tokenizer_path, digest = make_shards(tmp_path / "data")
    data = files_section(tmp_path / "data", tokenizer_path, digest)
    load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache")
    (folder,) = (tmp_path / "cache").iterdir()
    orphan = folder / f".tokens.bin.{2**22 + 1}"  # above any pid Linux gives: a dead build
    orphan.write_bytes(b"half a corpus")
    running = folder / f".tokens.bin.{os.getppid()}"  # a build still running elsewhere
    running.write_bytes(b"in progress")
    (folder / "manifest.json").unlink()  # the cache is rebuilt
    load_corpus(data, vocab_size=512, cache_dir=tmp_path / "cache")
    assert not orphan.exists()
    assert running.exists()
