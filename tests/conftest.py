"""Shared fixtures: child processes are reaped whatever happens to the test.

``tests/unit/`` needs no sockets; ``tests/integration/`` starts real servers, DHT nodes and
processes. Waiting helpers are in ``tests/helpers.py``; ``tests/lanes.py`` splits the suite in
two lanes for ``pytest -n 2``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from swarmgrad.node.config import home
from swarmgrad.node.training.data import load_demo
from swarmgrad.simulations.allreduce_peer import PeerProcess
from tests import lanes

# The test modules' shared parts that assert: pytest explains their failures as a test's own.
pytest.register_assert_rewrite("tests.integration.averaging_streams", "tests.unit.codec_data")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``-n N`` (xdist's default ``--dist load``), the two lanes of ``tests/lanes.py``;
    another ``--dist`` keeps xdist's own scheduler."""
    if config.getoption("dist") != "load":
        return None
    return lanes.make_scheduler(config, log)


def _cpu_seconds() -> float:
    """CPU this process and its reaped children have used (user and system)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT_START] = _cpu_seconds()
    item.stash[_STARTED_AT] = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None] | pytest.TestReport:
    report: pytest.TestReport = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        # CPU of the test's own process and of the children it reaped (node processes are
        # reaped by the time it ends): with the seconds, what tells a test that computes from
        # one that waits (xdist sends user_properties to the controller).
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[_CPU_AT_START]))
        # When it started (epoch seconds): lines the test up with a machine-wide CPU sampler.
        report.user_properties.append(("started_at", item.stash[_STARTED_AT]))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's seconds (setup, call and teardown together), CPU and lane, for the timings
    file."""
    _TIMINGS.setdefault(report.nodeid, 0.0)
    _TIMINGS[report.nodeid] += report.duration
    for key, value in report.user_properties:
        if key == "cpu_seconds":
            _CPU[report.nodeid] = float(value)  # type: ignore[arg-type]
        elif key == "started_at":
            _STARTED[report.nodeid] = float(value)  # type: ignore[arg-type]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write every test's seconds and lane to ``.pytest_cache/timings.json`` (the suite's time,
    by lane: what ``tests/lanes.py`` balances; ``scripts/timings.py`` reads it)."""
    if not _TIMINGS or hasattr(session.config, "workerinput"):  # a worker: its controller writes
        return
    out = session.config.rootpath / ".pytest_cache" / "timings.json"
    out.parent.mkdir(exist_ok=True)
    rows = [
        {
            "test": nodeid,
            "lane": lanes.lane(nodeid),
            "seconds": round(seconds, 2),
            "cpu_seconds": round(_CPU.get(nodeid, 0.0), 2),
            "started_at": round(_STARTED.get(nodeid, 0.0), 2),
        }
        for nodeid, seconds in sorted(_TIMINGS.items(), key=lambda item: -item[1])
    ]
    out.write_text(json.dumps(rows, indent=1) + "\n")


_TIMINGS: dict[str, float] = {}
_CPU: dict[str, float] = {}
_STARTED: dict[str, float] = {}
_CPU_AT_START = pytest.StashKey[float]()
_STARTED_AT = pytest.StashKey[float]()


class Peers:
    """Starts allreduce_peer processes and kills every one of them at teardown."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.started: list[PeerProcess] = []

    async def start(self, peer_id: str, *args: str) -> PeerProcess:
        peer = await PeerProcess.start(peer_id, self.out_dir, *args)
        self.started.append(peer)
        return peer


@pytest_asyncio.fixture
async def peers(tmp_path: Path) -> AsyncIterator[Peers]:
    registry = Peers(tmp_path)
    try:
        yield registry
    finally:
        for peer in registry.started:
            peer.kill()
        for peer in registry.started:
            await peer.process.wait()


#: Helpers of this process that end with it on their own (torch's shared-memory manager,
#: multiprocessing's resource tracker and fork server): not a test's leftovers.
_INFRASTRUCTURE = (
    b"torch_shm_manager",
    b"multiprocessing.resource_tracker",
    b"multiprocessing.forkserver",
)


def _children() -> set[int]:
    """This process's live child processes (every thread's), from /proc, its helpers left out."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:  # the thread ended meanwhile
            continue
    return {pid for pid in pids if not any(name in _cmdline(pid) for name in _INFRASTRUCTURE)}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture(autouse=True, scope="session")
def reap_children() -> Iterator[None]:
    """At the end of the session, kill any child a test left running (a node, a DHT, a
    sidecar), so a failed test never leaves processes behind on the machine."""
    before = _children()
    yield
    for pid in _children() - before:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            continue


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The demo corpus's cache (set-up prepared it: nothing downloads here)."""
    folder = home() / "cache"
    load_demo(folder, vocab_size=2048, prepare=False)
    return folder
