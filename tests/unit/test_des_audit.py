"""The discrete-event model against what a user of it reads: rounds end by the round deadline,
survivors go on when the newest peers die, churn costs utilization and rows, relays through peer 0
cost what others do, tokens/s is each peer's own, and what it refuses (sync, tiny sessions)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from swarmgrad.node.averaging.matchmaking import POLL_SECONDS
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.swarm_config import MATCHMAKING_SETTLE_SECONDS
from swarmgrad.simulations.churn import ChurnEvent
from swarmgrad.simulations.des import whatif
from swarmgrad.simulations.profiles import PeerProfile, SimulationError
from swarmgrad.simulations.summary import summarize
from swarmgrad.simulations.swarm import DEMO_SPEC
from tests.unit.test_des import SPEC, model  # the same small DES setup


def test_no_round_outlasts_the_round_deadline_and_a_too_slow_link_is_not_averaged() -> None:
    # 5 kB/s uplinks: a round's bytes need about 200 s, the round deadline is 60 s.
    slow = [PeerProfile(upload_bytes_per_second=5e3)] * 4
    averaging = SPEC.averaging
    # Parts of about 11 chunks: by the deadline some are through, the rest are missing.
    chunked = replace(SPEC, averaging=replace(averaging, chunk_values=16384))
    cut = model(4, 3, profiles=slow, spec=chunked)
    outcomes = [p["outcomes"] for p in cut["peers"]]
    assert all(o == {"partial": 3} for o in outcomes), outcomes
    bound = (
        averaging.round_timeout_seconds
        + averaging.matchmaking_timeout_seconds
        + averaging.sender_timeout_seconds
        + POLL_SECONDS
        + MATCHMAKING_SETTLE_SECONDS
        + 1.0
    )
    longest = max(r["max"] for r in cut["round_seconds"])
    assert longest <= bound, (longest, bound)
    # Parts of one chunk: none is through by the deadline, so no round averages anything.
    whole = model(4, 3, profiles=slow)
    assert not whole["ok"]
    assert whole["stalled"]
    assert whole["totals"]["rounds_averaged"] + whole["totals"]["rounds_partial"] == 0
    assert whole["totals"]["rounds_lost"] > 0


def test_survivors_go_on_when_every_peer_at_the_newest_epoch_dies() -> None:
    events = (
        ChurnEvent(at_epoch=1, action="pause", node=2),
        ChurnEvent(at_epoch=1, action="pause", node=3),
        ChurnEvent(at_epoch=3, action="kill", node=0),
        ChurnEvent(at_epoch=3, action="kill", node=1),
        ChurnEvent(at_epoch=3, action="resume", node=2),
        ChurnEvent(at_epoch=3, action="resume", node=3),
    )
    summary = model(4, 6, events=events)
    assert summary["ok"]
    assert not summary["stalled"]
    survivors = [p for p in summary["peers"] if p["peer_id"] in ("peer-000002", "peer-000003")]
    assert [p["epoch"] for p in survivors] == [6, 6]
    assert all("resynced" not in p["outcomes"] for p in survivors), survivors
    assert summary["churn"]["rejoin_seconds"] == {}


def test_churn_does_not_raise_utilization_or_keep_the_samples_crashes_lose() -> None:
    def run(session: float | None) -> dict[str, Any]:
        profile = PeerProfile(
            upload_bytes_per_second=5e6, session_seconds=session, offline_seconds=5.0
        )
        return model(8, 10, profiles=[profile] * 8, codec_values_per_second=4e8)

    calm, *churned = (run(session) for session in (None, 30.0, 15.0, 8.0, 4.0))
    # Peers that crash before their rounds end spent that time all the same.
    for summary in churned:
        assert summary["totals"]["utilization"] <= calm["totals"]["utilization"]
    # Crashes throw away what peers trained since their last round: the more, the shorter the
    # sessions (8 peers: not strictly from one session length to the next).
    kept = [s["totals"]["samples_kept"] for s in (calm, *churned)]
    assert kept[0] == 1.0
    assert all(k < 1.0 for k in kept[1:]), kept
    assert max(kept[3:]) < kept[1], kept


def test_a_stalled_what_if_row_reports_the_rounds_it_reached() -> None:
    scenario = whatif.Scenario(
        spec=SPEC, step_seconds=0.05, peers=16, rounds=6, codec_values_per_second=4e8
    )
    (calm,) = whatif.churn_and_relays(scenario, churn=(0.0,), relayed=(0.0,))
    # 5 kB/s links: no chunk is through by the round deadline, no round averages anything.
    slow = replace(scenario, bandwidth_mbit=0.04)
    (stalled,) = whatif.churn_and_relays(slow, churn=(0.0,), relayed=(0.0,))
    assert not calm["stalled"]
    assert calm["rounds_per_hour"] > 0
    assert stalled["stalled"]
    # Per hour and per round over the rounds it reached before it stalled, not those asked for.
    assert 0 <= stalled["rounds_per_hour"] < calm["rounds_per_hour"] / 100
    if stalled["rounds_per_hour"] == 0:
        assert stalled["mib_sent_per_peer_round"] is None
    else:
        assert stalled["mib_sent_per_peer_round"] > 0


def test_sync_is_refused_not_modelled_as_diloco() -> None:
    toml = DEMO_SPEC.replace('name = "diloco"', 'name = "sync"\ntarget_batch_size = 64')
    toml = toml.replace("inner_steps = 10\n", "").replace(
        "outer_lr = 1.0\nouter_momentum = 0.0\n", ""
    )
    spec = RunSpec.from_toml(toml)
    assert spec.algorithm.name == "sync"
    with pytest.raises(SimulationError, match="DiLoCo only"):
        model(4, 3, spec=spec)


def test_which_peer_relays_does_not_change_round_times() -> None:
    direct = PeerProfile(upload_bytes_per_second=5e6, latency_ms=200.0)
    relayed = PeerProfile(upload_bytes_per_second=5e6, latency_ms=200.0, nat="relayed")
    through_peer_0 = model(3, 4, profiles=[direct, relayed, relayed])
    through_peer_2 = model(3, 4, profiles=[relayed, relayed, direct])
    assert through_peer_0["round_seconds"] == through_peer_2["round_seconds"]
    assert through_peer_0["wall_seconds"] == pytest.approx(through_peer_2["wall_seconds"])


def test_a_late_joiner_reports_the_tokens_per_second_of_its_own_time() -> None:
    profiles = [PeerProfile(upload_bytes_per_second=5e6) for _ in range(5)]
    summary = model(
        4, 12, profiles=profiles, events=(ChurnEvent(at_epoch=8, action="start", node=4),)
    )
    rates = {p["peer_id"]: p["tokens_per_second"] for p in summary["peers"]}
    joiner = rates.pop("peer-000004")
    for rate in rates.values():
        assert joiner == pytest.approx(rate, rel=0.1)


def test_sessions_below_the_floor_are_refused() -> None:
    with pytest.raises(SimulationError, match="session_seconds must be at least 1"):
        PeerProfile(session_seconds=0.01, offline_seconds=0.0)
    # At the floor, with no time offline, the model still ends.
    short = [PeerProfile(upload_bytes_per_second=5e6, session_seconds=1.0, offline_seconds=0.0)]
    summary = model(4, 3, profiles=short * 4)
    assert summary["ok"] or summary["stalled"]


def test_the_summary_of_a_cpu_run_is_strict_json() -> None:
    status = {
        "peer_id": "peer-a",
        "epoch": 1,
        "samples": 10,
        "tokens_per_second": 100.0,
        "device": "cpu",
        "mfu": math.nan,  # no device peak on a CPU
        "bytes_sent": 1,
        "bytes_received": 1,
        "compute_seconds": 1.0,
        "communication_seconds": 1.0,
        "outcomes": {"averaged": 1},
        "checksum": "c",
        "initial_val_loss": 5.0,
        "val_loss": 4.0,
        "history": [],
    }
    summary = summarize([status], spec=SPEC, wall_seconds=2.0, rounds=1)

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    parsed = json.loads(json.dumps(summary, indent=1), parse_constant=refuse)
    assert parsed["peers"][0]["mfu"] is None
    assert parsed["final_val_loss"] == 4.0
    # Status files hold null where a number is not known: a diverged peer's loss is summarized
    # as not known, not a crash.
    diverged = status | {"peer_id": "peer-b", "mfu": None, "val_loss": None}
    diverged["history"] = [
        {"epoch": 1, "outcome": "averaged", "val_loss": None, "samples": 10, "bytes_sent": 1,
         "round_seconds": 1.0}
    ]  # fmt: skip
    summary = summarize([status, diverged], spec=SPEC, wall_seconds=2.0, rounds=1)
    parsed = json.loads(json.dumps(summary, indent=1, allow_nan=False), parse_constant=refuse)
    assert parsed["final_val_loss"] is None
    assert parsed["initial_val_loss"] == 5.0
