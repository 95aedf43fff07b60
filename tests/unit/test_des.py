"""The discrete-event model (no sockets): it applies the node's own rules, is deterministic, and
shows what a user asks it about (rounds lost to churn, slow links, relays)."""

from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.averaging.grouping import assign_groups
from swarmgrad.node.averaging.membership import PROBE_AFTER_SECONDS
from swarmgrad.node.averaging.quiet import QUIET_SECONDS, UNANSWERED_PROBES
from swarmgrad.node.cli import app
from swarmgrad.node.reachability.service import LIVENESS_TIMEOUT_SECONDS
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.swarm_config import allreduce_config
from swarmgrad.node.training.model import parameter_count
from swarmgrad.simulations.churn import ChurnEvent
from swarmgrad.simulations.des import model as des_model
from swarmgrad.simulations.des.groups import Candidates
from swarmgrad.simulations.des.model import ModelConfig, simulate
from swarmgrad.simulations.des.traffic import part_bytes, round_traffic
from swarmgrad.simulations.profiles import PeerProfile, SimulationError, load_profile
from swarmgrad.simulations.swarm import DEMO_SPEC

SPEC = RunSpec.from_toml(DEMO_SPEC)


def model(
    nodes: int, rounds: int = 6, *, profiles: list[PeerProfile] | None = None, **options: Any
) -> dict[str, Any]:
    profiles = profiles or [PeerProfile(upload_bytes_per_second=5e6) for _ in range(nodes)]
    return simulate(
        ModelConfig(
            spec=options.pop("spec", SPEC),
            nodes=nodes,
            rounds=rounds,
            profiles=tuple(profiles),
            step_seconds=0.05,
            **options,
        )
    )


@pytest.mark.parametrize("group_size", [2, 3, 4, 5])
def test_incremental_groups_are_the_nodes_assign_groups(group_size: int) -> None:
    rng = random.Random(group_size)
    ids = [f"peer-{rng.randrange(10**6):06d}" for _ in range(40)]
    candidates = Candidates(7, group_size)
    for count, peer_id in enumerate(ids, start=1):
        candidates.add(peer_id)
        expected = {p: tuple(g) for g in assign_groups(7, ids[:count], group_size) for p in g}
        for p in ids[:count]:
            assert candidates.group_of(p) == expected.get(p), (count, p)
    # Records withdrawn (a peer that left, or signed again): the groups are cut again.
    left = list(ids)
    for peer_id in rng.sample(ids, 30):
        candidates.remove(peer_id)
        left.remove(peer_id)
        expected = {p: tuple(g) for g in assign_groups(7, left, group_size) for p in g}
        for p in ids:
            assert candidates.group_of(p) == expected.get(p), (len(left), p)


def test_traffic_is_the_butterflys_bytes_from_the_real_codec() -> None:
    config = allreduce_config(SPEC)
    members = tuple(
        Member(peer_id=f"p{i}", endpoint="e", bandwidth=b) for i, b in enumerate([1, 1, 2, 0])
    )
    group = Group(round=0, members=members)
    total = parameter_count(SPEC.model)
    traffic = round_traffic(group, total, config)
    parts = group.partition(total)
    chunks = [part_bytes(config, end - start) for start, end in parts]
    # Every byte one member sends, another receives; int8 is ~1 byte per value plus scales.
    assert sum(t.sent for t in traffic.values()) == sum(t.received for t in traffic.values())
    assert total < sum(chunks) < 1.1 * total
    # The peer that owns nothing (bandwidth 0) sends every part and gets every result.
    assert traffic[3].sent == sum(chunks)
    assert traffic[3].received == sum(chunks)
    assert traffic[2].sent == sum(chunks) - chunks[2] + 3 * chunks[2]


def test_same_seed_same_swarm_and_seeds_differ(tmp_path: Path) -> None:
    profile = tmp_path / "peers.toml"
    profile.write_text(
        "[[peer]]\n"
        'slowdown = { dist = "lognormal", median = 1.0, sigma = 0.4 }\n'
        'upload_bytes_per_second = { dist = "choice", values = [1e6, 1e7] }\n'
        'latency_ms = { dist = "uniform", low = 5, high = 80 }\n'
    )
    runs = [model(8, profiles=load_profile(profile, 8, seed=s)) for s in (1, 1, 2)]
    assert json.dumps(runs[0]) == json.dumps(runs[1])
    assert runs[0]["wall_seconds"] != runs[2]["wall_seconds"]


