"""A node's bans as records: who, since which round, for which flags, on what evidence, and
their file, which keeps them across restarts (``ledger.py`` decides them)."""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from swarmgrad.node.files import atomic_write
from swarmgrad.node.trust.flags import Flag

log = logging.getLogger(__name__)

__all__ = ["Ban", "load_bans", "save_bans", "shown"]


@dataclass(frozen=True, slots=True)
class Ban:
    peer_id: str
    round: int
    flags: tuple[Flag, ...]
    #: Serialized evidence any peer can check (empty: this node's own judgement only).
    evidence: bytes = b""
    #: The peer whose published evidence this ban was adopted from ("": this node saw it).
    source: str = ""

    @property
    def reason(self) -> str:
        return "+".join(self.flags)


def save_bans(path: Path, bans: Iterable[Ban]) -> None:
    """Write ``bans`` to ``path`` atomically (raises OSError)."""
    rows = [
        {
            "peer_id": b.peer_id,
            "round": b.round,
            "flags": list(b.flags),
            "evidence": base64.b64encode(b.evidence).decode(),
            "source": b.source,
        }
        for b in bans
    ]
    atomic_write(path, json.dumps({"version": 1, "bans": rows}).encode())


def load_bans(path: Path) -> dict[str, Ban]:
    """The bans a ledger saved at ``path`` (none if there is no file; a file that does not read
    as one is reported and set aside, never trusted in part)."""
    try:
        saved = json.loads(path.read_text())
        bans = {
            entry["peer_id"]: Ban(
                peer_id=str(entry["peer_id"]),
                round=int(entry["round"]),
                flags=tuple(Flag(f) for f in entry["flags"]),
                evidence=base64.b64decode(entry.get("evidence", ""), validate=True),
                source=str(entry.get("source", "")),
            )
            for entry in saved["bans"]
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, binascii.Error) as error:
        log.warning("ignoring the saved bans in %s (%s): starting without them", path, error)
        return {}
    if bans:
        log.info("%d peer(s) still banned from earlier runs of this node (%s)", len(bans), path)
    return bans


def shown(ban: Ban) -> dict[str, object]:
    """A ban as status files and the CLI show it."""
    shown: dict[str, object] = {"round": ban.round, "reason": ban.reason}
    if ban.evidence:
        shown["evidence"] = True
    if ban.source:
        shown["source"] = ban.source
    return shown
