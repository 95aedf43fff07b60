"""Atomic file replacement: a reader (or a restart after a crash) sees the old file or the new
one, never half of one."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)


def read_pinned(path: Path, sha256: str, *, key: str, what: str, error: type[Exception]) -> bytes:
    """The bytes of the file the run spec's ``key`` names, after checking them against its
    pinned ``sha256`` ("": not pinned); ``error`` (naming ``key``) if unreadable or different."""
    try:
        data = path.read_bytes()
    except OSError as failure:
        raise error(f"{key}: cannot read {path}: {failure.strerror}") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 and digest != sha256:
        raise error(f"{key}: {path} has SHA-256 {digest}, but {key}_sha256 is {sha256}: not {what}")
    return data