def test_a_long_model_says_how_far_it_is_and_saying_it_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    quiet = model(8, rounds=4)
    monkeypatch.setattr(des_model, "PROGRESS_SECONDS", 0.0)  # a line at every epoch change
    with caplog.at_level(logging.INFO, logger=des_model.__name__):
        told = model(8, rounds=4)
    lines = [r.getMessage() for r in caplog.records if r.name == des_model.__name__]
    assert lines
    assert all(
        re.fullmatch(r"modelled: epoch \d of 4, \d+ simulated s, in \d+ s", m) for m in lines
    )
    assert lines[-1].startswith("modelled: epoch 4 of 4")
    assert json.dumps(told) == json.dumps(quiet)


def test_profile_distributions_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "peers.toml"
    for text, message in [
        ('slowdown = { dist = "gamma", k = 2 }', "dist must be one of"),
        ('slowdown = { dist = "uniform", low = 3, high = 1 }', "low <= high"),
        ('slowdown = { dist = "normal", mean = -1, std = 0 }', "slowdown must be positive"),
        ('nat = "symmetric"', "nat must be one of"),
        ('nat = { dist = "choice", values = ["direct"], weights = [0] }', "not all 0"),
        ('nat = { dist = "choice", values = ["direct"], weights = 5 }', "one number >= 0"),
        ("bandwidth = 0", "every node has bandwidth 0"),
        ("bandwidth = inf", "bandwidth must be finite"),
        ("bandwidth = 2e6", "bandwidth must be at most 1e"),
        ("latency_ms = inf", "latency_ms must be finite"),
        ("upload_bytes_per_second = inf", "upload_bytes_per_second must be finite"),
    ]:
        path.write_text(f"[[peer]]\n{text}\n")
        with pytest.raises(SimulationError, match=message):
            load_profile(path, 2)
    path.write_text("peer = [1, 2]\n")  # not tables
    with pytest.raises(SimulationError, match="peer 0 is not a table"):
        load_profile(path, 2)


def test_a_kill_mid_round_leaves_partial_rounds_and_the_node_rejoins_by_state_sync() -> None:
    events = (
        ChurnEvent(at_epoch=2, action="kill", node=1, during="round"),
        ChurnEvent(at_epoch=4, action="start", node=1),
    )
    summary = model(4, 8, events=events)
    assert summary["ok"]
    outcomes = {p["peer_id"]: p["outcomes"] for p in summary["peers"]}
    assert outcomes["peer-000001"]["resynced"] == 1  # a restart catches up before it trains
    assert summary["churn"]["rejoin_seconds"]["node-1"]
    assert any(o.get("partial") for pid, o in outcomes.items() if pid != "peer-000001")
    assert all(p["epoch"] == 8 for p in summary["peers"])


def test_survivors_ask_a_crashed_or_frozen_peer_instead_of_waiting_out_the_timeout() -> None:
    # Node 1 dies (or freezes) between rounds: its record still says it is at the round.
    # Without the liveness probe the next two rounds each waited the 20 s matchmaking timeout
    # (as the real nodes did: 20.7 s in the NAT lab).
    timeout = SPEC.averaging.matchmaking_timeout_seconds
    calm = model(4, 6)["round_seconds"][2]["max"]
    for events in (
        (ChurnEvent(at_epoch=2, action="kill", node=1),),
        (
            ChurnEvent(at_epoch=2, action="pause", node=1),
            ChurnEvent(at_epoch=5, action="resume", node=1),
        ),
    ):
        summary = model(4, 6, events=events)
        assert summary["ok"]
        after = [r["max"] for r in summary["round_seconds"] if r["epoch"] in (3, 4)]
        frozen = events[0].action == "pause"
        asked = PROBE_AFTER_SECONDS + (LIVENESS_TIMEOUT_SECONDS if frozen else 0.1)
        assert all(s <= calm + asked for s in after), (events[0].action, after)
        assert max(after) < timeout / 4


