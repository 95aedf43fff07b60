"""A node's identity: an Ed25519 key created on first start, kept on disk (0600), reused after.

The peer id is derived from the public key (``sg`` + base32 of the first 20 bytes of its
SHA-256), so a peer cannot claim an id without holding the key; DHT records and round messages
are signed with it. The key file is the raw 32-byte private key; it is written to a temporary file,
fsynced and renamed, so a crash never leaves a half-written key, and it is refused if other users
can read it (as ssh does), since anyone who reads it can act as this node.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from swarmgrad.protocol.errors import SetupError
from swarmgrad.protocol.keys import peer_id_of
from swarmgrad.protocol.keys import verify_signature as verify

__all__ = ["Identity", "IdentityError", "peer_id_of", "verify"]

_KEY_BYTES = 32


class IdentityError(SetupError):
    """The key file is unusable: wrong size, readable by others, or not a file."""


@dataclass(frozen=True, slots=True)
class Identity:
    private_key: Ed25519PrivateKey
    _public: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        raw = self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        object.__setattr__(self, "_public", raw)

    @property
    def public_key(self) -> bytes:
        return self._public

    @property
    def seed(self) -> bytes:
        """The private key's raw 32 bytes (what the key file holds; libp2p derives its key
        pair from them)."""
        return self.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: str) -> Identity:
        """A key anyone can recompute from ``seed``: for simulations that want each peer (and so
        its data stream) to be the same from run to run, never for a node others must trust."""
        return cls(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed.encode()).digest()))

    def save(self, path: Path) -> None:
        """Write the key to ``path`` (0600), replacing the key there, if any."""
        path.unlink(missing_ok=True)
        if not self._save(path):
            raise IdentityError(f"another process wrote {path} while this one replaced it")

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """Load the key at ``path``, or create it (and its folder) if there is none."""
        if path.exists():
            return cls._load(path)
        identity = cls.generate()
        if not identity._save(path):  # another process created one first: use theirs
            return cls._load(path)
        return identity

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Load the key at ``path``; IdentityError if there is none or it is unsafe."""
        if not path.exists():
            raise IdentityError(f"no key at {path}")
        return cls._load(path)

    @classmethod
    def _load(cls, path: Path) -> Identity:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise IdentityError(f"{path} is not a regular file")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(
                f"{path} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                f"anyone who reads it can act as this node. Fix it with: chmod 600 {path}"
            )
        raw = path.read_bytes()
        if len(raw) != _KEY_BYTES:
            raise IdentityError(
                f"{path} holds {len(raw)} bytes, not a {_KEY_BYTES}-byte Ed25519 key; "
                "move it away to create a new identity"
            )
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def _save(self, path: Path) -> bool:
        """Write the key to ``path`` unless a key is there already; whether it wrote it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = self.seed
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, raw)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and never replaces a key another process wrote
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return True
