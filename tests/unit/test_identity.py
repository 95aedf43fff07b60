"""Node identity: created once with 0600, reused, refused when unsafe or corrupt."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from swarmgrad.node.identity import Identity, IdentityError, peer_id_of, verify


def test_created_on_first_start_with_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "node.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id
    assert first.peer_id.startswith("sg")
    assert len(first.peer_id) == 34
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp file left


def test_peer_id_derives_from_the_public_key_and_signatures_verify(tmp_path: Path) -> None:
    a, b = Identity.generate(), Identity.generate()
    assert a.peer_id == peer_id_of(a.public_key) != b.peer_id
    signature = a.sign(b"round 7")
    assert verify(a.public_key, signature, b"round 7")
    assert not verify(a.public_key, signature, b"round 8")
    assert not verify(b.public_key, signature, b"round 7")
    assert not verify(a.public_key, b"\0" * 64, b"round 7")


def test_a_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    Identity.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(path)


def test_a_corrupt_key_file_is_refused_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(b"not a key")
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="9 bytes"):
        Identity.load_or_create(path)
    assert path.read_bytes() == b"not a key"


def test_a_seeded_identity_is_the_same_every_time_and_saved_like_a_created_one(
    tmp_path: Path,
) -> None:
    a, again, other = (Identity.from_seed(s) for s in ("run:1:0", "run:1:0", "run:1:1"))
    assert a.peer_id == again.peer_id != other.peer_id
    path = tmp_path / "node.key"
    Identity.load_or_create(path)  # a random key is there: save replaces it
    a.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load_or_create(path).peer_id == a.peer_id
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]
