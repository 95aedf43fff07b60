"""The node's event loop, and the background tasks a component owns.

:func:`run` is the one ``asyncio.run`` of a node process (the daemon, and each CLI command that
talks to the network): the first SIGINT/SIGTERM sets the ``stop`` event it hands to its coroutine,
a second exits at once. A component's short-lived children (a stream's splice, a withdrawal
that outlives its round, a relay's sessions) go into its ``TaskSet``; its ``close`` leaves
nothing running. A child that failed (not cancelled) is logged when the set closes, never
silently dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` as a task this set owns (forgotten once it is done)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel every task still running and wait for all of them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task, result in zip(
            tasks, await asyncio.gather(*tasks, return_exceptions=True), strict=True
        ):
            if isinstance(result, Exception):
                log.warning("task %s failed: %r", task.get_name(), result)


def run(main: Callable[[asyncio.Event], Coroutine[Any, Any, T]]) -> T:
    """Run ``main(stop)`` on a fresh loop; ``stop`` is set by the first SIGINT/SIGTERM."""

    async def guarded() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():  # second signal: no more waiting, and no orphans left behind
                for child in multiprocessing.active_children():  # the DHT's process
                    child.kill()
                os._exit(130)
            log.warning("stopping: leaving the swarm (signal again to exit at once)")
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal)
        return await main(stop)

    return asyncio.run(guarded())


class LoopBridge:
    """How threads (a trainer running off the loop) reach a node's event loop: run a coroutine
    there and wait for it, or schedule a callback; all waiters are let go when the node stops."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closing = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called (the node stopped)."""
        return self._closing

    def soon(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` on the loop soon (nothing if it is not running yet)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(callback)

    def release(self) -> None:
        """Cancel every wait in :meth:`call`, and refuse new ones."""
        self._closing = True
        for future in list(self._pending):
            future.cancel()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and wait for its result (from another thread).

        Raises ``concurrent.futures.CancelledError`` once released.
        """
        loop = self._loop
        if loop is not None and _running_loop() is loop:
            coroutine.close()
            # It would wait for the loop it blocks: a silent deadlock.
            raise RuntimeError(
                "a swarm's blocking calls (step, round, catch_up) run off its event loop: call "
                "them from a thread (asyncio.to_thread), not from a coroutine on that loop"
            )
        return self.submit(coroutine).result()  # CancelledError once released

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on the loop; its future (cancelled once released)."""
        if self._loop is None or self._closing:
            coroutine.close()
            if self._loop is None:
                raise RuntimeError("the swarm is not running")
            raise concurrent.futures.CancelledError("the swarm is stopping or closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # this thread runs no loop
        return None


class Stopped(Exception):
    """Work that :func:`unless_stopped` cut short: a signal came first."""


async def unless_stopped(stop: asyncio.Event, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or :class:`Stopped` (``work`` cancelled) if ``stop`` is set first: a
    command that only reads (``status``, ``runs``) ends at the first Ctrl-C."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise Stopped()
