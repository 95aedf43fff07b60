"""``swarmgrad status``: a run's peers as the DHT shows them, read by a short-lived DHT node, and
(``--scores``) what one node of an open run thinks of each peer, from its status file."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.start import start_reader


async def run_peers(
    *,
    bootstrap: Sequence[str],
    run_id: str,
    spec_hash: bytes | None,
    timeout_seconds: float,
    backend: str = "hivemind",
    network_secret: str = "",
) -> list[dict[str, Any]]:
    """One row per peer record of ``run_id`` (of ``spec_hash``, or of every spec in use).

    The reader joins the DHT with a throwaway identity: it announces nothing.
    """
    async with asyncio.timeout(timeout_seconds):
        discovery = await start_reader(
            bootstrap,
            backend=backend,
            network_secret=network_secret,
            timeout_seconds=timeout_seconds,
            run_id=run_id,
            spec_hash=spec_hash or bytes(32),
        )
        try:
            if spec_hash is not None:
                hashes = [spec_hash]
            else:
                hashes = [bytes.fromhex(h) for h in sorted(await discovery.find_specs())]
            rows = []
            for each in hashes:
                now = dht_time()
                for record in await discovery.for_spec(each).find():
                    rows.append(
                        {
                            "peer_id": record.peer_id,
                            "spec": record.spec_hash[:12],
                            "role": record.role,
                            "epoch": record.epoch,
                            "throughput": record.throughput,
                            "endpoint": record.endpoint,
                            "reachability": record.reachability,
                            "via": record.via,
                            "punched": record.punched,
                            "checksum": record.checksum,
                            "last_seen_seconds": max(0.0, now - record.issued_at),
                            "expires_in_seconds": record.expires_at - now,
                        }
                    )
            return rows
        finally:
            await discovery.close()


class ScoresError(ValueError):
    """A node's status file that cannot be read, or holds no scores."""


def read_scores(path: Path) -> dict[str, Any]:
    """What a node's ``--status-file`` says of its peers in an open run: its peer id, its
    ledger's row per peer (rounds, clip and cosine EMAs, flags, disputes, ban), its owner
    checks (checked, failed), and what it made of the ban records other nodes published."""
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ScoresError(f"cannot read the node's status file {path}: {error}") from None
    if not isinstance(status, dict) or not isinstance(status.get("trust"), dict):
        raise ScoresError(f"{path} is not a node's status file (no trust section)")
    return {
        "node": status.get("peer_id", ""),
        "epoch": status.get("epoch"),
        "peers": status["trust"],
        "owner_checks": status.get("owner_checks", {}),
        "ban_records": status.get("ban_records", {}),
    }


def scores_table(scores: dict[str, Any]) -> Table:
    """The scores as a table, worst first (banned, then by cosine)."""
    checks = scores["owner_checks"]
    table = Table(
        title=f"scores by {scores['node']} at epoch {scores['epoch']}: "
        f"{checks.get('checked', 0)} owner results checked, {checks.get('failed', 0)} failed; "
        f"{scores.get('ban_records', {}).get('adopted', 0)} bans adopted from published evidence"
    )
    for column in ("peer", "rounds", "clip", "cosine", "loss gain", "flags", "disputes", "banned"):
        table.add_column(
            column,
            justify="right" if column in ("rounds", "clip", "cosine", "loss gain") else "left",
        )
    rows = sorted(
        scores["peers"].items(),
        key=lambda item: (not item[1].get("banned"), item[1].get("cosine_ema", 0.0)),
    )
    for peer, row in rows:
        ban = row.get("banned")
        flags = ", ".join(f"{k} {v}" for k, v in row.get("flags", {}).items())
        table.add_row(
            peer,
            str(row.get("rounds", 0)),
            f"{row.get('clip_ema', 0.0):.2f}",
            f"{row.get('cosine_ema', 0.0):.2f}",
            _gain_cell(row),
            flags or "-",
            str(row.get("disputes", 0)),
            _ban_cell(ban),
        )
    return table


def _gain_cell(row: dict[str, Any]) -> str:
    """The spot checks' loss gain EMA, and how many there were."""
    gain = row.get("loss_gain_ema")
    return "-" if gain is None else f"{gain:+.4f} ({row.get('spot_checks', 0)})"


def _ban_cell(ban: dict[str, Any] | None) -> str:
    """A ban as a cell: its round and reason, whether it carries evidence, and the peer it was
    adopted from (a ban read in the DHT)."""
    if not ban:
        return "-"
    cell = f"round {ban['round']}: {ban['reason']}"
    if ban.get("source"):
        cell += f" (evidence from {str(ban['source'])[:16]}…)"
    elif ban.get("evidence"):
        cell += " (evidence published)"
    return cell
