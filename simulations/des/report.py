"""The model's summary: the same schema as the real processes' (``simulations/summary.py``),
the loss fields None (the model does not train)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from swarmgrad.simulations.des.board import majority
from swarmgrad.simulations.summary import epoch_curves

if TYPE_CHECKING:
    from swarmgrad.simulations.des.model import SwarmModel


def summary(model: SwarmModel) -> dict[str, Any]:
    """The same schema as the real processes' summary (``simulations/summary.py``); the
    loss fields are None: the model does not train."""
    finals = [p for p in model.peers if p.sessions]
    ok = all(p.epoch >= model.config.rounds for p in finals if p.alive)
    seq_len = model.config.spec.model.seq_len
    peers: list[dict[str, Any]] = []
    for p in finals:
        busy = p.compute_seconds + p.communication_seconds
        trained_for = max(p.trained_online, 1e-9)  # as the node: since it (re)started
        peers.append(
            {
                "peer_id": p.peer_id,
                "epoch": p.epoch,
                "samples": p.samples,
                "samples_dropped": p.dropped,
                "tokens_per_second": p.samples * seq_len / trained_for,
                "bytes_sent": p.bytes_sent,
                "bytes_received": p.bytes_received,
                "compute_seconds": p.compute_seconds,
                "communication_seconds": p.communication_seconds,
                "utilization": p.compute_seconds / busy if busy else 0.0,
                "outcomes": dict(p.outcomes),
                "checksum": None,
            }
        )
    total = sum(p["samples"] for p in peers) or 1
    for row in peers:
        row["contribution"] = row["samples"] / total
    spec = model.config.spec
    summary: dict[str, Any] = {
        "engine": "des",
        "ok": ok and bool(model.done.triggered) and not model.stalled,
        "stalled": model.stalled,
        "run": spec.run.id,
        "spec_hash": spec.short_hash,
        "algorithm": spec.algorithm.name,
        "codec": spec.averaging.codec,
        "nodes": len(finals),
        "rounds": model.config.rounds,
        "wall_seconds": model.env.now,
        "initial_val_loss": None,
        "final_val_loss": None,
        "replicas_identical": None,
        "parameters": model.params,
        **epoch_curves(p.history for p in finals),
        "peers": peers,
        "totals": totals(peers, in_model=samples_in_model(model)),
    }
    if model.config.events or any(p.profile.session_seconds for p in model.peers):
        summary["churn"] = {
            "events": model.fired,
            "rejoin_seconds": {
                f"node-{i}": seconds for i, seconds in sorted(model.rejoin_seconds.items())
            },
            "finished": [f"node-{p.index}" for p in finals if p.finished],
        }
    return summary


def final_state(model: SwarmModel) -> Hashable:
    """The run's model: the state most live peers at the newest epoch hold (ties: the
    smallest checksum, as the resync rule picks), else most peers' at the newest epoch."""
    peers = [p for p in model.peers if p.sessions]
    alive = [p for p in peers if p.alive] or peers
    if not alive:
        return "init"
    newest = max(p.epoch for p in alive)
    return majority(Counter(p.state for p in alive if p.epoch == newest))


def samples_in_model(model: SwarmModel) -> float:
    """The samples whose progress is in the run's model: those sent in the rounds the final
    state descends from. A group's round whose state the swarm later replaced by another
    group's (a resync) is not among them, however many samples it averaged."""
    seen: set[Hashable] = set()
    todo = [final_state(model)]
    total = 0.0
    while todo:
        state = todo.pop()
        if state in seen:
            continue
        seen.add(state)
        parents, samples = model.lineage[state]
        total += samples
        todo.extend(parents)
    return total


def totals(peers: Sequence[dict[str, Any]], *, in_model: float) -> dict[str, Any]:
    """Swarm-wide figures: mean utilization, rounds lost and partial, bytes per peer, and the
    share of the samples trained that are in the final model (``in_model`` of them)."""
    outcomes: Counter[str] = Counter()
    for p in peers:
        outcomes.update(p["outcomes"])
    return {
        "utilization": statistics.fmean(p["utilization"] for p in peers) if peers else 0.0,
        "rounds_lost": outcomes["no group"] + outcomes["aborted"],
        "rounds_partial": outcomes["partial"],
        "rounds_averaged": outcomes["averaged"],
        "resyncs": outcomes["resynced"],
        # The share of the samples trained that reached the final model: not thrown away by a
        # crash or a resync, and not sent in a round whose state the swarm later replaced.
        "samples_kept": in_model / max(sum(p["samples"] for p in peers), 1),
        "bytes_sent_per_peer": statistics.fmean(p["bytes_sent"] for p in peers) if peers else 0,
    }
