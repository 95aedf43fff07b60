"""A process killed while it holds one of hivemind's process-wide locks must not stall the
processes forked after it from the same parent (a simulation's zygote, multiprocessing's fork
server): each forked process has locks of its own (``hivemind_process.own_locks``).

hivemind makes them at import as multiprocessing semaphores, which every process forked later
shares. A node killed (SIGKILL) while it allocated shared bytes for a DHT call's future left
``SharedBytes._lock`` held for good, and every node forked after it hung at its DHT's first
future, right after logging its peer id: the lone node's start stall CI saw (nothing logged for
180 s), and a simulation's bootstrap that never came up. The scenario runs in a child of its own
("the zygote" below), so that nothing it does can reach the test process's own locks."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

from hivemind.utils.mpfuture import MPFuture, SharedBytes

import swarmgrad.node.discovery.hivemind_dht  # noqa: F401  (what every node process imports)

#: How long a forked process may take to make a future (well under a second when it works).
FUTURE_SECONDS = 10.0


def _forked(action: Callable[[], int], deadline_seconds: float) -> int:
    """Run ``action`` in a forked child; its exit code (negative: the signal that killed it).
    Killed, and 99 returned, if it is still running after ``deadline_seconds``."""
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it leaves through os._exit
        code = 98
        try:
            code = action()
        finally:
            os._exit(code)
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return 99


def _die_holding_the_locks() -> int:
    SharedBytes._lock.acquire()
    MPFuture._initialization_lock.acquire()
    MPFuture._update_lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)
    return 1  # not reached


def _make_a_future() -> int:
    """What a node's DHT start does first (``hivemind.DHT.__init__``): 0 once it has a future,
    3 if that did not happen in time (it waits on a lock its dead sibling held)."""
    made = threading.Event()

    def make() -> None:
        MPFuture()
        made.set()

    threading.Thread(target=make, daemon=True).start()
    return 0 if made.wait(FUTURE_SECONDS) else 3


def _zygote() -> int:
    """Fork a node that dies holding hivemind's locks, then one that starts after it."""
    # The locks as an import of hivemind here makes them (this process's, not the test's).
    MPFuture._update_lock = multiprocessing.Lock()
    MPFuture._initialization_lock = multiprocessing.Lock()
    SharedBytes._lock = multiprocessing.Lock()
    if _forked(_die_holding_the_locks, 30) != -signal.SIGKILL:
        return 10
    return _forked(_make_a_future, FUTURE_SECONDS + 30)


def test_a_process_killed_holding_hivemind_s_locks_does_not_stall_its_siblings() -> None:
    assert _forked(_zygote, FUTURE_SECONDS + 60) == 0