def test_a_member_frozen_mid_round_is_asked_not_waited_for_as_the_node_does() -> None:
    # The node's rule (averaging/quiet.py): an owner quiet for QUIET_SECONDS is asked whether it
    # is there, and dropped after UNANSWERED_PROBES questions unanswered, each taking the
    # question's whole deadline; the model's round of the freeze lasts about that, not the
    # sender timeout (the real run: 6.6-6.8 s, test_crash_recovery.py).
    averaging = replace(SPEC.averaging, sender_timeout_seconds=30.0, reducer_timeout_seconds=60.0)
    spec = replace(SPEC, averaging=averaging)
    events = (
        ChurnEvent(at_epoch=2, action="pause", node=1, during="round"),
        ChurnEvent(at_epoch=4, action="resume", node=1),
    )
    calm = model(4, 6, spec=spec)["round_seconds"][2]["max"]
    summary = model(4, 6, spec=spec, events=events)
    assert summary["ok"]
    assert summary["churn"]["events"][0]["event"] == "epoch 2: pause node 1 during its round"
    froze = next(r["max"] for r in summary["round_seconds"] if r["epoch"] == 3)
    asked = QUIET_SECONDS + UNANSWERED_PROBES * LIVENESS_TIMEOUT_SECONDS
    assert asked < froze < asked + calm + 1.0, (froze, asked, calm)


def test_slower_links_make_longer_rounds_and_relays_cost_their_relay() -> None:
    fast = model(4, profiles=[PeerProfile(upload_bytes_per_second=1e7)] * 4)
    slow = model(4, profiles=[PeerProfile(upload_bytes_per_second=1e6)] * 4)
    # Same bytes, 10x slower uplinks: each round is longer by its bytes over the lost rate.
    per_round = slow["peers"][0]["bytes_sent"] / 6
    assert per_round == fast["peers"][0]["bytes_sent"] / 6
    longer = slow["round_seconds"][-1]["median"] - fast["round_seconds"][-1]["median"]
    assert longer == pytest.approx(per_round * (1 / 1e6 - 1 / 1e7), rel=0.1)
    assert slow["totals"]["utilization"] < fast["totals"]["utilization"]
    relayed = [PeerProfile(upload_bytes_per_second=1e6, nat="relayed")] * 2
    mixed = model(4, profiles=[PeerProfile(upload_bytes_per_second=1e6)] * 2 + relayed)
    sent = {p["peer_id"]: p["bytes_sent"] for p in mixed["peers"]}
    # Relayed peers own no part, so they send only their chunks, never results.
    assert sent["peer-000002"] < sent["peer-000000"]
    assert mixed["round_seconds"][-1]["median"] > slow["round_seconds"][-1]["median"]


def test_random_sessions_cost_rounds_and_resyncs() -> None:
    stable = model(8, 10)
    churned = model(
        8,
        10,
        profiles=[
            PeerProfile(upload_bytes_per_second=5e6, session_seconds=15.0, offline_seconds=5.0)
        ]
        * 8,
    )
    assert stable["totals"]["rounds_lost"] + stable["totals"]["rounds_partial"] == 0
    lost = churned["totals"]["rounds_lost"] + churned["totals"]["rounds_partial"]
    assert lost > 0
    assert churned["totals"]["resyncs"] + len(churned["churn"]["rejoin_seconds"]) > 0


