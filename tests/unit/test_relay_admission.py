"""Whom a node's relay serves, each client's byte budget, and the relay's counts as metrics: no
sockets (the relay on loopback is ``tests/integration/test_relay_limits.py``)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from prometheus_client import generate_latest

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.metrics import NodeMetrics
from swarmgrad.node.reachability.relay import MIB, RelayLimits
from swarmgrad.node.reachability.relay_admission import RelayAdmission
from swarmgrad.node.reachability.relay_server import _Budget


def record(peer_id: str, ttl_seconds: float = 60.0) -> PeerRecord:
    return PeerRecord.create(
        peer_id,
        run_id="r",
        spec_hash=b"\5" * 32,
        endpoint="10.0.0.7:4000",
        now=dht_time(),
        ttl_seconds=ttl_seconds,
    )


class Directory:
    """A node's table of the run; each read waits for ``release`` (a DHT get in flight)."""

    def __init__(self, *peer_ids: str) -> None:
        self.peers = [record(p) for p in peer_ids]
        self.announced: list[PeerRecord] = []  # in the DHT, not yet read
        self.reads = 0
        self.release = asyncio.Event()
        self.release.set()

    async def refresh(self) -> list[PeerRecord]:
        self.reads += 1
        await self.release.wait()
        self.peers = self.peers + self.announced
        return self.peers


def admission(directory: Directory, **options: object) -> RelayAdmission:
    return RelayAdmission(
        peers=lambda: directory.peers,
        reread=directory.refresh,
        reread_seconds=0.05,
        **options,  # type: ignore[arg-type]
    )


async def test_a_member_is_admitted_without_a_read_and_a_private_run_checks_its_allowlist() -> None:
    directory = Directory("sgmember", "sgoutsider")
    admit = admission(directory, allowed=lambda peer_id: peer_id == "sgmember")
    assert await admit("sgmember") is None
    assert await admit("sgoutsider") == "not on this run's allowlist"
    assert await admit("sgnobody") == "not on this run's allowlist"  # no read for it either
    assert directory.reads == 0


async def test_a_record_announced_since_the_last_read_is_found_and_an_expired_one_is_not() -> None:
    directory = Directory()
    directory.announced = [record("sgnewcomer"), record("sgexpired", ttl_seconds=-1.0)]
    admit = admission(directory)
    assert await admit("sgnewcomer") is None
    assert directory.reads == 1
    assert await admit("sgexpired") == "no live record in this run"


async def test_strangers_hellos_share_reads_and_one_deadline_does_not_cancel_them() -> None:
    directory = Directory()
    directory.release.clear()
    admit = admission(directory)
    hellos = [asyncio.ensure_future(admit(f"sgstranger{i}")) for i in range(50)]
    impatient = asyncio.ensure_future(asyncio.wait_for(admit("sgimpatient"), 0.01))
    with pytest.raises(TimeoutError):
        await impatient
    directory.announced = [record("sgstranger7")]
    directory.release.set()
    answers = await asyncio.gather(*hellos)
    assert answers.count(None) == 1  # stranger 7 announced meanwhile
    assert answers.count("no live record in this run") == 49
    assert directory.reads <= 2  # one in flight when they came, one begun after: not 51


def test_a_budget_lets_a_burst_through_then_holds_a_client_to_its_rate() -> None:
    budget = _Budget(rate=MIB, burst=4 * MIB, level=4 * MIB, at=0.0)
    assert budget.take(4 * MIB, now=0.0) == 0.0  # the burst, at once
    assert budget.take(MIB // 2, now=0.0) == pytest.approx(0.5)  # then its rate: wait it out
    assert budget.throttled_for(now=0.4) == pytest.approx(0.4)
    assert budget.take(MIB, now=0.5) == pytest.approx(1.0)  # still asking: still throttled
    assert budget.throttled_for(now=1.4) == pytest.approx(1.4)
    assert budget.throttled_for(now=3.0) == 0.0  # it stopped asking: refilled past a MiB
    assert not budget.full(now=3.0)
    assert budget.full(now=1.5 + 4.0)


def test_relay_limits_refuse_a_budget_that_serves_nothing() -> None:
    with pytest.raises(ValueError, match="rate and burst"):
        RelayLimits(rate_bytes_per_second=0)
    with pytest.raises(ValueError, match="idle_under_pressure_seconds"):
        RelayLimits(idle_seconds=10, idle_under_pressure_seconds=20)


def test_a_relays_refusals_and_evictions_are_exported_by_reason() -> None:
    metrics = NodeMetrics(peer_id="sgme", run_id="r", spec_hash="00", algorithm="a", codec="c")
    counts = Counter(
        {
            "clients": 3,
            "refused: no live record in this run": 8,
            "refused: this relay is full": 1,
            "evicted: idle, for a newcomer": 2,
            "throttled": 40,
        }
    )
    metrics.read_relay(lambda: counts)
    text = generate_latest(metrics.registry).decode()
    assert 'swarmgrad_relay_refusals_total{reason="no live record in this run"} 8.0' in text
    assert 'swarmgrad_relay_refusals_total{reason="this relay is full"} 1.0' in text
    assert 'swarmgrad_relay_evictions_total{reason="idle, for a newcomer"} 2.0' in text
    assert "swarmgrad_relay_throttled_reads_total 40.0" in text
