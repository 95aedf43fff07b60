"""Peer ids and signatures: a peer id is the hash of an Ed25519 public key.

The peer id is ``sg`` + base32 of the first 20 bytes of the key's SHA-256, so nobody can claim an
id without holding its key. Pure (hashlib and cryptography only): the libp2p sidecar, which must
not load gRPC or protobuf stubs, checks DHT records with it too.
"""

from __future__ import annotations

import base64
import functools
import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

KEY_BYTES = 32
SIGNATURE_BYTES = 64


@functools.lru_cache(maxsize=4096)  # every signature checked names its signer's id
def peer_id_of(public_key: bytes) -> str:
    """The peer id that belongs to a raw 32-byte Ed25519 public key."""
    if len(public_key) != KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has {KEY_BYTES} bytes, got {len(public_key)}")
    digest = hashlib.sha256(public_key).digest()[:20]
    return "sg" + base64.b32encode(digest).decode().lower().rstrip("=")


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s signature of ``message``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
