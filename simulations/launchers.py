"""Where a simulation's processes run: here (``local``: child processes), or on a Ray cluster
(``ray``: each process started and watched by a Ray actor, so a swarm spreads over machines).

Both give the swarm loop (``swarm.py``) the same handle: ``poll``, ``signal``, ``stop``,
``kill`` and ``tail``. A process's command line, environment and outputs are the same either way:
the node writes its log, status file and checkpoints under the simulation's output folder, so on
a cluster that folder must be on storage every machine sees (a shared filesystem), and every
machine must have the project installed at the same path (one image). A local Ray head (no
``--ray-address``) shares this machine's. Ray is imported only for ``--launcher ray``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from swarmgrad.simulations.cpushare import join as join_cgroup
from swarmgrad.simulations.natlab import Host
from swarmgrad.simulations.processes import Child, stop_gracefully
from swarmgrad.simulations.profiles import SimulationError
from swarmgrad.simulations.zygote import fork, module_of

LAUNCHERS = ("local", "ray")
#: How long a Ray call to a process's actor may take (they answer at once; the cluster may not).
RAY_CALL_SECONDS = 30.0
#: How many times a local Ray head is started before ``simulate`` gives up.
LOCAL_HEAD_STARTS = 3
#: How long a local head's GCS may take to write its port before the start is tried again
#: (Ray's own default: 30 s). A healthy one takes 1-2 s on a loaded 2-core machine; the starts CI
#: saw fail never brought their GCS (or raylet) up at all, and Ray waited out its whole deadline.
LOCAL_GCS_WAIT_SECONDS = 10
GCS_WAIT_VARIABLE = "RAY_gcs_server_port_wait_time_s"

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    """What :func:`stop_all` needs: a launcher's process, or a NAT lab's node."""

    def stop(self, timeout_seconds: float = 15.0) -> None: ...


class Process(Stoppable, Protocol):
    name: str
    log_path: Path

    def poll(self) -> int | None: ...

    def signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def tail(self, lines: int = 15) -> str: ...


def stop_all(processes: Sequence[Stoppable], timeout_seconds: float = 15.0) -> None:
    """Stop every one of ``processes`` at once (each leaves gracefully, or is killed after
    ``timeout_seconds``): a swarm's nodes leave in the time of the slowest, not of their sum."""
    if processes:
        with ThreadPoolExecutor(len(processes), thread_name_prefix="stop") as pool:
            for _ in pool.map(lambda process: process.stop(timeout_seconds), processes):
                pass


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class LocalProcess:
    """A process on this machine, its output appended to ``log_path``."""

    def __init__(
        self,
        name: str,
        command: list[str],
        log_path: Path,
        env: dict[str, str],
        host: Host | None = None,
        *,
        warm: bool = False,
        cgroup: str | None = None,
    ) -> None:
        """``host``: run in that network namespace (``--netem``); ``ip netns exec`` execs the
        command, so the process is the node itself (a kill reaches it). ``warm``: a command
        ``python -m module ...`` is forked by this process's zygote instead (in ``host``'s
        namespace), which has the node's modules imported already (a swarm starts many; a
        single process would only pay for the zygote's start). ``cgroup``: the process joins
        that cgroup (its ``cgroup.procs`` file: a CPU share, ``cpushare.py``) before it runs."""
        self.name, self.log_path = name, log_path
        self.popen: Child
        if warm and module_of(command) is not None:
            netns = host.namespace if host is not None else None
            self.popen = fork(name, command, log_path, env, netns=netns, cgroup=cgroup)
            return
        if host is not None:
            command = ["ip", "netns", "exec", host.namespace, *command]
        with log_path.open("ab") as log:  # a restarted node's log goes on in the same file
            self.popen = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=None if cgroup is None else partial(join_cgroup, cgroup),
            )

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self, timeout_seconds: float = 15.0) -> None:
        stop_gracefully(self.popen, timeout_seconds)

    def kill(self) -> None:
        """SIGKILL the node alone: what a crash does (its DHT process notices and exits)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def tail(self, lines: int = 15) -> str:
        return _tail(self.log_path, lines)


class _ProcessActor:
    """Runs on a Ray worker: one process, started and watched where the actor lives."""

    def __init__(self) -> None:
        self._process: LocalProcess | None = None

    def start(self, name: str, command: list[str], log_path: str, env: dict[str, str]) -> str:
        import socket

        self._process = LocalProcess(name, command, Path(log_path), env)
        return socket.gethostname()

    def poll(self) -> int | None:
        assert self._process is not None
        return self._process.poll()

    def signal(self, sig: int) -> None:
        assert self._process is not None
        self._process.signal(sig)

    def stop(self, timeout_seconds: float) -> None:
        assert self._process is not None
        self._process.stop(timeout_seconds)

    def kill(self) -> None:
        assert self._process is not None
        self._process.kill()


class RayProcess:
    """A process run by a Ray actor (no CPUs reserved: the node uses what it needs)."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict[str, str]):
        import ray

        self._ray: Any = ray
        self.name, self.log_path = name, log_path
        actor: Any = ray.remote(num_cpus=0, max_restarts=0)(_ProcessActor)
        self._actor: Any = actor.options(scheduling_strategy="SPREAD").remote()
        self.machine = self._get(self._actor.start.remote(name, command, str(log_path), env))

    def _get(self, ref: Any) -> Any:
        try:
            return self._ray.get(ref, timeout=RAY_CALL_SECONDS)
        except self._ray.exceptions.GetTimeoutError:
            raise SimulationError(
                f"{self.name}: its Ray actor did not answer in {RAY_CALL_SECONDS:g} s"
            ) from None
        except self._ray.exceptions.RayActorError as error:
            raise SimulationError(f"{self.name}: its Ray actor died: {error}") from None

    def poll(self) -> int | None:
        code: int | None = self._get(self._actor.poll.remote())
        return code

    def signal(self, sig: int) -> None:
        self._get(self._actor.signal.remote(sig))

    def stop(self, timeout_seconds: float = 15.0) -> None:
        with contextlib.suppress(SimulationError):  # stopping: a dead actor's process is gone
            self._get(self._actor.stop.remote(timeout_seconds))
        self._ray.kill(self._actor)

    def kill(self) -> None:
        with contextlib.suppress(SimulationError):
            self._get(self._actor.kill.remote())
        self._ray.kill(self._actor)

    def tail(self, lines: int = 15) -> str:
        return _tail(self.log_path, lines)