def test_cli_des_writes_the_summary_schema_of_real_processes(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["simulate", "--engine", "des", "--nodes", "5", "--rounds", "3", "--out", str(tmp_path),
         "--step-seconds", "0.02"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    real_keys = {
        "ok", "run", "spec_hash", "algorithm", "codec", "nodes", "rounds", "wall_seconds",
        "initial_val_loss", "final_val_loss", "replicas_identical", "loss_curve",
        "round_seconds", "peers", "profiles",
    }  # fmt: skip
    assert real_keys <= set(summary)
    assert summary["engine"] == "des"
    assert summary["nodes"] == 5
    assert {p["epoch"] for p in summary["peers"]} == {3}
    bad = CliRunner().invoke(app, ["simulate", "--engine", "ray"])
    assert bad.exit_code != 0
    assert "--engine" in bad.output


def test_cli_des_repeats_exactly_with_its_speeds_given_and_refuses_what_it_does_not_model(
    tmp_path: Path,
) -> None:
    # Measured speeds differ run to run; given (with the seed), the model repeats to the byte.
    args = ["simulate", "--engine", "des", "--nodes", "4", "--rounds", "3", "--seed", "7",
            "--step-seconds", "0.02", "--codec-rate", "4e8"]  # fmt: skip
    summaries = []
    for run in ("a", "b"):
        result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / run)])
        assert result.exit_code == 0, result.output
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        summaries.append({k: summary[k] for k in ("wall_seconds", "round_seconds", "totals")})
    assert json.dumps(summaries[0]) == json.dumps(summaries[1])
    for extra, message in [
        (["--codec-rate", "inf"], "--codec-rate must be a positive finite"),
        (["--step-seconds", "1e400"], "--step-seconds must be a positive finite"),
        (["--netem"], "no --netem"),
        (["--launcher", "ray"], "no --netem, --launcher or Ray"),
    ]:
        result = CliRunner().invoke(app, [*args[:-4], *extra, "--out", str(tmp_path / "c")])
        assert result.exit_code == 2, result.output
        assert message in result.output
    result = CliRunner().invoke(app, ["simulate", "--step-seconds", "0.1"])
    assert result.exit_code == 2
    assert "are for --engine des" in result.output


def test_groups_smaller_than_the_swarm_average_apart_and_the_minority_resyncs() -> None:
    # Two groups of 4 end each round with two states; the node keeps the majority's (ties: the
    # smaller checksum) and the other group downloads it: its round is not in the model. What
    # its members trained since is carried onto the download (algorithm.carry_epochs) or, with
    # carry_epochs = 0, dropped.
    def run(group_size: int, carry_epochs: int = 2) -> dict[str, Any]:
        text = DEMO_SPEC.replace("group_size = 256", f"group_size = {group_size}")
        text = text.replace("[averaging]", f"carry_epochs = {carry_epochs}\n\n[averaging]")
        return model(8, 6, spec=RunSpec.from_toml(text))

    def dropped(summary: dict[str, Any]) -> float:
        return sum(p["samples_dropped"] for p in summary["peers"]) / sum(
            p["samples"] for p in summary["peers"]
        )

    whole, apart, dropping = run(8), run(4), run(4, carry_epochs=0)
    assert whole["totals"]["resyncs"] == 0
    assert whole["totals"]["samples_kept"] == 1.0
    for summary in (apart, dropping):
        assert summary["totals"]["resyncs"] >= 4 * 4  # half the swarm, most rounds
    # The final model descends from one group's round each epoch: half of what was averaged at
    # best, whatever the carry keeps; counting only the downloads' drops would say far more.
    assert dropped(apart) == 0
    assert apart["totals"]["samples_kept"] <= 0.5
    assert dropped(dropping) > 0.2
    assert dropping["totals"]["samples_kept"] < 1 - dropped(dropping) - 0.2
    assert dropping["totals"]["samples_kept"] < apart["totals"]["samples_kept"]


@pytest.mark.parametrize("window", [0.0, 4.0])
def test_an_overlapped_round_trains_on_meanwhile(window: float) -> None:
    """``algorithm.overlap``: the model trains the next window while a round is in flight, as
    the node does, where it used to draw every spec's rounds as blocking. On links where a
    round takes about a second, blocking rounds spend that second idle; overlapped ones do not,
    keep every sample (the last round lands before the run ends, as ``finish`` does) and end
    on the same epochs."""
    slow = [PeerProfile(upload_bytes_per_second=1e6, download_bytes_per_second=1e6)] * 4
    algorithm = replace(SPEC.algorithm, inner_steps=40, round_seconds=window)
    blocking, overlapped = (
        model(4, 5, profiles=slow, spec=replace(SPEC, algorithm=replace(algorithm, overlap=o)))
        for o in (False, True)
    )
    for summary in (blocking, overlapped):
        assert [p["epoch"] for p in summary["peers"]] == [5] * 4
        assert summary["totals"]["samples_kept"] == 1.0
        assert summary["totals"]["resyncs"] == 0
    # Only the last round waits (it lands before the run ends).
    assert blocking["totals"]["utilization"] < 0.65
    assert overlapped["totals"]["utilization"] > 0.8
    # The rounds' traffic is the same: only the waiting went.
    assert overlapped["totals"]["bytes_sent_per_peer"] == blocking["totals"]["bytes_sent_per_peer"]
