"""The adversary suite's table: each scenario's before and after side by side, in markdown, from
the records ``adversaries.py`` writes (one per scenario and tree)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

#: Issue 42's own numbers (main at 38f1593), shown where this suite has no "before" run.
QUOTED = {
    "withhold_lie": "loss 16.81 vs 5.93 (2.84x); liar never banned in 6 rounds (quoted)",
    "collude_g4": "honest members ban each other (clipped) in round 2; pair never flagged (quoted)",
    "noise": "banned by 1 of 6 honest nodes, which is then cut off (quoted)",
    "stream_flood": "GetInfo 10/10 RESOURCE_EXHAUSTED; an honest part lost (quoted)",
    "early_flood": "an honest member early to its owner refused OVERLOADED, part lost (quoted)",
    "readiness_flood": "42 rounds aborted, 3 averaged; epochs stuck (quoted)",
    "relay_abuse": "8.38 GB in 18 s through a node, 75-95% of a core (quoted)",
    "lookalike": "join exits 3: 'being trained with a different run spec' (quoted)",
}


Record = dict[str, Any] | None
Context = dict[str, dict[str, float]]  # per tree: "loss" and "pace" of each scenario


def _identical(record: Record, ctx: Context) -> str:
    if record is None:
        return "-"
    return "yes" if record["result"].get("replicas_identical") else "no"


def _loss_value(record: dict[str, Any]) -> float:
    """The honest nodes' validation loss after the suite's rounds (an outside attacker's run
    goes on past them), else at the end."""
    result = record["result"]
    value = result.get("val_loss_at_rounds", math.nan)
    return float(value if math.isfinite(value) else result.get("final_val_loss", math.nan))


def _loss(record: Record, ctx: Context) -> str:
    if record is None:
        return "-"
    loss = _loss_value(record)
    ref = ctx["loss"].get(record["reference"], math.nan)
    if not math.isfinite(loss):
        return "no loss"
    ratio = f" ({loss / ref:.3f}x)" if math.isfinite(ref) and record["scenario"] != record[
        "reference"] else ""  # fmt: skip
    return f"{loss:.3f}{ratio}"


def _banned(record: Record, ctx: Context) -> str:
    if record is None:
        return "-"
    result = record["result"]
    if not result.get("attackers"):
        return ""
    honest = len(result["honest"])
    cells = []
    # Records from before this column existed have no last round in honest parts.
    last = result.get("attackers_last_in_honest_parts", {})
    for attacker, bans in result["attackers_banned"].items():
        seen = last.get(attacker, last.get(str(attacker), -2))
        until = (
            ""
            if seen == -2
            else " (in no honest part)"
            if seen is None
            else f" (in honest parts to r{seen})"
        )
        if not bans:
            cells.append("never" + until)
            continue
        rounds = sorted({r for r, _ in bans})
        span = f"r{rounds[0]}" + (f"-{rounds[-1]}" if rounds[-1] != rounds[0] else "")
        cells.append(f"{len({b for _, b in bans})}/{honest} {span}{until}")
    return "; ".join(cells)


def _honest_banned(record: Record, ctx: Context) -> str:
    if record is None:
        return "-"
    bans = record["result"].get("honest_banned", [])
    if not bans:
        return "0"
    reasons = sorted({b["reason"].split(":")[0][:20] for b in bans})
    return f"{len(bans)} ({', '.join(reasons)}; r{min(b['round'] for b in bans)}+)"


def _pace(record: Record, ctx: Context) -> str:
    if record is None:
        return "-"
    result = record["result"]
    window = result.get("window")
    if window:
        rate, ref = window["epochs_per_minute"], ctx["pace"].get("honest", math.nan)
        ratio = f" ({rate / ref:.0%} of calm)" if math.isfinite(ref) and ref else ""
        return f"{rate:.2f}/min{ratio}"
    rate = result.get("epochs_per_minute", math.nan)
    return f"{rate:.2f}/min" if math.isfinite(rate) else "-"


def _cost(record: Record, ctx: Context) -> str:
    if record is None:
        return "-"
    result = record["result"]
    if "bytes_sent" not in result:
        return ""
    return f"{result['bytes_sent'] / 1e6:.1f} MB, {result['cpu_seconds']:.0f} s"


def _join(record: Record, ctx: Context) -> str:
    if record is None:
        return "-"
    result = record["result"]
    rows = result.get("volunteers", [])
    refused = sum(1 for r in rows if r["refused"])
    exits = sorted({r["exit"] for r in rows if r["exit"] is not None})
    return (
        f"{result.get('trained', 0)}/{len(rows)} joined and trained"
        + (f", {refused} refused" if refused else "")
        + (f" (exit {', '.join(map(str, exits))})" if exits else "")
    )


def _outsider(record: Record, ctx: Context) -> str:
    if record is None:
        return "-"
    result = record["result"]
    outside = result.get("outsider", {})
    attacker = outside.get("attacker", {})
    window = result.get("window", {})
    node0 = window.get("node0_rounds", {})
    rounds = ", ".join(f"{k} {v}" for k, v in sorted(node0.items()) if k != "missing_values")
    parts = [f"node 0: {rounds or 'no rounds'}"]
    if "pace_vs_calm" in window:
        calm = result.get("calm_window", {}).get("epochs_per_minute", math.nan)
        parts.append(f"pace {window['epochs_per_minute']:.2f}/min, {window['pace_vs_calm']:.0%} "
                     f"of the calm window before ({calm:.2f}/min)")  # fmt: skip
    if node0.get("missing_values"):
        parts.append(f"{node0['missing_values']:,} values missing")
    if attacker.get("attack") == "relay":
        served = "served" if attacker.get("served") else f"refused ({attacker.get('answer', '')})"
        parts.append(f"stranger {served}: {attacker.get('bytes', 0) / 1e6:.0f} MB through")
        parts.append(f"node 0 CPU {window.get('node0_cpu_share', math.nan):.0%} of a core "
                     f"(others {window.get('others_cpu_share', math.nan):.0%})")  # fmt: skip
    elif attacker:
        ended = attacker.get("ended") or {  # the readiness flood's: records the DHT took
            f"records {k}": attacker[k] for k in ("stored", "refused") if k in attacker
        }
        top = sorted(ended.items(), key=lambda kv: -kv[1])[:2]
        parts.append("attacker: " + ", ".join(f"{k} {v}" for k, v in top))
        if attacker.get("flood_seconds"):  # its own CPU, taken from the same cores as the nodes'
            share = attacker.get("cpu_seconds", 0.0) / attacker["flood_seconds"]
            parts.append(f"attacker CPU {share:.0%} of a core")
    if outside.get("error"):
        parts.append("attacker failed")
    if result.get("error"):
        parts.append("swarm did not finish")
    return "; ".join(parts)


Cell = Callable[[Record, Context], str]


def _pair(cell: Cell, name: str, records: tuple[Record, Record], ctx: dict[str, Context]) -> str:
    """One cell: before -> after (the issue's own number where there is no before run)."""
    before, after = records
    b, a = cell(before, ctx["before"]), cell(after, ctx["after"])
    if before is None and name in QUOTED and cell in (_loss, _join):
        b = QUOTED[name]
    return a if b == a == "" else f"{b} → {a}"


def markdown(records: list[dict[str, Any]], order: list[str]) -> str:
    """One row per scenario: each column's before -> after."""
    by = {(r["scenario"], r["tree"]): r for r in records}
    ctx: dict[str, Context] = {
        tree: {
            "loss": {s: _loss_value(r) for (s, t), r in by.items() if t == tree},
            "pace": {
                s: r["result"].get("epochs_per_minute", math.nan)
                for (s, t), r in by.items()
                if t == tree
            },
        }
        for tree in ("before", "after")
    }
    lines = [
        "| scenario | reference | final loss (ratio) | attackers banned: honest banners, rounds "
        "| honest banned | replicas identical | pace | MB sent, CPU s per honest node | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in order:
        before, after = by.get((name, "before")), by.get((name, "after"))
        either = after or before
        if either is None:
            continue

        reference = either["reference"] if either["reference"] != name else ""
        if name == "lookalike":
            row = [name, "", "", "", "", "", "", "", _pair(_join, name, (before, after), ctx)]
        else:
            cells = [_loss, _banned, _honest_banned, _identical, _pace, _cost]
            if either["result"].get("outsider"):
                cells.append(_outsider)
            row = [name, reference, *(_pair(c, name, (before, after), ctx) for c in cells)]
            row += [""] * (9 - len(row))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
