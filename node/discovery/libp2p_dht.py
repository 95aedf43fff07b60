"""Discovery over py-libp2p's Kademlia DHT, for platforms hivemind's daemon does not cover.

libp2p and hivemind cannot share a process (both register protobuf's ``crypto.pb.KeyType``), and
py-libp2p runs on trio: the DHT lives in a sidecar process (:mod:`.libp2p_sidecar`) that this
module starts, talks to over a socket pair (one JSON object per line) and supervises. This
module never imports libp2p.

Keys and values are the hivemind backend's: ``run/<run id>/<spec hash>/<topic>``, one subkey per
peer id, the latest expiry winning per subkey; readers verify every record. If the sidecar dies,
calls in flight fail with DiscoveryError, and it is started again (same key, same port when free),
joining through the bootstrap peers and the peers it knew last, tried again until it is up, and
this node's unexpired announcements are stored again: peers see at most a short gap. A line from
the sidecar too long to read (or a reader that fails otherwise) ends the sidecar too, so that it
is restarted rather than left answering nobody.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import logging
import socket
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from swarmgrad.node.discovery.base import DiscoveryError, SignedDirectory
from swarmgrad.node.discovery.diagnose import explain
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.errors import BindError

if TYPE_CHECKING:
    from swarmgrad.node.discovery.start import DiscoveryConfig
from swarmgrad.node.tasks import TaskSet

log = logging.getLogger(__name__)

#: A reply from the sidecar: a get's is one key's entries, kept under ``budget.MAX_BYTES_PER_KEY``
#: (~4/3 as large in base64 and JSON), with room to spare.
MAX_LINE_BYTES = 8 << 20
#: At most this many of the peers the sidecar knows are kept, to join through on a restart.
KNOWN_PEERS = 16
#: Between tries at restarting a dead sidecar; the last is repeated until one succeeds.
RESTART_BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def network_key(secret: str = "") -> str:
    """The libp2p pre-shared key: swarmgrad's public network, or a private run's if ``secret``.
    (The same derivation as the sidecar's; kept here so that this module imports no libp2p.)"""
    return hashlib.sha256(f"swarmgrad/dht/v1\0{secret}".encode()).hexdigest()


class Sidecar:
    """The sidecar process and the socket to it; restarts it if it dies."""

    def __init__(
        self,
        identity: Identity,
        *,
        initial_peers: Sequence[str],
        host: str,
        port: int,
        network_secret: str,
        start_timeout_seconds: float,
    ) -> None:
        self._seed = identity.seed
        self.initial_peers = list(initial_peers)
        #: The peers the sidecar last said it knew: a restart joins through them as well.
        self.known_peers: list[str] = []
        self._host, self._port = host, port
        self._network_key = network_key(network_secret)
        self._start_timeout = start_timeout_seconds
        self._process: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._tasks = TaskSet()
        self._closing = False
        self.maddrs: list[str] = []
        #: This node's announcements, (key, subkey) -> (value, expiry), stored again on restart.
        self.announced: dict[tuple[str, str], tuple[bytes, float]] = {}
        #: Times the sidecar died and was started again.
        self.restarts = 0
        self.restarted = asyncio.Event()

    @property
    def pid(self) -> int | None:
        """The running sidecar's process id."""
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        """Start the sidecar and join through the bootstrap peers (and, on a restart, the
        peers it knew); BindError if it cannot listen, DiscoveryError if it cannot join in time."""
        bootstrap = list(dict.fromkeys([*self.initial_peers, *self.known_peers]))
        ours, theirs = socket.socketpair()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "swarmgrad.node.discovery.libp2p_sidecar",
                "--fd",
                str(theirs.fileno()),
                "--listen",
                self._listen,
                "--log-level",  # the sidecar logs to this process's stderr, at this module's level
                logging.getLevelName(min(log.getEffectiveLevel(), logging.WARNING)),
                "--bootstrap",
                *bootstrap,
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        assert process.stdin is not None
        process.stdin.write(f"{self._seed.hex()}\n{self._network_key}\n".encode())
        process.stdin.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=MAX_LINE_BYTES)
        try:
            async with asyncio.timeout(self._start_timeout):
                line = await reader.readline()
        except TimeoutError:
            await self._kill(process, writer)
            raise DiscoveryError(f"the DHT did not start in {self._start_timeout:g} s") from None
        except BaseException:
            await self._kill(process, writer)
            raise
        ready = json.loads(line) if line else {"event": "failed", "error": "the sidecar exited"}
        if ready.get("event") == "ready" and not ready.get("maddrs"):
            ready = {
                "event": "failed",
                "error": f"no address to listen on ({self._listen})",
                "bind": True,
            }
        if ready.get("event") != "ready":
            await self._kill(process, writer)
            if ready.get("bind"):  # a configuration error (exit 2), not an unreachable swarm
                raise BindError(f"the DHT cannot listen on {self._listen}: {ready['error']}")
            peers = ", ".join(bootstrap) or "none"
            found = await asyncio.to_thread(explain, bootstrap) if bootstrap else ""
            raise DiscoveryError(
                f"could not join the DHT (bootstrap: {peers}): {ready['error']}"
                + (f". {found}" if found else "")
            )
        self._process, self._writer = process, writer
        self.maddrs = [str(m) for m in ready["maddrs"]]
        self._port = int(self.maddrs[0].split("/tcp/")[1].split("/")[0])  # keep it on restart
        self._spawn(self._read(reader, process))
        self._spawn(self._supervise(process))

    @property
    def _listen(self) -> str:
        return f"/ip4/{self._host}/tcp/{self._port}"

    def _spawn(self, coroutine: Any) -> None:
        self._tasks.spawn(coroutine)

    async def _read(
        self, reader: asyncio.StreamReader, process: asyncio.subprocess.Process
    ) -> None:
        """Hand the sidecar's replies to their calls. If it cannot (a line over
        ``MAX_LINE_BYTES``, the stream broken), the sidecar is ended: its supervisor fails the
        calls in flight and starts it again, where a reader gone alone would leave every later
        call to time out."""
        try:
            while line := await reader.readline():
                try:
                    reply = json.loads(line)
                    if reply.get("event") == "peers":  # the peers it knows now, told unasked
                        self.known_peers = [str(p) for p in reply["peers"]][:KNOWN_PEERS]
                        continue
                    future = self._pending.pop(int(reply["id"]))
                except (ValueError, KeyError, TypeError, AttributeError):
                    log.warning("the DHT sidecar said something unexpected: %.200r", line)
                    continue
                if not future.done():
                    future.set_result(reply)
        except (ValueError, OSError) as error:  # LimitOverrunError is a ValueError here
            log.warning("reading the DHT sidecar failed (%s); it is started again", error)
            if process.returncode is None:
                process.kill()

    async def _supervise(self, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(DiscoveryError(f"the DHT sidecar exited ({code})"))
        self._pending.clear()
        if self._closing:
            return
        log.warning("the DHT sidecar exited with %s; starting it again", code)
        last = RESTART_BACKOFF_SECONDS[-1]
        delays = itertools.chain((0.0, *RESTART_BACKOFF_SECONDS), itertools.repeat(last))
        for attempt, delay in enumerate(delays):
            await asyncio.sleep(delay)
            if self._closing:
                return
            try:
                await self.start()
                break
            except Exception as error:  # any failure: discovery stays down, and is tried again
                level = logging.WARNING if attempt < 3 else logging.ERROR
                log.log(level, "restarting the DHT sidecar (try %d) failed: %s", attempt + 1, error)
                if attempt == 1:
                    self._port = 0  # the old port may be taken by now
        self.restarts += 1
        now = time.time()
        for (key, subkey), (value, expires) in list(self.announced.items()):
            if expires > now:
                try:
                    await self.store(key, subkey, value, expires, timeout_seconds=10.0)
                except DiscoveryError as error:
                    log.warning("re-announcing %s after a restart: %s", key, error)
        self.restarted.set()

    async def request(self, op: str, timeout_seconds: float, **fields: Any) -> dict[str, Any]:
        if self._writer is None or self._process is None or self._process.returncode is not None:
            raise DiscoveryError("the DHT sidecar is not running")
        self._next_id += 1
        request_id = self._next_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        message = {"id": request_id, "op": op, **fields}
        self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        try:
            async with asyncio.timeout(timeout_seconds):
                reply = await future
        except TimeoutError:
            raise DiscoveryError(f"DHT call timed out after {timeout_seconds:g} s") from None
        finally:
            self._pending.pop(request_id, None)
        if "error" in reply:
            raise DiscoveryError(f"DHT {op} failed: {reply['error']}")
        return reply

    async def store(
        self, key: str, subkey: str, value: bytes, expires: float, *, timeout_seconds: float
    ) -> int:
        reply = await self.request(
            "store",
            timeout_seconds,
            key=key,
            subkey=subkey,
            value=base64.b64encode(value).decode(),
            expires=expires,
        )
        return int(reply["stored"])

    async def get(
        self, key: str, *, timeout_seconds: float
    ) -> dict[str, tuple[bytes | None, float]]:
        """Unexpired values under ``key`` and their expiry, by subkey (malformed entries are
        skipped)."""
        reply = await self.request("get", timeout_seconds, key=key)
        values: dict[str, tuple[bytes | None, float]] = {}
        for entry in reply.get("entries", []):
            try:
                value = base64.b64decode(entry["value"], validate=True)
                values[str(entry["subkey"])] = (value, float(entry["expires"]))
            except (KeyError, TypeError, ValueError):
                continue
        return values

    async def close(self) -> None:
        self._closing = True
        if self._process is not None:
            await self._kill(self._process, self._writer)
        await self._tasks.close()

    @staticmethod
    async def _kill(
        process: asyncio.subprocess.Process, writer: asyncio.StreamWriter | None
    ) -> None:
        if writer is not None:
            writer.close()  # the sidecar exits when its socket closes
        try:
            async with asyncio.timeout(5.0):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


class Libp2pDiscovery(SignedDirectory):
    """The discovery interface (:class:`~.base.Discovery`) on the py-libp2p sidecar."""

    def __init__(
        self,
        sidecar: Sidecar,
        identity: Identity,
        *,
        run_id: str,
        spec_hash: bytes,
        call_timeout_seconds: float = 10.0,
    ) -> None:
        super().__init__(
            identity, run_id=run_id, spec_hash=spec_hash, call_timeout_seconds=call_timeout_seconds
        )
        self._sidecar = sidecar

    @classmethod
    async def start(
        cls, identity: Identity, config: DiscoveryConfig, *, run_id: str, spec_hash: bytes
    ) -> Libp2pDiscovery:
        """Start the sidecar and join through the config's initial peers."""
        sidecar = Sidecar(
            identity,
            initial_peers=config.initial_peers,
            host=config.host,
            port=config.port,
            network_secret=config.network_secret,
            start_timeout_seconds=config.start_timeout_seconds,
        )
        await sidecar.start()
        return cls(
            sidecar,
            identity,
            run_id=run_id,
            spec_hash=spec_hash,
            call_timeout_seconds=config.call_timeout_seconds,
        )

    @property
    def sidecar(self) -> Sidecar:
        return self._sidecar

    def visible_maddrs(self) -> list[str]:
        return list(self._sidecar.maddrs)

    async def _store(self, key: str, subkey: str, value: bytes, expires: float) -> bool:
        stored = await self._sidecar.store(
            key, subkey, value, expires, timeout_seconds=self._timeout
        )
        if stored:  # stored again if the sidecar is restarted (a leave's tombstone too)
            self._sidecar.announced[(key, subkey)] = (value, expires)
        return stored > 0

    async def _get(self, key: str) -> dict[str, tuple[bytes | None, float]]:
        return await self._sidecar.get(key, timeout_seconds=self._timeout)

    async def close(self) -> None:
        await self._sidecar.close()
