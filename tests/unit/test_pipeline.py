"""Pipeline stages without sockets: the spec's [pipeline] section, the stage split and its
initialization, the router's choices, the rebalancing plan, and the status rows per stage."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.pipeline.balance import Move, Replica, Settling, choose_stage, plan_move
from swarmgrad.node.pipeline.model import Pipeline, build_stage, parameter_bytes
from swarmgrad.node.pipeline.routing import BAN_SECONDS, Router
from swarmgrad.node.pipeline.trainer import stages_round
from swarmgrad.node.runspec import PipelineSection, RunSpec, RunSpecError
from swarmgrad.node.status import ScoresError, read_traffic, stage_summary, stages_table
from swarmgrad.simulations.pipeline import PipelineSimulation, simulate_pipeline
from swarmgrad.simulations.profiles import SimulationError

BASE = """
[run]
id = "p"
[model]
vocab_size = 64
d_model = 16
n_layers = 6
n_heads = 2
seq_len = 8
[data]
batch_size = 8
"""


def _spec(pipeline: str) -> RunSpec:
    return RunSpec.from_toml(BASE + "[pipeline]\n" + pipeline)


def test_stages_split_the_layers_evenly_or_at_the_boundaries_given() -> None:
    assert PipelineSection(stages=4).spans(6) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert PipelineSection(stages=2, boundaries=(5,)).spans(6) == [(0, 5), (5, 6)]
    assert PipelineSection().spans(6) == [(0, 6)]


@pytest.mark.parametrize(
    ("pipeline", "message"),
    [
        ('stages = 2\ngradients = "fp16"', "underflow"),
        ('stages = 2\nactivations = "int4"', "'int4' is not safe for pipeline activations"),
        ("stages = 7", "at most model.n_layers"),
        ("stages = 3\nboundaries = [2]", "needs 2 layer indices"),
        ("stages = 3\nboundaries = [3, 2]", "must increase"),
        ("stages = 2\nboundaries = [6]", "below model.n_layers"),
        ("stages = 2\nmicrobatches = 3", "multiple of pipeline.microbatches"),
        ("stages = 2\nboundaries = [1.5]", "list of integers"),
        ("stages = 2\nhysteresis = 1.0", "hysteresis"),
    ],
)
def test_bad_pipeline_sections_are_refused_with_the_key_named(pipeline: str, message: str) -> None:
    with pytest.raises(RunSpecError, match=message):
        _spec(pipeline)


def test_the_pipeline_is_in_the_hash_only_when_there_is_one() -> None:
    plain = RunSpec.from_toml(BASE)
    assert plain.hash == _spec("stages = 1").hash
    two = _spec("stages = 2")
    assert two.hash != plain.hash
    assert _spec('stages = 2\nactivations = "none"').hash != two.hash
    # Each stage's group has its own run id and hash.
    stage_specs = [two.stage_spec(k) for k in range(2)]
    assert [s.run.id for s in stage_specs] == ["p.stage0", "p.stage1"]
    assert len({two.hash, *(s.hash for s in stage_specs)}) == 3
    with pytest.raises(RunSpecError):
        two.stage_spec(2)


def test_stages_build_their_span_alone_and_chain_into_the_whole_model() -> None:
    spec = _spec("stages = 3")
    whole = Pipeline(spec.model, spec.pipeline, seed=5)
    alone = [build_stage(spec.model, spec.pipeline, k, seed=5) for k in range(3)]
    for built, chained in zip(alone, whole.stages, strict=True):
        for (name, a), b in zip(built.named_parameters(), chained.parameters(), strict=True):
            assert torch.equal(a, b), name
    assert sum(parameter_bytes(s) for s in alone) == parameter_bytes(whole)
    # Different layers get different weights (seeded by their names in the whole model).
    assert not torch.equal(alone[0].blocks[0].qkv.weight, alone[1].blocks[0].qkv.weight)
    assert alone[1].global_name("blocks.0.qkv.weight") == "blocks.2.qkv.weight"
    tokens = torch.randint(0, 64, (2, 8))
    x = tokens
    for stage in alone:
        x = stage(x)
    torch.testing.assert_close(x, whole(tokens))
    assert x.shape == (2, 8, 64)


def test_the_router_prefers_the_replica_that_finishes_first_and_bans_the_dead() -> None:
    now = [100.0]
    router = Router(1, clock=lambda: now[0])
    router.update(0, [("slow", "b:1"), ("fast", "a:1")])
    router.done(router.replicas[0]["fast"], 0.1, 1, forward=True)  # 0.1 s of compute a sample
    router.done(router.replicas[0]["slow"], 0.3, 1, forward=True)
    names = []
    for _ in range(8):  # eight microbatches in flight at once: the work routed counts
        replica = router.pick(0, 4)
        assert replica is not None
        router.reserve(replica, 4)
        names.append(replica.peer_id)
    assert names.count("fast") == 6  # 6 x 0.4 s vs 2 x 1.2 s: both done in about 2.4 s
    # The third goes to the fast one: done at 1.2 s either way, and the faster is the safer bet.
    assert names[:4] == ["fast", "fast", "fast", "slow"]
    for replica in router.replicas[0].values():
        router.release(replica, replica.reserved)
    router.ban(router.replicas[0]["fast"])
    assert [r.peer_id for r in router.live(0)] == ["slow"]
    now[0] += BAN_SECONDS + 0.1
    assert {r.peer_id for r in router.live(0)} == {"fast", "slow"}
    router.ban(router.replicas[0]["fast"])  # a second failure: twice as long
    now[0] += BAN_SECONDS + 0.1
    assert [r.peer_id for r in router.live(0)] == ["slow"]
    router.penalize(router.replicas[0]["slow"])  # a deadline missed: slower, not banned
    assert router.replicas[0]["slow"].seconds_per_sample == pytest.approx(0.6)
    # A replica whose record is gone is forgotten, unless banned (so a ban outlives a rejoin).
    router.update(0, [])
    assert list(router.replicas[0]) == ["fast"]
    assert router.pick(0, 1) is None


def test_a_replica_that_reports_a_negative_or_absurd_pace_wins_no_picks() -> None:
    router = Router(1)
    router.update(0, [("liar", "b:1"), ("honest", "a:1")])
    router.done(router.replicas[0]["honest"], 0.1, 1, forward=True)
    for seconds in (-1000.0, math.nan, -math.inf):
        router.done(router.replicas[0]["liar"], seconds, 1, forward=True)
        assert router.replicas[0]["liar"].seconds_per_sample is not None
        assert router.replicas[0]["liar"].seconds_per_sample >= 0
    picks = []
    for _ in range(50):
        replica = router.pick(0, 4)
        assert replica is not None
        router.reserve(replica, 4)
        picks.append(replica.peer_id)
    assert "honest" in picks
    assert router.replicas[0]["liar"].reserved >= 0


def test_auto_fills_the_weakest_stage_and_rebalancing_moves_one_replica_once() -> None:
    assert choose_stage([[], [], []]) == 0
    assert choose_stage([[Replica("a", 0.0)], [], []]) == 1
    assert choose_stage([[Replica("a", 10.0)], [Replica("b", 5.0)]]) == 1
    crowded = [[Replica("a", 10.0), Replica("b", 9.0), Replica("c", 11.0)], [Replica("d", 10.0)]]
    assert plan_move(crowded) == Move("a", 0, 1)  # the lowest peer id of the strongest stage
    moved = [[Replica("b", 9.0), Replica("c", 11.0)], [Replica("d", 10.0), Replica("a", 10.0)]]
    assert plan_move(moved) is None  # 21 vs 19: a move would only shift the bottleneck
    # Under the hysteresis: no move (19 -> 20 is not 1 / 0.75 better).
    close = [[Replica("a", 10.0), Replica("b", 10.0)], [Replica("d", 19.0)]]
    assert plan_move(close) is None
    # Never empty a stage; never plan while a replica has not measured its throughput.
    assert plan_move([[Replica("a", 50.0)], [Replica("d", 1.0)]]) is None
    assert plan_move([[Replica("a", 10.0), Replica("b", 0.0)], [Replica("d", 1.0)]]) is None
    # A stage nobody serves gets a replica.
    assert plan_move([[Replica("b", 10.0), Replica("c", 9.0)], []]) == Move("b", 0, 1)


def test_a_mover_is_counted_at_what_the_target_stages_replicas_serve() -> None:
    # Stage 0 costs three times stage 1's compute per sample: six replicas serve 10 samples/s
    # each, stage 1's one serves 30. A replica of stage 0 would serve 30 there: 50 vs 30 is
    # worth the move (counted at its own 10 samples/s, it was not: 50 vs 40).
    heavy = [Replica(name, 10.0) for name in "abcdef"]
    assert plan_move([heavy, [Replica("g", 30.0)]]) == Move("a", 0, 1)
    # The other way round: three replicas of a light stage (30 each) against four of a heavy
    # one (10 each). One would serve 10 there: 60 vs 50 is under the hysteresis (counted at
    # its own 30 samples/s, it moved for 60 vs 70).
    light = [Replica(name, 30.0) for name in "abc"]
    assert plan_move([light, [Replica(name, 10.0) for name in "defg"]]) is None


def test_no_second_replica_moves_while_the_first_is_on_its_way() -> None:
    # Stage 0's three replicas against stage 1's one; "a" is planned to move and leaves.
    settling = Settling(checks=3, steady=0)
    before = [[Replica("a", 10.0), Replica("b", 12.0), Replica("c", 12.0)], [Replica("d", 10.0)]]
    assert settling.settled(before)
    assert plan_move(before) == Move("a", 0, 1)
    # While "a" is in no stage, stage 0 looks strong enough to give a second replica away...
    away = [[Replica("b", 12.0), Replica("c", 12.0)], [Replica("d", 8.0)]]
    assert plan_move(away) == Move("b", 0, 1)
    # ...but nobody plans until "a" serves again, wherever that is.
    assert not settling.settled(away)
    assert not settling.settled(away)
    assert settling.away == {"a": 2}
    moved = [[Replica("b", 12.0), Replica("c", 12.0)], [Replica("d", 8.0), Replica("a", 9.0)]]
    assert settling.settled(moved)  # it joined stage 1
    # One that is gone for good is waited for only so many checks.
    gone = [[Replica("b", 12.0), Replica("c", 12.0)], [Replica("a", 9.0)]]
    assert not settling.settled(gone)
    assert [settling.settled(gone) for _ in range(3)] == [False, False, True]


def test_plans_wait_for_the_same_replicas_measured_for_some_checks() -> None:
    # A moved replica's first rates, and its new neighbours' while it catches up, are not
    # what they serve: no plan until every stage has kept its replicas, all measured, for
    # `steady` checks in a row.
    settling = Settling(checks=3, steady=3)
    joined = [[Replica("b", 12.0), Replica("c", 12.0)], [Replica("d", 10.0), Replica("a", 0.0)]]
    catching_up = [[Replica("b", 12.0), Replica("c", 12.0)], [Replica("d", 2.0), Replica("a", 2.5)]]
    steady = [[Replica("b", 12.0), Replica("c", 12.0)], [Replica("d", 10.0), Replica("a", 9.0)]]
    views = (joined, joined, catching_up, catching_up, steady)
    assert [settling.settled(v) for v in views] == [False, False, False, False, True]
    assert plan_move(catching_up) == Move("b", 0, 1)  # what a plan on those views would do
    assert plan_move(steady) is None
    # A replica that moves between checks (never seen away) restarts the count too.
    swapped = [[Replica("b", 12.0)], [Replica("d", 10.0), Replica("a", 9.0), Replica("c", 1.0)]]
    assert [settling.settled(swapped) for _ in range(4)] == [False, False, False, True]


def test_status_sums_each_stage_and_marks_one_with_no_replica_serving() -> None:
    def row(stage: int, state: str, throughput: float, version: int) -> dict[str, Any]:
        replica = {"index": stage, "state": state, "queue_depth": 1, "version": version}
        return {"throughput": throughput, "stage": replica | {"span": [0, 0]}}

    rows = [
        row(0, "serving", 100.0, 7),
        row(0, "serving", 50.0, 6),
        row(1, "draining", 80.0, 7),
        {"throughput": 9.0},  # a trainer or bootstrap: no stage
    ]
    summary = stage_summary(rows, [(0, 5), (5, 8)])
    assert [(s["serving"], s["replicas"], s["capacity"]) for s in summary] == [
        (2, 2, 150.0),
        (0, 1, 0.0),
    ]
    assert summary[0]["versions"] == [6, 7]
    assert summary[0]["queued"] == 2
    console = Console(width=120, record=True)
    console.print(stages_table(summary))
    text = console.export_text()
    for cell in ("0..4", "5..7", "2 of 2", "none"):
        assert cell in text


def test_traffic_reads_a_trainers_status_file_and_refuses_others(tmp_path: Path) -> None:
    trainer = tmp_path / "trainer.json"
    trainer.write_text(json.dumps({"peer_id": "t", "step": 3, "samples": 48, "stages": [{}]}))
    seen = read_traffic(trainer)
    assert (seen["step"], seen["samples"], len(seen["stages"])) == (3, 48, 1)
    node = tmp_path / "node.json"
    node.write_text(json.dumps({"peer_id": "n", "trust": {}}))
    with pytest.raises(ScoresError, match="not a pipeline trainer's status file"):
        read_traffic(node)
    with pytest.raises(ScoresError, match="cannot read"):
        read_traffic(tmp_path / "missing.json")


def test_a_pipeline_simulation_refuses_events_it_cannot_play(tmp_path: Path) -> None:
    churn = tmp_path / "churn.toml"
    churn.write_text("[[event]]\nat_epoch = 1\naction = \"pause\"\nnode = 0\n"
                     "[[event]]\nat_epoch = 2\naction = \"resume\"\nnode = 0\n")  # fmt: skip
    config = PipelineSimulation(
        stages=2, nodes=2, trainers=1, rounds=1, churn_path=churn, out_dir=tmp_path / "out"
    )
    with pytest.raises(SimulationError, match="pause node 0: a pipeline simulation's events"):
        simulate_pipeline(config)
    # A schedule that does not parse, and a start of a node beyond --nodes: said, no traceback.
    churn.write_text('[[event]]\nat_epoch = 1\naction = "kill"\nnode = 5\n')
    with pytest.raises(SimulationError, match="node 5 is not running then"):
        simulate_pipeline(config)
    churn.write_text('[[event]]\nat_epoch = 1\naction = "start"\nnode = 2\n')
    with pytest.raises(SimulationError, match="not new ones"):
        simulate_pipeline(config)


async def test_a_restarted_trainer_resumes_at_the_round_the_stages_reached() -> None:
    # Replicas at epoch E answer "done" at once to every round <= E: a trainer counting rounds
    # from 0 again ran no averaging until it had redone E rounds of steps.
    def record(stage: int, epoch: int, state: str = "serving") -> PeerRecord:
        return PeerRecord.create(
            f"peer-{stage}-{epoch}-{state}",
            run_id="p",
            spec_hash=b"\5" * 32,
            endpoint="127.0.0.1:1",
            now=0.0,
            ttl_seconds=60,
            stage=stage,
            epoch=epoch,
            state=state,
        )

    class View:
        def __init__(self, records: list[PeerRecord]) -> None:
            self.records = records

        async def find(self) -> list[PeerRecord]:
            return self.records

    views = [
        View([record(0, 5), record(0, 4), record(0, 9, "joining")]),
        View([record(1, 6)]),
    ]
    assert await stages_round(views) == 5
    assert await stages_round([View([record(0, 3)]), View([])]) == 0  # a stage nobody serves
