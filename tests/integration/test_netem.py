"""``simulate --netem``: real nodes, each in its own network namespace with links shaped from its
profile; a node cut off by a partition trains on alone, and once healed it catches up by state
sync, ending with the swarm's parameters."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from swarmgrad.simulations.netem import unavailable
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate
from tests.helpers import light

pytestmark = pytest.mark.skipif(
    bool(unavailable()), reason=f"--netem needs {', '.join(unavailable())}"
)

SCHEDULE = """\
[[event]]
at_epoch = 2
action = "partition"
node = 3

[[event]]
at_epoch = 4
action = "heal"
node = 3
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_partitioned_node_rejoins_by_state_sync_and_replicas_end_identical(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(
        light(DEMO_SPEC).replace(
            "matchmaking_timeout_seconds = 20.0", "matchmaking_timeout_seconds = 8.0"
        )
    )
    profile = tmp_path / "peers.toml"  # a home link: 16 Mbit/s up, 32 down
    profile.write_text("[[peer]]\nupload_bytes_per_second = 2e6\ndownload_bytes_per_second = 4e6\n")
    churn = tmp_path / "churn.toml"
    churn.write_text(SCHEDULE)
    rounds = 7
    summary = simulate(
        SimulationConfig(
            nodes=4,
            rounds=rounds,
            spec_path=spec,
            profile_path=profile,
            churn_path=churn,
            out_dir=tmp_path / "sim",
            netem=True,
            timeout_seconds=360,
        )
    )
    assert summary["netem"]
    assert [e["event"] for e in summary["churn"]["events"]] == [
        "epoch 2: partition node 3",
        "epoch 4: heal node 3",
    ]
    assert [p["epoch"] for p in summary["peers"]] == [rounds] * 4
    assert summary["replicas_identical"]
    # Cut off, node 3 found nobody (or, cut off mid-round, its round ended partial: one CI
    # run); healed, it downloaded the swarm's newer state.
    log = (tmp_path / "sim" / "node-3.log").read_text()
    cut_off = log.split("healed")[0] if "healed" in log else log
    assert any(sign in cut_off for sign in ("no group", "nobody else was ready", ": partial"))
    resynced = [int(m) for m in re.findall(r"resynced from \d+ donor\(s\): epoch (\d+)", log)]
    assert resynced, log[-3000:]
    assert "node-3" in summary["churn"]["rejoin_seconds"]


ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    connection, _ = server.accept()
    while data := connection.recv(65536):
        connection.sendall(data)
    connection.close()
"""

# Ready once a ping comes back: the proxy accepts before the echo server behind it listens, and
# then closes the connection (an empty read), so connecting alone proves nothing.
PING = """
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        connection.sendall(b"ping")
        if connection.recv(4) == b"ping":
            break
        connection.close()
    except OSError:
        pass
    if time.monotonic() > deadline:
        raise TimeoutError("no echo")
    time.sleep(0.05)
rtts = []
for _ in range(5):
    started = time.perf_counter()
    connection.sendall(b"ping")
    assert connection.recv(4) == b"ping"
    rtts.append(time.perf_counter() - started)
print(min(rtts))
"""


@pytest.mark.timeout(120)
def test_the_delay_proxy_gives_a_grpc_port_both_ends_latency() -> None:
    import subprocess
    import sys

    from swarmgrad.simulations.netem import GRPC_PORT, Wan
    from swarmgrad.simulations.profiles import PeerProfile

    with Wan(delays=True) as wan:
        caller = wan.host(PeerProfile(latency_ms=30.0))
        node = wan.host(PeerProfile(latency_ms=20.0, jitter_ms=2.0))
        for port in (GRPC_PORT, GRPC_PORT + 10):  # its gRPC port, and one not redirected
            node.popen([sys.executable, "-c", ECHO, node.address, str(port)],
                       stdout=subprocess.DEVNULL)  # fmt: skip

        def ping(port: int) -> float:
            done = subprocess.run(
                ["ip", "netns", "exec", caller.namespace, sys.executable, "-c", PING,
                 node.address, str(port)],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            return float(done.stdout)

        delayed, direct = ping(GRPC_PORT), ping(GRPC_PORT + 10)
    # 2 x (30 + 20) ms, less the jitter; the port the proxy does not stand in front of: none
    assert 0.096 <= delayed < 0.2, delayed
    assert direct < 0.02, direct
