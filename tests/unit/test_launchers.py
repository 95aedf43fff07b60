"""A simulation's processes are stopped together: each is asked to leave at the same time, and
one that will not leave is killed at the deadline."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from swarmgrad.simulations.launchers import LocalProcess, Process, stop_all
from tests.helpers import wait_until

# A node stand-in: on SIGTERM it announces that it is leaving, then waits for every other
# cooperative process to announce the same before it exits 0 (1 if they never do): processes
# stopped one after another would never see each other leave.
COOPERATIVE = """\
import pathlib, signal, sys, time
folder, me, peers = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def leave(*_):
    (folder / f"{me}.leaving").touch()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if len(list(folder.glob("*.leaving"))) == peers:
            sys.exit(0)
        time.sleep(0.01)
    sys.exit(1)
signal.signal(signal.SIGTERM, leave)
(folder / f"{me}.ready").touch()
while True:
    signal.pause()
"""

STUBBORN = """\
import pathlib, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
(pathlib.Path(sys.argv[1]) / f"{sys.argv[2]}.ready").touch()
while True:
    signal.pause()
"""


def test_stop_all_asks_every_process_at_once_and_kills_one_that_stays(tmp_path: Path) -> None:
    cooperative = [
        LocalProcess(
            f"node-{i}",
            [sys.executable, "-c", COOPERATIVE, str(tmp_path), f"node-{i}", "3"],
            tmp_path / f"node-{i}.log",
            env={},
        )
        for i in range(3)
    ]
    stubborn = LocalProcess(
        "stubborn",
        [sys.executable, "-c", STUBBORN, str(tmp_path), "stubborn"],
        tmp_path / "stubborn.log",
        env={},
    )
    processes: list[Process] = [*cooperative, stubborn]
    wait_until(
        lambda: len(list(tmp_path.glob("*.ready"))) == 4,
        timeout_seconds=30,
        what="every process handling SIGTERM",
    )
    stop_all(processes, timeout_seconds=3)
    # Every cooperative process saw the other two leave too: they were asked together.
    assert [p.poll() for p in cooperative] == [0, 0, 0], [p.tail() for p in cooperative]
    assert stubborn.poll() == -signal.SIGKILL
    stop_all([])  # nothing to stop is not an error
