"""The group all-reduce across real processes on 127.0.0.1: correctness with every codec, and
what survivors get when a member is killed, stalls, or sends corrupted chunks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmgrad.compression import decode, get_codec
from swarmgrad.node.averaging.group import Group, Member, chunk_sizes
from swarmgrad.simulations.allreduce_peer import PeerProcess, member_vector
from tests.conftest import Peers

CODECS = ["none", "fp16", "bf16", "int8", "int4", "topk", "sparse", "powersgd"]


def expected_average(
    members: list[dict[str, Any]], seeds: list[int], size: int, codec: str, chunk_values: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(true weighted mean, what the protocol computes: members' chunks through the codec,
    owner's own values exact, the average re-encoded once)."""
    vectors = [member_vector(s, size) for s in seeds]
    weights = torch.tensor([m["weight"] for m in members], dtype=torch.float64)
    alpha = (weights / weights.sum()).tolist()
    true = sum(a * v.double() for a, v in zip(alpha, vectors, strict=True)) / sum(alpha)
    group = Group(round=0, members=tuple(Member(**m) for m in members))
    c = get_codec(codec)
    protocol = torch.empty(size)
    for owner, (start, end) in enumerate(group.partition(size)):
        offset = start
        for numel in chunk_sizes(end - start, chunk_values):
            total = torch.zeros(numel)
            for i, v in enumerate(vectors):
                part = v[offset : offset + numel]
                seen = part if i == owner else decode(*c.encode(part))
                total += alpha[i] * seen
            protocol[offset : offset + numel] = decode(*c.encode(total / sum(alpha)))
            offset += numel
    return true.float(), protocol


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def load(event: dict[str, Any]) -> torch.Tensor:
    data = bytearray(Path(event["path"]).read_bytes())
    return torch.frombuffer(data, dtype=torch.float32)


async def run_round(
    peers: list[PeerProcess],
    members: list[dict[str, Any]],
    *,
    codec: str,
    round_: int,
    size: int,
    seeds: list[int],
    faults: dict[int, dict[str, Any]] | None = None,
    timeout_seconds: float = 60.0,
) -> list[dict[str, Any] | None]:
    """Send one round to every peer; each one's event, or None for a peer that died or froze."""
    for i, peer in enumerate(peers):
        await peer.send(
            {
                "cmd": "round",
                "codec": codec,
                "round": round_,
                "members": members,
                "seed": seeds[i],
                "size": size,
                "fault": (faults or {}).get(i),
            }
        )

    async def outcome(i: int, peer: PeerProcess) -> dict[str, Any] | None:
        if faults and i in faults:
            return None
        return await peer.event(timeout_seconds)

    return await asyncio.gather(*(outcome(i, p) for i, p in enumerate(peers)))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4, 8])
async def test_members_in_separate_processes_average_with_every_codec(peers: Peers, n: int) -> None:
    chunk_values = 4096
    args = ("--codecs", ",".join(CODECS), "--chunk-values", str(chunk_values), "--threads", "1")
    procs = await asyncio.gather(*(peers.start(f"peer{i}", *args) for i in range(n)))
    size = 30_011 + 1000 * n  # parts of unequal sizes, none a multiple of the chunk
    for round_, codec in enumerate(CODECS):
        members = [
            p.member(codec, weight=float(i + 1), bandwidth=float(1 + i % 3))
            for i, p in enumerate(procs)
        ]
        seeds = [1000 * round_ + i for i in range(n)]
        events = await run_round(procs, members, codec=codec, round_=round_, size=size, seeds=seeds)
        true, protocol = expected_average(members, seeds, size, codec, chunk_values)
        results = []
        for event in events:
            assert event is not None
            assert event["event"] == "done", event
            assert sorted(event["contributors"]) == sorted(p.peer_id for p in procs)
            assert event["missing"] == []
            assert event["failures"] == {}
            results.append(load(event))
        assert len({e["sha256"] for e in events if e}) == 1, f"{codec}: members differ"
        # Exactly what the protocol should compute (up to fp32 summation order) ...
        assert rel(results[0], protocol) < (1e-2 if codec in ("topk", "sparse") else 1e-3), codec
        # ... which is the weighted mean within the codec's error.
        bound = {"none": 1e-6, "fp16": 1e-3, "bf16": 1e-2, "int8": 3e-2, "int4": 0.4}
        if codec in bound:
            assert rel(results[0], true) < bound[codec], codec
        else:  # topk, sparse, powersgd: a lossy projection, never worse than sending nothing
            assert rel(results[0], true) < 1.0


FAULT_ARGS = (
    "--chunk-values",
    "8192",
    "--sender-timeout",
    "2",
    "--reducer-timeout",
    "4",
    "--round-timeout",
    "10",
    "--join-timeout",
    "5",
    "--threads",
    "1",
)
ROUND_TIMEOUT_SECONDS = 10.0


