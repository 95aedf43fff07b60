"""A node identity's key as go-libp2p's daemon (hivemind's p2pd) reads it, so the daemon's peer
id is the identity's, the one py-libp2p derives from the same key."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hivemind.proto import crypto_pb2

from swarmgrad.node.identity import Identity


@contextlib.contextmanager
def p2p_key_file(identity: Identity | None) -> Iterator[Path | None]:
    """While the block runs, ``identity``'s key in a file only this user reads (a
    ``crypto.pb.PrivateKey`` of type Ed25519: the 32-byte seed, then the public key); the
    daemon reads it once, at start. None without an identity (a new peer id)."""
    if identity is None:
        yield None
        return
    message = crypto_pb2.PrivateKey(
        key_type=crypto_pb2.KeyType.Ed25519, data=identity.seed + identity.public_key
    )
    with tempfile.TemporaryDirectory(prefix="swarmgrad-p2p-") as folder:
        path = Path(folder) / "p2p.key"
        path.touch(mode=0o600)
        path.write_bytes(message.SerializeToString())
        yield path
