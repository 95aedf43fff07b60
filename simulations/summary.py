"""What a simulated swarm did: the summary of its nodes' final status files, and its printout.

The summary (``summary.json`` beside the nodes' logs) holds the loss curve averaged over nodes,
bytes, round times, each peer's outcomes, and whether every replica ended identical. With
malicious peers (profiles with an ``attack``), the loss, the replicas and ``ok`` are the honest
peers', and ``trust`` says who banned whom, when and why.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from swarmgrad.node.files import jsonable
from swarmgrad.node.runspec import RunSpec


def summarize(
    statuses: list[dict[str, Any]],
    *,
    spec: RunSpec,
    wall_seconds: float,
    rounds: int,
    attacks: Sequence[str] = (),
) -> dict[str, Any]:
    """One summary from the nodes' final status files (``attacks``: each node's, "" if honest)."""
    attacks = list(attacks) or [""] * len(statuses)
    everyone, statuses = statuses, [s for s, a in zip(statuses, attacks, strict=True) if not a]
    peers = []
    for status in statuses:
        busy = status["compute_seconds"] + status["communication_seconds"]
        peers.append(
            {
                "peer_id": status["peer_id"],
                "epoch": status["epoch"],
                "samples": status["samples"],
                "samples_averaged": status.get("samples_averaged", 0),
                "tokens_per_second": status["tokens_per_second"],
                "device": status.get("device", ""),
                "mfu": status.get("mfu", math.nan),
                "bytes_sent": status["bytes_sent"],
                "bytes_received": status["bytes_received"],
                "compute_seconds": status["compute_seconds"],
                "communication_seconds": status["communication_seconds"],
                "utilization": status["compute_seconds"] / busy if busy else 0.0,
                "outcomes": status["outcomes"],
                "checksum": status["checksum"],
            }
        )
    total_samples = sum(p["samples"] for p in peers) or 1
    for peer in peers:
        peer["contribution"] = peer["samples"] / total_samples
    checksums = {p["checksum"] for p in peers}
    initial = loss_mean(s["initial_val_loss"] for s in statuses)
    final = loss_mean(s["val_loss"] for s in statuses)
    summary = {
        "ok": len(checksums) == 1 and all(p["epoch"] >= rounds for p in peers),
        "run": spec.run.id,
        "spec_hash": spec.short_hash,
        "algorithm": spec.algorithm.name,
        "codec": spec.averaging.codec,
        "nodes": len(statuses),
        "rounds": rounds,
        "wall_seconds": wall_seconds,
        "initial_val_loss": initial,
        "final_val_loss": final,
        "replicas_identical": len(checksums) == 1,
        # The share of the samples trained (as the nodes count them: what a crash lost since
        # the last checkpoint is not) that were sent in rounds that averaged.
        "samples_kept": sum(p["samples_averaged"] for p in peers) / total_samples,
        **epoch_curves(status["history"] for status in statuses),
        "peers": peers,
    }
    if spec.trust.open or any(attacks):
        summary["trust"] = _trust(everyone, attacks)
    written: dict[str, Any] = jsonable(summary)
    return written


def loss_mean(values: Iterable[float | None]) -> float:
    """The mean of losses as status files hold them: null (a loss not known, a diverged run's
    NaN) counts as NaN, and so makes the mean NaN."""
    return statistics.fmean(math.nan if value is None else value for value in values)


def epoch_curves(histories: Iterable[list[dict[str, Any]]]) -> dict[str, Any]:
    """``loss_curve`` and ``round_seconds`` from the peers' round histories: per epoch, over the
    peers that reached it, the mean validation loss (None where nothing trained: the model),
    total samples so far, mean bytes each peer had sent so far, and round times."""
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for history in histories:
        for entry in history:
            if entry["outcome"] in ("averaged", "partial"):
                by_epoch.setdefault(entry["epoch"], []).append(entry)
    epochs = sorted(by_epoch.items())
    return {
        "loss_curve": [
            {
                "epoch": epoch,
                "val_loss": (
                    loss_mean(e["val_loss"] for e in entries)
                    if all("val_loss" in e for e in entries)
                    else None
                ),
                "samples": sum(e["samples"] for e in entries),
                "bytes_sent_per_peer": statistics.fmean(e["bytes_sent"] for e in entries),
            }
            for epoch, entries in epochs
        ],
        "round_seconds": [
            {
                "epoch": epoch,
                "median": statistics.median(e["round_seconds"] for e in entries),
                "max": max(e["round_seconds"] for e in entries),
            }
            for epoch, entries in epochs
        ],
    }


def _trust(statuses: list[dict[str, Any]], attacks: list[str]) -> dict[str, Any]:
    """Who attacked, and every ban a node made: by whom, of whom, in which round, why."""
    bans = []
    for status in statuses:
        for peer_id, row in status.get("trust", {}).items():
            if row.get("banned"):
                bans.append(
                    {
                        "by": status["peer_id"],
                        "peer": peer_id,
                        "round": row["banned"]["round"],
                        "reason": row["banned"]["reason"],
                    }
                )
    return {
        "attackers": {s["peer_id"]: a for s, a in zip(statuses, attacks, strict=True) if a},
        "bans": bans,
    }


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    modelled = summary.get("engine") == "des"  # no training: no loss
    title = "rounds" if modelled else "validation loss"
    curve = Table(title=f"{title} ({summary['algorithm']}, {summary['codec']})")
    for name in ("epoch", "val loss", "round s (median / max)"):
        curve.add_column(name, justify="right")
    if not modelled:
        curve.add_row("start", _loss(summary["initial_val_loss"]), "")
    times = {r["epoch"]: r for r in summary["round_seconds"]}
    points = summary["loss_curve"]
    if len(points) > 24:  # a long run: every n-th round, and the last
        step = len(points) // 20
        points = [*points[::step][:-1], points[-1]]
    for point in points:
        t = times.get(point["epoch"])
        curve.add_row(
            str(point["epoch"]),
            _loss(point["val_loss"]),
            f"{t['median']:.2f} / {t['max']:.2f}" if t else "",
        )
    console.print(curve)
    peers = Table(title="peers")
    columns = ("peer", "epoch", "samples", "share", "tokens/s", "sent", "received", "util.")
    for name in columns:
        peers.add_column(name, justify="right")
    shown = summary["peers"]
    if len(shown) > 20:  # a large model: the first 20 (totals below)
        shown = shown[:20]
    for p in shown:
        peers.add_row(
            p["peer_id"][:12],
            str(p["epoch"]),
            f"{p['samples']:,}",
            f"{p['contribution']:.0%}",
            f"{p['tokens_per_second']:,.0f}",
            f"{p['bytes_sent'] / 2**20:.1f} MiB",
            f"{p['bytes_received'] / 2**20:.1f} MiB",
            f"{p['utilization']:.0%}",
        )
    console.print(peers)
    churn = summary.get("churn")
    if churn:
        events = Table(title="churn")
        for name in ("time s", "event"):
            events.add_column(name, justify="right" if name == "time s" else "left")
        for event in churn["events"]:
            events.add_row(f"{event['time']:.1f}", event["event"])
        console.print(events)
        for node, seconds in churn["rejoin_seconds"].items():
            shown = ", ".join(f"{s:.1f} s" for s in seconds)
            console.print(f"{node} took part again {shown} after its (re)start or resume")
        lost = sum(
            p["outcomes"].get(o, 0) for p in summary["peers"] for o in ("no group", "aborted")
        )
        partial = sum(p["outcomes"].get("partial", 0) for p in summary["peers"])
        console.print(f"rounds without a group or aborted: {lost}; partial rounds: {partial}")
    if modelled:
        totals = summary["totals"]
        console.print(
            f"modelled: {summary['nodes']} peers, {summary['rounds']} rounds in "
            f"{summary['wall_seconds']:.0f} simulated s; utilization {totals['utilization']:.0%}; "
            f"rounds averaged {totals['rounds_averaged']}, partial {totals['rounds_partial']}, "
            f"lost {totals['rounds_lost']}, resyncs {totals['resyncs']}; "
            f"{totals['bytes_sent_per_peer'] / 2**20:.1f} MiB sent per peer"
        )
        return
    console.print(
        f"{summary['nodes']} nodes, {summary['rounds']} rounds in {summary['wall_seconds']:.0f} s: "
        f"val loss {_loss(summary['initial_val_loss'])} -> {_loss(summary['final_val_loss'])}; "
        f"replicas identical: {summary['replicas_identical']}"
    )


def _loss(value: float | None) -> str:
    """A loss for the printout ("-": none, the model's, or not a finite number)."""
    return "-" if value is None else f"{value:.3f}"
