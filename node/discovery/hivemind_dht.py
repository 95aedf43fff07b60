"""Discovery over ``hivemind.DHT``: Kademlia on the go-libp2p daemon that hivemind's wheel ships.

hivemind's dictionary values (a subkey per peer, the latest expiry winning) are what
:class:`~.base.SignedDirectory` needs. The DHT runs in hivemind's own process; every call here is
awaited with a deadline. Its nodes run :class:`SealedValues`: they store, and believe from other
nodes, only swarmgrad's sealed values filed where their seal says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hivemind
import hivemind.dht.node
import hivemind.dht.protocol
from hivemind.utils.mpfuture import MPFuture

from swarmgrad.node.discovery.base import DiscoveryError, SignedDirectory
from swarmgrad.node.discovery.diagnose import explain
from swarmgrad.node.discovery.hivemind_process import ReplyLock, exit_with, started_at
from swarmgrad.node.discovery.hivemind_storage import BoundedStorage, SealedValues, StorerProtocol
from swarmgrad.node.discovery.p2p_key import p2p_key_file
from swarmgrad.node.identity import Identity

if TYPE_CHECKING:
    from swarmgrad.node.discovery.start import DiscoveryConfig
from swarmgrad.protocol.errors import BindError
from swarmgrad.protocol.server import grpc_started

log = logging.getLogger(__name__)


class _DHT(hivemind.DHT):  # type: ignore[misc]
    """hivemind's DHT process, made to die with the node that started it, and started from a
    clean process when forking this one is not safe.

    A node killed with SIGKILL (the OOM killer, ``kill -9``) runs no cleanup, and hivemind's
    child would live on as an orphan, holding its port (its p2pd daemon exits with it).

    hivemind forks. A fork taken while gRPC's core threads run (a second ``Swarm`` in one
    process, a test process) can leave the child spinning on a lock it inherited held; such
    children come from multiprocessing's fork server instead, a process started clean (exec)
    that forks them on request. The fork server exits with this process, and its children with it.

    hivemind serializes the replies that its DHT processes write into the pipe back to their
    node (``MPFuture._update_lock``) with a semaphore made once, at import, and shared by every
    process forked after it. A DHT process killed while it holds it (stopped with SIGKILL or
    SIGTERM mid-reply) leaves it held for good: every later DHT process forked from the same
    parent hangs at its first reply, before it can even say it is ready (seen: a test process's
    fork server, after ~30 DHTs killed mid-call). Here the replies to one node take a
    :class:`ReplyLock` instead, which the kernel releases when its holder dies (and every
    forked process has hivemind's other locks to itself: :func:`~.hivemind_process.own_locks`).
    """

    def __init__(self, *args: Any, from_clean_process: bool, **kwargs: Any) -> None:
        self.from_clean_process = from_clean_process
        self._owner = os.getpid(), started_at(os.getpid())
        self._reply_lock = ReplyLock.of_this_process()
        super().__init__(*args, **kwargs)

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        if process_obj.from_clean_process:
            return _fork_server().Process._Popen(process_obj)
        return hivemind.DHT._Popen(process_obj)

    def run(self) -> None:
        self._prepare()
        super().run()

    def _prepare(self) -> None:
        """In the DHT's process, before hivemind runs."""
        threading.Thread(target=exit_with, args=self._owner, daemon=True).start()
        # A terminal's Ctrl-C reaches its whole group, but the node leaves the swarm through
        # this DHT before it shuts it down: this process and its p2pd (which un-ignores SIGINT,
        # as Go does for a signal it asks for) leave the group. SIGTERM must end it: hivemind's
        # last resort when a shutdown hangs (asyncio's handler, inherited, would swallow it).
        with contextlib.suppress(PermissionError):  # already a group leader: nothing to leave
            os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # hivemind builds a node's storage and cache from this name (DHTProtocol.create), and
        # its protocol from that one (DHTNode.create), with no way to pass others: in this
        # process, they are bounded ones, and stores are checked within the storer's budget.
        hivemind.dht.protocol.DHTLocalStorage = BoundedStorage
        hivemind.dht.node.DHTProtocol = StorerProtocol
        # Before anything takes it (the fork gave this process locks of its own for the rest:
        # own_locks).
        MPFuture._update_lock = self._reply_lock


def _fork_server() -> Any:
    context = multiprocessing.get_context("forkserver")
    # What the fork server imports once, so that each child it forks starts in ~0.3 s; never
    # "__main__" (the default), which would run the user's script again.
    context.set_forkserver_preload([__name__])
    return context


#: Tries at joining through the bootstrap peers before a start gives up: on a loaded machine the
#: daemon's first connect to a busy bootstrap can fail; a wrong address fails every try (~1 s each).
JOIN_ATTEMPTS = 3
JOIN_RETRY_SECONDS = 1.0


async def start_dht(
    initial_peers: Sequence[str],
    *,
    host: str,
    port: int,
    start_timeout_seconds: float,
    identity: Identity | None = None,
) -> Any:
    """A running ``hivemind.DHT`` (its own process), joined through ``initial_peers`` if any;
    with ``identity``, its libp2p peer id is that identity's (the same at every start, and the
    one the libp2p backend gives it), else a new one.

    A DHT that is not up within the deadline is killed: no process or thread is left waiting.
    A failed join through bootstrap peers is tried again (``JOIN_ATTEMPTS`` in all) while the
    deadline allows.
    """
    deadline = time.monotonic() + start_timeout_seconds
    peers = ", ".join(initial_peers) or "none"
    attempt = 1
    while True:
        try:
            with p2p_key_file(identity) as key_path:
                return await _start_dht_once(
                    initial_peers,
                    host=host,
                    port=port,
                    timeout_seconds=deadline - time.monotonic(),
                    key_path=key_path,
                )
        except TimeoutError:
            raise DiscoveryError(f"the DHT did not start in {start_timeout_seconds:g} s") from None
        except _JoinFailed as failed:
            if "address already in use" in str(failed.error).lower():  # exit 2, not 4
                raise BindError(
                    f"the DHT cannot listen on {host}:{port}: the port is in use"
                ) from failed.error
            pause_seconds = JOIN_RETRY_SECONDS * attempt
            if (
                not initial_peers
                or attempt == JOIN_ATTEMPTS
                or time.monotonic() + pause_seconds >= deadline
            ):
                tries = f" ({attempt} tries)" if attempt > 1 else ""
                found = await asyncio.to_thread(explain, initial_peers) if initial_peers else ""
                raise DiscoveryError(
                    f"could not join the DHT (bootstrap: {peers}){tries}: {failed.error}"
                    + (f". {found}" if found else "")
                ) from failed.error
            log.warning("could not join the DHT (%s); trying again", failed.error)
            await asyncio.sleep(pause_seconds)
            attempt += 1


async def _start_dht_once(
    initial_peers: Sequence[str],
    *,
    host: str,
    port: int,
    timeout_seconds: float,
    key_path: Path | None,
) -> Any:
    """One try; TimeoutError if not up within ``timeout_seconds``, _JoinFailed if hivemind
    raised (the DHT's process killed either way)."""
    # hivemind's check that a key is not in use elsewhere reads RSA keys only: the key is the
    # identity's own, and a second process holding it is the operator's mistake to make.
    key = {"identity_path": str(key_path), "check_if_identity_free": False} if key_path else {}
    dht = _DHT(
        initial_peers=list(initial_peers),
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        start=False,
        record_validators=[SealedValues()],
        from_clean_process=grpc_started(),
        **key,
    )

    def start() -> None:
        dht.run_in_background(await_ready=False)
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                dht.wait_until_ready(timeout=min(0.5, timeout_seconds))
                return
            except TimeoutError:
                if not dht.is_alive():
                    raise _ExitedEarly(dht.exitcode) from None
                if time.monotonic() > deadline:
                    raise

    try:
        await asyncio.to_thread(start)
    except TimeoutError:
        _kill(dht)
        raise
    except _ExitedEarly as exited:
        hint = (
            " (it was started from multiprocessing's fork server, which imports the main script"
            " again: a script that starts a second Swarm needs `if __name__ == '__main__':`)"
            if dht.from_clean_process
            else ""
        )
        raise DiscoveryError(
            f"the DHT process exited before it was ready (exit code {exited.exitcode}){hint}"
        ) from None
    except Exception as error:  # hivemind raises plain exceptions from its daemon
        _kill(dht)
        raise _JoinFailed(error) from error
    except BaseException:  # cancelled while it starts: the thread gives up within the deadline
        _kill(dht)
        raise
    return dht


class _JoinFailed(Exception):
    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class _ExitedEarly(Exception):
    def __init__(self, exitcode: int | None) -> None:
        super().__init__(exitcode)
        self.exitcode = exitcode


def _kill(dht: Any) -> None:
    if dht.is_alive():
        dht.kill()
        dht.join(5.0)


class HivemindDiscovery(SignedDirectory):
    """The discovery interface on ``hivemind.DHT`` (its own process)."""

    def __init__(
        self,
        dht: Any,
        identity: Identity,
        *,
        run_id: str,
        spec_hash: bytes,
        call_timeout_seconds: float = 10.0,
    ) -> None:
        super().__init__(
            identity, run_id=run_id, spec_hash=spec_hash, call_timeout_seconds=call_timeout_seconds
        )
        self._dht = dht

    @classmethod
    async def start(
        cls, identity: Identity, config: DiscoveryConfig, *, run_id: str, spec_hash: bytes
    ) -> HivemindDiscovery:
        """Start a DHT node (its own process) and join through the config's initial peers."""
        dht = await start_dht(
            config.initial_peers,
            host=config.host,
            port=config.port,
            start_timeout_seconds=config.start_timeout_seconds,
            identity=identity if config.keep_peer_id else None,
        )
        return cls(
            dht,
            identity,
            run_id=run_id,
            spec_hash=spec_hash,
            call_timeout_seconds=config.call_timeout_seconds,
        )

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs other nodes can bootstrap from."""
        return [str(a) for a in self._dht.get_visible_maddrs()]

    async def _store(self, key: str, subkey: str, value: bytes, expires: float) -> bool:
        return bool(
            await self._call(
                self._dht.store(
                    key, value, expiration_time=expires, subkey=subkey, return_future=True
                )
            )
        )

    async def _get(self, key: str) -> dict[str, tuple[bytes | None, float]]:
        found = await self._call(self._dht.get(key, latest=True, return_future=True))
        entries = found.value if found is not None else {}
        if not isinstance(entries, dict):  # a plain value where a dictionary belongs
            self.rejected["malformed key"] += 1
            return {}
        values: dict[str, tuple[bytes | None, float]] = {}
        for subkey, item in entries.items():
            data = getattr(item, "value", None)
            expires = float(getattr(item, "expiration_time", 0.0))
            values[str(subkey)] = (data if isinstance(data, bytes) else None, expires)
        return values

    async def close(self) -> None:
        await asyncio.to_thread(self._dht.shutdown)

    async def _call(self, future: Any) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                return await future
        except TimeoutError:
            future.cancel()
            raise DiscoveryError(f"DHT call timed out after {self._timeout:g} s") from None
