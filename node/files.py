"""Atomic file replacement: a reader (or a restart after a crash) sees the old file or the new
one, never half of one."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)


def write_json(path: Path, value: Any) -> None:
    """:func:`atomic_write` of ``value`` as strict JSON: every float that is not finite (NaN: not
    known, e.g. the MFU on a CPU) written as null. Python's bare ``NaN`` is not JSON: strict
    parsers (a browser's, Node's) refuse the whole file."""
    atomic_write(path, json.dumps(jsonable(value), allow_nan=False).encode())


def jsonable(value: Any) -> Any:
    """``value`` with each float in it (through dicts, lists and tuples) that is not finite made
    None, which JSON writes as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: jsonable(each) for key, each in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(each) for each in value]
    return value


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