def check_survivors(
    events: list[dict[str, Any] | None],
    procs: list[PeerProcess],
    bad: int,
    started: float,
    *,
    owner_lost: bool,
) -> None:
    survivors = [p.peer_id for i, p in enumerate(procs) if i != bad]
    done = [e for e in events if e is not None]
    assert len(done) == len(survivors)
    # Everyone returned within the round deadline (plus process I/O slack).
    assert time.monotonic() - started < ROUND_TIMEOUT_SECONDS + 3
    for event in done:
        assert event["event"] == "done", event
        assert sorted(event["contributors"]) == sorted(survivors), event
        assert procs[bad].peer_id in event["failures"] or not owner_lost
        if owner_lost:
            assert event["missing"], "the failed owner's part must be reported missing"
    # Bit-identical wherever every survivor has averaged values.
    vectors = [load(e) for e in done]
    mask = torch.ones_like(vectors[0], dtype=torch.bool)
    for event in done:
        for start, end in event["missing"]:
            mask[start:end] = False
    assert mask.any()
    for v in vectors[1:]:
        assert torch.equal(v[mask], vectors[0][mask])


async def next_round_of_survivors(survivors: list[PeerProcess], round_: int, size: int) -> None:
    members = [p.member("int8") for p in survivors]
    events = await run_round(
        survivors,
        members,
        codec="int8",
        round_=round_,
        size=size,
        seeds=[round_ * 10 + i for i in range(len(survivors))],
    )
    assert all(e is not None and e["event"] == "done" for e in events), events
    assert all(e is not None and e["missing"] == [] and e["partial"] == [] for e in events)
    assert len({e["sha256"] for e in events if e}) == 1


@pytest.mark.slow
async def test_kill_9_mid_stream_ten_times_in_a_row(peers: Peers) -> None:
    size = 4 * 6 * 8192 + 123  # ~6 chunks per part
    procs = list(await asyncio.gather(*(peers.start(f"p{i}", *FAULT_ARGS) for i in range(4))))
    round_ = 0
    for trial in range(10):
        victim = trial % 4
        members = [p.member("int8") for p in procs]
        started = time.monotonic()
        events = await run_round(
            procs,
            members,
            codec="int8",
            round_=round_,
            size=size,
            seeds=[round_ * 10 + i for i in range(4)],
            faults={victim: {"kind": "kill", "after_chunks": 3}},
            timeout_seconds=ROUND_TIMEOUT_SECONDS + 5,
        )
        assert await procs[victim].process.wait() == -9
        check_survivors(events, procs, victim, started, owner_lost=True)
        survivors = [p for i, p in enumerate(procs) if i != victim]
        replacement, _ = await asyncio.gather(
            peers.start(f"p{victim}-{trial}", *FAULT_ARGS),
            next_round_of_survivors(survivors, round_ + 1, size),
        )
        procs[victim] = replacement
        round_ += 2


async def faulty_round(
    peers: Peers, prefix: str, size: int, bad: int, fault: dict[str, Any]
) -> tuple[list[PeerProcess], list[dict[str, Any] | None], float]:
    """Four fresh members run one round in which member ``bad`` suffers ``fault``."""
    procs = list(
        await asyncio.gather(*(peers.start(f"{prefix}{i}", *FAULT_ARGS) for i in range(4)))
    )
    started = time.monotonic()
    events = await run_round(
        procs,
        [p.member("int8") for p in procs],
        codec="int8",
        round_=0,
        size=size,
        seeds=[1, 2, 3, 4],
        faults={bad: fault},
        timeout_seconds=ROUND_TIMEOUT_SECONDS + 5,
    )
    return procs, events, started


@pytest.mark.slow
async def test_member_that_stalls_is_dropped_within_the_deadline(peers: Peers) -> None:
    size = 4 * 6 * 8192 + 77
    procs, events, started = await faulty_round(
        peers, "s", size, 2, {"kind": "stall", "after_chunks": 3}
    )
    check_survivors(events, procs, 2, started, owner_lost=True)
    procs[2].kill()
    await next_round_of_survivors([p for i, p in enumerate(procs) if i != 2], 1, size)


@pytest.mark.slow
async def test_member_that_sends_corrupted_chunks_is_excluded(peers: Peers) -> None:
    procs, events, started = await faulty_round(
        peers, "c", 4 * 6 * 8192 + 5, 1, {"kind": "truncate", "after_chunks": 2}
    )
    # The corrupting peer is alive and owns an honest part: its event comes too.
    bad_event = await procs[1].event(ROUND_TIMEOUT_SECONDS + 5)
    assert bad_event["event"] in ("done", "aborted")
    check_survivors(events, procs, 1, started, owner_lost=False)
    for event in events:
        if event is not None:
            assert "c1" in event["partial"] or "c1" not in event["contributors"]
