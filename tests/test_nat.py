"""Volunteers behind NAT, in the NAT lab: real node processes in network namespaces, real routers
(nftables masquerade, no port forwarding, unsolicited inbound dropped), a real UPnP gateway.

Needs root (namespaces); the README's test set-up installs nftables and miniupnpd.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.simulations.natlab import (
    LabNode,
    NatLab,
    lab_node,
    start_bootstrap,
    wait_until,
)
from swarmgrad.simulations.swarm import DEMO_SPEC

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

ROUNDS = 4


@pytest.fixture
def lab() -> Iterator[NatLab]:
    with NatLab() as lab:
        yield lab


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(DEMO_SPEC.replace('id = "shakespeare-demo"', 'id = "nat-lab"'))
    return path


def settled(kind: str) -> Any:
    return lambda s: s.get("reachability") == kind


def trained(rounds: int) -> Any:
    return lambda s: s.get("epoch", 0) >= rounds


def stop_all(nodes: list[LabNode]) -> None:
    for node in nodes:
        node.stop()


def test_two_public_and_two_natted_peers_train_together(
    lab: NatLab, spec: Path, tmp_path: Path
) -> None:
    n = ROUNDS
    boot = lab.public()
    public = [lab.public(), lab.public()]
    homes = [lab.home(), lab.home()]
    maddrs = start_bootstrap(boot, tmp_path)
    nodes = [
        lab_node(host, f"node-{i}", spec_path=spec, bootstrap=maddrs, out_dir=tmp_path, rounds=n)
        for i, host in enumerate(public + homes)
    ]
    for node in nodes:
        node.start()
    try:
        wait_until(nodes[:2], settled("direct"), timeout_seconds=90, what="public peers direct")
        natted = wait_until(
            nodes[2:], settled("relayed"), timeout_seconds=90, what="NAT'd peers relayed"
        )
        relays = {s["via"] for s in natted}
        public_ids = {s["peer_id"] for s in (n.status() for n in nodes[:2])}
        assert relays <= public_ids  # each NAT'd peer rides on a public peer's relay
        for status, host in zip(natted, homes, strict=True):
            assert not status["endpoint"].startswith(host.address)  # its relayed endpoint
        done = wait_until(nodes, trained(ROUNDS), timeout_seconds=240, what="trained")
        assert len({s["checksum"] for s in done}) == 1, [s["checksum"] for s in done]
        for status in done:
            history = status["history"]
            averaged = [h for h in history if h.get("outcome") in ("averaged", "partial")]
            assert any(h.get("group_size") == 4 for h in averaged), history
            assert status["val_loss"] < status["initial_val_loss"]
        # The relays carried real traffic: the NAT'd peers own parts of the vector.
        relayed = sum(n.status().get("relayed_bytes", 0) for n in nodes[:2])
        assert relayed > 0
    finally:
        stop_all(nodes)
