"""What the run page shows, as JSON: the run's peers (as the DHT has them, with each one's share
of a round's parts and, from a node's status file, its trust score and ban) and that node's own
rounds, loss curve and contribution. Pure functions of what was read: no I/O but the status
file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmgrad.node.files import jsonable
from swarmgrad.node.kinds import Reach

if TYPE_CHECKING:
    from swarmgrad.node.dashboard.server import RunState

#: The rounds the page plots (the newest): a long run's status file holds every round.
MAX_ROUNDS = 500
#: A history entry's numbers the page uses, and the outcome.
ROUND_FIELDS = (
    "epoch",
    "samples",
    "train_loss",
    "val_loss",
    "group_size",
    "round_seconds",
    "allreduce_seconds",
    "outer_seconds",
    "bytes_sent",
    "bytes_received",
)


def run_view(state: RunState, node: dict[str, Any] | None) -> dict[str, Any]:
    found = state.peers
    rows = [dict(row) for row in found.rows] if found is not None else []
    offered = {row["peer_id"]: _owned(row) for row in rows}
    total = sum(offered.values())
    trust = (node or {}).get("trust", {})
    for row in rows:
        row["share"] = offered[row["peer_id"]] / total if total > 0 else 0.0
        row["trust"] = trust.get(row["peer_id"])
    document: dict[str, Any] = jsonable(
        {
            "run": state.run_id,
            "read_at": state.read_at or None,
            "reads": state.reads,
            "error": state.error or None,
            "peers": rows,
            "warnings": found.warnings if found is not None else [],
            "not_on_allowlist": found.not_on_allowlist if found is not None else 0,
            "samples_per_second": sum(row["throughput"] for row in rows),
            "node": node,
        }
    )
    return document


def _owned(row: dict[str, Any]) -> float:
    """The weight a peer's record gives it as an owner of a round's parts: its bandwidth times
    what its reachability lets it offer (a relayed owner costs its relay too)."""
    try:
        reach = Reach(row["reachability"])
    except ValueError:
        return 0.0
    bandwidth = row.get("bandwidth", 1.0)
    return float(bandwidth) * reach.owner_share if math.isfinite(bandwidth) else 0.0


def _number(value: Any) -> float | None:
    """A finite number, or None (a field a status lacks, or one that is not a number)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def node_view(path: Path) -> dict[str, Any]:
    """A node's status file as the page shows it; ``{"error": ...}`` if it cannot be read
    (not written yet, or being replaced)."""
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return {"error": f"cannot read the status file {path}: {error}"}
    return status_view(status, f"the status file {path}")


def status_view(status: Any, source: str) -> dict[str, Any]:
    """A node's status (its status file's, or its metrics server's status page's) as the page
    shows it: the fields it uses, whatever else the document holds; ``{"error": ...}`` if it is
    not a node's status."""
    if not isinstance(status, dict) or not isinstance(status.get("history"), list):
        said = status.get("error") if isinstance(status, dict) else None
        if isinstance(said, str):  # the node's own word: "no round yet"
            return {"error": f"{source}: {said[:200]}"}
        return {"error": f"{source} is not a node's status (no history)"}
    rounds: list[dict[str, Any]] = []
    for entry in status["history"][-MAX_ROUNDS:]:
        if not isinstance(entry, dict):
            continue
        numbers = {name: _number(entry.get(name)) for name in ROUND_FIELDS}
        # Matchmaking and waiting: the round's time the other two leave.
        spent = sum(numbers[k] or 0.0 for k in ("allreduce_seconds", "outer_seconds"))
        numbers["matchmaking_seconds"] = max(0.0, (numbers["round_seconds"] or 0.0) - spent)
        rounds.append({"outcome": str(entry.get("outcome", ""))[:40]} | numbers)
    trust = status.get("trust")
    return {
        "peer_id": status.get("peer_id", ""),
        "epoch": status.get("epoch"),
        "samples": status.get("samples"),
        "tokens_per_second": status.get("tokens_per_second"),
        "val_loss": status.get("val_loss"),
        "initial_val_loss": status.get("initial_val_loss"),
        "bytes_sent": status.get("bytes_sent"),
        "bytes_received": status.get("bytes_received"),
        "outcomes": status.get("outcomes", {}),
        "reachability": status.get("reachability"),
        "rounds": rounds,
        "trust": trust if isinstance(trust, dict) else {},
        "ban_records": status.get("ban_records", {}),
        "owner_checks": status.get("owner_checks", {}),
    }
