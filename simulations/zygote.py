"""A warm parent for a local simulation's node processes: it imports the node's code once (torch,
hivemind, gRPC: ~2.5 CPU-seconds a process), then forks a fresh process for each node.

Each node is still a real process of its own (its own pid, session, sockets and memory, killed
by a signal like any other); it only skips the imports, a third of a 4-node swarm's start-up on
two cores. The zygote is the same idea as multiprocessing's fork server (which the node already
uses for hivemind's DHT process), with what a node launcher needs on top: a log file as the
child's stdout and stderr, its environment, and its exit status told back.

Protocol, one JSON object a line: the launcher writes ``{"name": ..., "netns": ...,
"cgroup": ..., "module": ..., "argv": [...], "log_path": ..., "env": {...}, "cwd": ...}``;
the zygote answers ``{"pid": N}`` (or ``{"error": ...}``) in order, and
``{"exited": N, "status": S}`` (a returncode, negative for a signal, as subprocess gives it)
when child N ends. At end of input it kills its children and exits; its children die with it
(``PR_SET_PDEATHSIG``), so none outlives a crashed launcher.

Nothing here may start a thread or touch torch's thread pools before the fork.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What the zygote imports before it forks anything: the node's whole import graph.
PRELOAD = (
    "torch",
    "torch._dynamo",  # an optimizer's first use imports it (~0.5 s)
    "swarmgrad.node.cli",
    "swarmgrad.node.main",
    "swarmgrad.node.discovery.hivemind_dht",
)
#: How long the zygote may take to import (its first request) or to fork a child.
ZYGOTE_START_TIMEOUT_SECONDS = 60.0
_PR_SET_PDEATHSIG, _PR_SET_NAME, _CLONE_NEWNET = 1, 15, 0x40000000


def _child(request: dict[str, Any], zygote_pid: int) -> int:
    """In the forked child: become the process described by ``request``; its exit status."""
    os.setsid()  # its own session, as start_new_session gives: a group to kill at once
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:  # the zygote died before that took hold
        return 1
    # Its command line stays the zygote's; its name (ps -o comm, top) says which process it is.
    libc.prctl(_PR_SET_NAME, request["name"].encode()[:15])
    # Signals as a fresh interpreter has them (SIGPIPE stays ignored, as Python sets it): only
    # the zygote's own SIGCHLD handler goes.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["argv"]]
    try:
        os.chdir(request["cwd"])
        if request.get("cgroup"):  # its CPU share, before it starts anything
            from swarmgrad.simulations.cpushare import join

            join(request["cgroup"])
        if request["netns"]:  # what ``ip netns exec`` does for the network (all a node needs)
            _enter_network_namespace(libc, request["netns"])
        # What ``python -m module`` runs: the module's ``main()``, whose int return is the exit
        # status (the ``sys.exit(main())`` idiom).
        status = importlib.import_module(request["module"]).main()
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:  # the child's own top level: report it as python would, then exit 1
        traceback.print_exc()
        return 1
    return status if isinstance(status, int) else 0


def _enter_network_namespace(libc: ctypes.CDLL, name: str) -> None:
    namespace = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(namespace, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {name}")
    finally:
        os.close(namespace)


def _status(wait_status: int) -> int:
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def serve() -> None:
    """Read requests from stdin until it closes, fork one child for each, report exits."""
    for name in PRELOAD:
        importlib.import_module(name)
    zygote_pid = os.getpid()
    out = sys.stdout
    children: set[int] = set()
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, "request")
    selector.register(wakeup_r, selectors.EVENT_READ, "child")
    pending = b""

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    def reap() -> None:
        while children:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                return
            children.discard(pid)
            say({"exited": pid, "status": _status(wait_status)})

    def start(request: dict[str, Any]) -> None:
        try:
            pid = os.fork()
        except OSError as error:  # out of processes or memory: that request fails, not the rest
            say({"error": f"fork: {error}"})
            return
        if pid == 0:
            code = 1
            try:
                selector.close()
                os.close(wakeup_r)
                os.close(wakeup_w)
                signal.set_wakeup_fd(-1)
                code = _child(request, zygote_pid)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        children.add(pid)
        say({"pid": pid})

    try:
        while True:
            for key, _ in selector.select():
                if key.data == "child":
                    os.read(wakeup_r, 4096)
                    continue
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    start(json.loads(line))
            reap()
    finally:
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue


class Zygote:
    """The launcher's side: one zygote process, started on first use, that forks node
    processes on request (``spawn``) and tells when each exits."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C reaches the launcher, which stops the nodes
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._started: queue.Queue[dict[str, Any]] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            if "exited" in message:
                with self._changed:
                    self._exits[message["exited"]] = message["status"]
                    self._changed.notify_all()
            else:
                self._started.put(message)
        # Gone (killed, or closed): so are its children, each killed as it died (PDEATHSIG).
        with self._changed:
            self._gone = True
            self._changed.notify_all()
        self._started.put({"error": f"the zygote exited ({self._process.wait()})"})

    def spawn(
        self,
        name: str,
        module: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str],
        *,
        netns: str | None = None,
        cgroup: str | None = None,
    ) -> Forked:
        """Fork ``python -m module argv...`` (``name``: what ps and top call it) with ``env``,
        its output appended to ``log_path``, in network namespace ``netns`` if given, in the
        cgroup whose ``cgroup.procs`` file is ``cgroup`` if given."""
        request = {
            "name": name,
            "netns": netns,
            "cgroup": cgroup,
            "module": module,
            "argv": argv,
            "log_path": str(log_path),
            "env": env,
            "cwd": os.getcwd(),
        }
        with self._lock:
            stdin = self._process.stdin
            assert stdin is not None
            stdin.write(json.dumps(request).encode() + b"\n")
            stdin.flush()
            answer = self._started.get(timeout=ZYGOTE_START_TIMEOUT_SECONDS)
        if "pid" not in answer:
            raise RuntimeError(answer.get("error", answer))
        return Forked(answer["pid"], self)

    def wait(self, pid: int, timeout_seconds: float | None) -> int | None:
        """Child ``pid``'s status once it has exited (None if it has not, by the timeout)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._gone, timeout_seconds)
            if pid not in self._exits and self._gone:
                return -signal.SIGKILL
            return self._exits.get(pid)

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(ZYGOTE_START_TIMEOUT_SECONDS)


@dataclass(frozen=True, slots=True)
class Forked:
    """A process the zygote forked: what ``subprocess.Popen`` offers a launcher."""

    pid: int
    zygote: Zygote

    def poll(self) -> int | None:
        return self.zygote.wait(self.pid, 0)

    def wait(self, timeout: float | None = None) -> int:
        status = self.zygote.wait(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        return status

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def module_of(command: list[str]) -> str | None:
    """The module of a ``python -m module ...`` command with this interpreter (what the zygote
    can fork), else None."""
    return command[2] if command[:2] == [sys.executable, "-m"] and len(command) > 2 else None


def fork(
    name: str,
    command: list[str],
    log_path: Path,
    env: dict[str, str],
    *,
    netns: str | None = None,
    cgroup: str | None = None,
) -> Forked:
    """``command`` (``python -m module ...``, see :func:`module_of`) forked by this process's
    zygote: what ``Zygote.spawn`` does, from a command line."""
    module = module_of(command)
    if module is None:
        raise ValueError(f"not a python -m command: {command}")
    return zygote().spawn(name, module, command[3:], log_path, env, netns=netns, cgroup=cgroup)


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use and closed at exit."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote


if __name__ == "__main__":
    serve()
