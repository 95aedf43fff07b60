"""What-if tables from the discrete-event model: how utilization, lost rounds and bytes move with
link speed, group size, inner steps, churn and relayed peers, for one run spec.

Every row is a full model run of the same seeded swarm with one thing changed. The swarm: peers
of one compute speed (``speed_spread`` varies it), symmetric links at the row's speed, 20-60 ms
of latency, all direct unless the row says otherwise. "Churn p" means each peer's sessions last
on average 1/p of a churn-free round (so about p of the peers leave in each round) and it comes
back, with its checkpoints, five rounds' time later. Unless a row sets the group size, the whole
swarm is one group (see ``Scenario.group_size``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.des.model import ModelConfig, simulate
from swarmgrad.simulations.profiles import PeerProfile

MBIT = 1e6 / 8  # bytes per second in a megabit per second
BANDWIDTHS_MBIT = (10, 30, 100, 300, 1000)
GROUP_SIZES = (4, 16, 64)
CHURN = (0.0, 0.1, 0.3)
RELAYED = (0.0, 0.5)
INNER_STEPS = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """The swarm every row starts from."""

    spec: RunSpec
    step_seconds: float
    peers: int = 64
    rounds: int = 20
    bandwidth_mbit: float = 100.0
    seed: int = 0
    codec_values_per_second: float | None = None
    #: Spread of compute speeds (log-normal sigma): fast peers wait for a bucket's slowest at
    #: every round, at most the matchmaking timeout (``speed_spread`` shows what it costs).
    speed_sigma: float = 0.0
    #: None: one group of the whole swarm (smaller groups average apart and all but the
    #: majority's throw their round away: ``bandwidth_by_group_size`` shows it).
    group_size: int | None = None

    def profiles(
        self, *, bandwidth_mbit: float | None = None, relayed: float = 0.0, churn: float = 0.0,
        round_seconds: float = 0.0,
    ) -> tuple[PeerProfile, ...]:  # fmt: skip
        rng = random.Random(f"whatif:{self.seed}")
        rate = (bandwidth_mbit or self.bandwidth_mbit) * MBIT
        relayed_peers = set(rng.sample(range(self.peers), round(relayed * self.peers)))
        if len(relayed_peers) == self.peers:  # someone must relay them
            relayed_peers.pop()
        return tuple(
            PeerProfile(
                slowdown=rng.lognormvariate(0.0, self.speed_sigma),
                upload_bytes_per_second=rate,
                download_bytes_per_second=rate,
                latency_ms=rng.uniform(10.0, 30.0),  # each way to the core: 20-60 ms apart
                nat="relayed" if i in relayed_peers else "direct",
                session_seconds=round_seconds / churn if churn else None,
                offline_seconds=5 * round_seconds,
            )
            for i in range(self.peers)
        )

    def run(
        self, *, group_size: int | None = None, inner_steps: int | None = None, **profile: Any
    ) -> dict[str, Any]:
        """One model run of this swarm, the spec's group size (default: the scenario's) and
        inner steps changed if given, ``profile`` passed to :meth:`profiles`."""
        spec = self.spec
        if inner_steps is not None:
            spec = replace(spec, algorithm=replace(spec.algorithm, inner_steps=inner_steps))
        size = min(group_size or self.group_size or self.peers, self.peers)
        spec = replace(spec, averaging=replace(spec.averaging, group_size=size))
        return simulate(
            ModelConfig(
                spec=spec,
                nodes=self.peers,
                rounds=self.rounds,
                profiles=self.profiles(**profile),
                step_seconds=self.step_seconds,
                seed=self.seed,
                codec_values_per_second=self.codec_values_per_second,
            )
        )


def _row(summary: dict[str, Any], **key: Any) -> dict[str, Any]:
    """One table row: per hour and per round over the rounds the swarm reached (its newest
    epoch: fewer than asked for when it stalled, and None per round when it reached none)."""
    totals = summary["totals"]
    medians = [r["median"] for r in summary["round_seconds"]]
    reached = max((p["epoch"] for p in summary["peers"]), default=0)
    return {
        **key,
        "utilization": totals["utilization"],
        "samples_kept": totals["samples_kept"],
        "rounds_per_hour": 3600 * reached / summary["wall_seconds"],
        "round_seconds": sorted(medians)[len(medians) // 2] if medians else None,
        "rounds_lost": totals["rounds_lost"],
        "rounds_partial": totals["rounds_partial"],
        "resyncs": totals["resyncs"],
        "mib_sent_per_peer_round": (
            totals["bytes_sent_per_peer"] / 2**20 / reached if reached else None
        ),
        "stalled": summary["stalled"],
    }


def bandwidth_by_group_size(
    scenario: Scenario,
    bandwidths: Sequence[float] = BANDWIDTHS_MBIT,
    group_sizes: Sequence[int] = GROUP_SIZES,
) -> list[dict[str, Any]]:
    rows = []
    for group_size in group_sizes:
        for mbit in bandwidths:
            summary = scenario.run(group_size=group_size, bandwidth_mbit=mbit)
            rows.append(_row(summary, group_size=group_size, mbit=mbit))
    return rows


def inner_steps_for(
    scenario: Scenario,
    target: float = 0.9,
    bandwidths: Sequence[float] = BANDWIDTHS_MBIT,
    choices: Sequence[int] = INNER_STEPS,
) -> list[dict[str, Any]]:
    """Per link speed, the fewest inner steps (of ``choices``) with utilization >= ``target``
    (with a spread of speeds, waiting for a bucket's slowest caps utilization whatever the
    link: :func:`speed_spread`)."""
    rows = []
    for mbit in bandwidths:
        found: dict[str, Any] = {"mbit": mbit, "inner_steps": None, "utilization": None}
        for steps in choices:
            summary = scenario.run(inner_steps=steps, bandwidth_mbit=mbit)
            utilization = summary["totals"]["utilization"]
            if utilization >= target:
                found = {"mbit": mbit, "inner_steps": steps, "utilization": utilization}
                break
        rows.append(found)
    return rows


def speed_spread(
    scenario: Scenario, sigmas: Sequence[float] = (0.0, 0.1, 0.25, 0.5)
) -> list[dict[str, Any]]:
    """What the synchronous round costs when compute speeds differ (log-normal sigma)."""
    return [_row(replace(scenario, speed_sigma=s).run(), speed_sigma=s) for s in sigmas]


def churn_and_relays(
    scenario: Scenario, churn: Sequence[float] = CHURN, relayed: Sequence[float] = RELAYED
) -> list[dict[str, Any]]:
    calm = scenario.run()
    round_seconds = calm["wall_seconds"] / scenario.rounds
    rows = []
    for share in relayed:
        for rate in churn:
            if not share and not rate:  # the calm run itself
                summary = calm
            else:
                summary = scenario.run(relayed=share, churn=rate, round_seconds=round_seconds)
            rows.append(_row(summary, churn=rate, relayed=share))
    return rows


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = list(rows[0]) if rows else []
    for name in columns:
        table.add_column(name.replace("_", " "), justify="right")
    for row in rows:
        table.add_row(*(_cell(c, row[c]) for c in columns))
    Console().print(table)


PERCENT = ("utilization", "churn", "relayed", "samples_kept")


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column in PERCENT:
        return f"{value:.0%}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
