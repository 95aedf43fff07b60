"""A bootstrap node keeps its peer id, and so the multiaddr its run's volunteers hold, across
restarts (``swarmgrad bootstrap --identity``); nodes join through the old multiaddr."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmgrad.node.identity import Identity
from tests.helpers import libp2p_peer_id, wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Bootstrap:
    """``swarmgrad bootstrap`` in its own process, stopped with Ctrl-C."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.maddrs_file = tmp_path / f"maddrs-{os.urandom(4).hex()}.json"
        env = {**os.environ, "SWARMGRAD_HOME": str(tmp_path / "home")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "swarmgrad.node.cli", "bootstrap", *args,
             "--maddrs-file", str(self.maddrs_file)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip

    def maddrs(self) -> list[str]:
        def written() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"bootstrap exited: {self.process.communicate()[1][-2000:]}")
            return self.maddrs_file.exists()

        wait_until(written, timeout_seconds=90, what="the bootstrap's multiaddrs")
        return list(json.loads(self.maddrs_file.read_text())["maddrs"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()


@pytest.fixture
def bootstraps(tmp_path: Path) -> Iterator[list[_Bootstrap]]:
    started: list[_Bootstrap] = []
    yield started
    for boot in started:
        boot.stop()


def _runs(maddr: str, backend: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmgrad.node.cli", "runs", "--bootstrap", maddr,
         "--discovery", backend, "--json", "--timeout", "20"],
        capture_output=True, text=True, timeout=90,
        env={**os.environ, "SWARMGRAD_HOME": str(tmp_path / "home")},
    )  # fmt: skip


def _peer_id(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[1]


@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
def test_a_restarted_bootstrap_keeps_its_multiaddr_and_nodes_join_through_the_old_one(
    tmp_path: Path, bootstraps: list[_Bootstrap], backend: str
) -> None:
    key, port = tmp_path / "bootstrap.key", str(_free_port())
    args = ("--port", port, "--discovery", backend, "--identity", str(key))
    bootstraps.append(_Bootstrap(tmp_path, *args))
    (first,) = [m for m in bootstraps[0].maddrs() if "/127.0.0.1/" in m]
    assert key.stat().st_mode & 0o077 == 0  # made at the first start, private
    bootstraps[0].stop()

    bootstraps.append(_Bootstrap(tmp_path, *args))
    assert first in bootstraps[1].maddrs()  # the same address and peer id
    joined = _runs(first, backend, tmp_path)  # a volunteer holding the old multiaddr
    assert joined.returncode == 0, joined.stderr[-2000:]
    assert json.loads(joined.stdout) == []  # joined a DHT where nobody published a run yet

    # The peer id is the key file's own (libp2p's id of its Ed25519 key), on either backend.
    assert _peer_id(first) == libp2p_peer_id(Identity.load_or_create(key).public_key)
