"""A simulation's processes are stopped together: each is asked to leave at the same time, and
one that will not leave is killed at the deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmgrad.simulations.launchers import (
    LOCAL_HEAD_STARTS,
    LocalProcess,
    Process,
    ray_cluster,
    stop_all,
)
from swarmgrad.simulations.profiles import SimulationError
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


def test_warm_processes_are_real_processes_forked_with_their_own_log_env_and_status(
    tmp_path: Path,
) -> None:
    def warm(name: str, *command: str, env: dict[str, str] | None = None) -> LocalProcess:
        argv = [sys.executable, "-m", *command]
        return LocalProcess(name, argv, tmp_path / f"{name}.log", env=env or {}, warm=True)

    (tmp_path / "good.json").write_text('{"b": 1, "a": [2]}')
    (tmp_path / "bad.json").write_text("{not json")
    good = warm("good", "json.tool", "--sort-keys", str(tmp_path / "good.json"))
    bad = warm("bad", "json.tool", str(tmp_path / "bad.json"))
    env = warm("env", "timeit", "-n1", "-r1", "import os; assert os.environ == {'ONLY': 'this'}")
    sleeper = warm("sleeper", "timeit", "-n1", "-r1", "import time; time.sleep(60)")
    assert good.popen.wait(60) == 0
    assert json.loads(good.log_path.read_text()) == {"a": [2], "b": 1}  # its stdout: the log
    assert bad.popen.wait(60) == 1
    assert "Expecting property name" in bad.tail()  # its stderr too
    assert env.popen.wait(60) == 1  # (the environment it was given, not this one's)
    env = warm("env2", "timeit", "-n1", "-r1", "import os; assert os.environ == {'ONLY': 'this'}",
               env={"ONLY": "this"})  # fmt: skip
    assert env.popen.wait(60) == 0

    # Signals as a fresh interpreter started from here has them (SIGINT depends on how this one
    # was started: a background job inherits it ignored): a write to a closed socket raises.
    def dispositions(path: Path) -> str:
        names = ("SIGPIPE", "SIGINT", "SIGTERM", "SIGCHLD", "SIGHUP")
        return (f"import signal as s, pathlib; pathlib.Path({str(path)!r}).write_text(repr("
                f"[str(s.getsignal(getattr(s, n))) for n in {names!r}]))")  # fmt: skip

    forked, fresh = tmp_path / "forked.txt", tmp_path / "fresh.txt"
    signals = warm("signals", "timeit", "-n1", "-r1", dispositions(forked))
    assert signals.popen.wait(60) == 0, signals.tail()
    subprocess.run([sys.executable, "-c", dispositions(fresh)], check=True, timeout=60)
    assert forked.read_text() == fresh.read_text()
    assert forked.read_text().startswith(f"[{str(signal.SIG_IGN)!r}")  # SIGPIPE, as Python does
    # Not a thread or a child of this process: a process of its own, in a session of its own.
    pid = sleeper.popen.pid
    assert pid not in {good.popen.pid, bad.popen.pid, os.getpid()}
    assert os.getsid(pid) == pid
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "sleeper"  # as ps and top name it
    assert sleeper.poll() is None
    started = time.monotonic()
    sleeper.kill()
    assert sleeper.poll() == -signal.SIGKILL
    assert time.monotonic() - started < 10


class _HalfStartedHead:
    """What a failed ``ray.init`` leaves: a head object that started a process, then raised
    from its constructor; only the error's traceback still holds its ``Popen``."""

    def __init__(self, error: Exception, left: list[subprocess.Popen[bytes]]) -> None:
        self.gcs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        left.append(self.gcs)  # for the test to look at, never to wait on
        raise error


class _SlowHead:
    """A stand-in for the ``ray`` module whose local head misses Ray's startup deadline the
    first ``misses`` times, each time leaving a started process behind, as a real one does."""

    def __init__(self, misses: int, error: Exception | None = None) -> None:
        self.misses, self.starts, self.shutdowns = misses, 0, 0
        self.left: list[subprocess.Popen[bytes]] = []
        self.error = error or Exception("The current node timed out during startup. (stand-in)")

    def init(self, **_: object) -> None:
        self.starts += 1
        if self.starts <= self.misses:
            _HalfStartedHead(self.error, self.left)

    def shutdown(self) -> None:
        self.shutdowns += 1

    def reaped(self) -> bool:
        """Every process a failed start left was killed, and its ``Popen`` read its exit
        status (gone unread, Python warns "subprocess ... is still running" as it collects
        it, and pytest fails the test that happened to be running: the Ray test in CI)."""
        return all(p.returncode is not None for p in self.left)


def test_a_local_ray_head_that_starts_too_slowly_is_started_again_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = _SlowHead(misses=2)
    monkeypatch.setitem(sys.modules, "ray", slow)
    with ray_cluster(""):
        assert slow.starts == 3
    assert slow.reaped()  # killed and waited for, not left running

    never = _SlowHead(misses=LOCAL_HEAD_STARTS)
    monkeypatch.setitem(sys.modules, "ray", never)
    tries = r"cannot start a local Ray head \(3 tries\)"
    with pytest.raises(SimulationError, match=tries), ray_cluster(""):
        pass
    assert never.reaped()

    # The GCS missing its own deadline (CI, once): "cannot join the cluster" was wrong, and
    # the head was not started again.
    gcs = _SlowHead(misses=1, error=RuntimeError("Timed out waiting for file /tmp/ray/gcs_port"))
    monkeypatch.setitem(sys.modules, "ray", gcs)
    with ray_cluster(""):
        assert gcs.starts == 2
    assert gcs.reaped()

    # A cluster that was named is joined once: its failure is an answer, not a race.
    remote = _SlowHead(misses=1)
    monkeypatch.setitem(sys.modules, "ray", remote)
    once = r"the cluster at 10.0.0.1:6379 \(1 tries\)"
    with pytest.raises(SimulationError, match=once), ray_cluster("10.0.0.1:6379"):
        pass
    assert remote.starts == 1
    assert remote.reaped()