@contextlib.contextmanager
def ray_cluster(address: str) -> Iterator[None]:
    """Connected to the Ray cluster at ``address`` ("": a local head, started and stopped
    here, never a cluster named by ``RAY_ADDRESS`` or left by a ``ray start``) for the
    duration."""
    try:
        import ray
    except ImportError as error:
        raise SimulationError(
            f'--launcher ray needs Ray ({error}); pip install "swarmgrad[ray]"'
        ) from None
    # A local head's GCS and raylet must come up within Ray's fixed deadlines; on a loaded
    # machine they sometimes do not (a bare Exception, "timed out during startup"; or, from the
    # GCS, "Timed out waiting for file .../gcs_server_port_..."), and a fresh start then does.
    # Any failed start of our own head is tried again. A cluster that was named and cannot be
    # joined is an answer, not a race: it is not retried.
    attempts = 1 if address else LOCAL_HEAD_STARTS
    for attempt in range(1, attempts + 1):
        before = _descendants()
        try:
            with contextlib.nullcontext() if address else _gcs_wait(LOCAL_GCS_WAIT_SECONDS):
                ray.init(
                    address=address or "local",  # never a cluster the environment names
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
            break
        except Exception as error:
            if address and isinstance(error, (ConnectionError, RuntimeError, ValueError)):
                raise SimulationError(
                    f"--ray-address {address}: cannot join the cluster: {error}"
                ) from None
            ray.shutdown()
            _kill_started_since(before)  # the half-started head's GCS, raylet and monitors
            if attempt == attempts:
                where = f"the cluster at {address}" if address else "a local Ray head"
                raise SimulationError(f"cannot start {where} ({attempt} tries): {error}") from None
            log.warning("a local Ray head did not start (try %d of %d): %s", attempt, attempts,
                        error)  # fmt: skip
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _gcs_wait(seconds: int) -> Iterator[None]:
    """Ray's wait for a GCS it starts set to ``seconds`` for the duration, unless the
    environment already sets it."""
    if GCS_WAIT_VARIABLE in os.environ:
        yield
        return
    os.environ[GCS_WAIT_VARIABLE] = str(seconds)
    try:
        yield
    finally:
        os.environ.pop(GCS_WAIT_VARIABLE, None)


def _descendants() -> set[int]:
    import psutil  # Ray's own dependency

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _kill_started_since(before: set[int]) -> None:
    """Kill what this process started after ``before`` was taken: what a failed ``ray.init``
    left behind. Ray keeps no handle to them, but the ``Popen`` objects of the half-built head
    still live (the error's traceback holds them): those children are reaped through their own
    ``Popen``, so each learns its exit status. Reaped behind its back, a ``Popen`` warns when it
    is collected that its process is still running (pytest turns that into a failure)."""
    import psutil

    started = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    for child in started:
        with contextlib.suppress(psutil.Error):
            child.kill()
    pids = {child.pid for child in started}
    # type(), not isinstance(): some objects on the heap answer ``__class__`` with a warning.
    popens = (o for o in gc.get_objects() if issubclass(type(o), subprocess.Popen))
    owned = [p for p in popens if p.pid in pids]
    for popen in owned:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=10)
    reaped = {popen.pid for popen in owned}
    psutil.wait_procs([c for c in started if c.pid not in reaped], timeout=10)
