"""What keeps hivemind's DHT processes from hanging on a lock or outliving their node.

hivemind's process-wide locks are multiprocessing semaphores made at import and shared by every
process forked after: a process killed while it holds one leaves it held for every sibling.
Here each forked process gets its own (:func:`own_locks`), and the replies to one node take a
:class:`ReplyLock` that the kernel releases with its holder. A DHT process also watches its
node and ends itself when the node is gone (:func:`exit_with`), even after ``kill -9``.
"""

from __future__ import annotations

import fcntl
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

from hivemind.utils.mpfuture import MPFuture, SharedBytes


def own_locks() -> None:
    """Give this process hivemind's process-wide locks of its own (run in every child forked
    from a process that imported this module).

    hivemind makes them at import, as multiprocessing semaphores, and so every process forked
    after shares them. They guard only each process's own state (its shared bytes, its reply
    backend; the replies to a node take a :class:`ReplyLock`), but a process killed while it
    holds one (SIGKILL, while it allocates shared bytes for a DHT call's future) leaves it held
    for good, for all its siblings: every node forked later from the same zygote or fork server
    hung at its DHT's first future, right after logging its peer id (the lone node's start stall
    CI saw for 180 s, and a whole simulation's bootstrap in a namespace). A thread lock each."""
    MPFuture._update_lock = threading.Lock()
    MPFuture._initialization_lock = threading.Lock()
    SharedBytes._lock = threading.Lock()


os.register_at_fork(after_in_child=own_locks)


class ReplyLock:
    """A lock between the DHT processes that reply to one node, released by the kernel if its
    holder dies: a POSIX record lock (``lockf``) on a nameless file the node holds open, taken
    by one thread of a process at a time. It travels by path (``/proc/<node>/fd/<n>``), so the
    fork server's children share it too, and nothing is left on disk."""

    _mine: ClassVar[tuple[int, ReplyLock] | None] = None
    _making: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._threads = threading.Lock()

    @classmethod
    def of_this_process(cls) -> ReplyLock:
        """This process's lock for the replies to it, made on first use (one, whichever
        thread starts a DHT first)."""
        with cls._making:
            if cls._mine is None or cls._mine[0] != os.getpid():
                fd, path = tempfile.mkstemp(prefix="swarmgrad-dht-replies-")
                os.unlink(path)  # only the open file is needed, and it goes with this process
                cls._mine = os.getpid(), cls(f"/proc/{os.getpid()}/fd/{fd}")
            return cls._mine[1]

    def __reduce__(self) -> tuple[type[ReplyLock], tuple[str]]:
        return ReplyLock, (self.path,)

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR)
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            assert self._fd is not None
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()


def started_at(pid: int) -> str | None:
    """When process ``pid`` started (its /proc start time), or None if it is gone or a zombie:
    with the pid, an identity that a recycled pid does not share."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def exit_with(owner: int, owner_started_at: str | None) -> None:
    """End this process once process ``owner`` (which started at ``owner_started_at``) is
    gone. Not the parent pid: a fork server's child outlives its requester with that parent."""
    while started_at(owner) == owner_started_at:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
