"""An all-reduce member in its own process, driven by JSON lines (tests, benchmarks, simulations).

    python -m swarmgrad.simulations.allreduce_peer --name p0 --codecs int8,fp16 --out-dir DIR

Its key is derived from ``--name`` (:meth:`Identity.from_seed`: the same peer id every run; for
experiments only). It starts one :class:`Averager` per codec on 127.0.0.1 (port 0), prints
``{"event": "ready", "peer_id": id, "endpoints": {codec: "host:port"}}`` and then obeys commands
on stdin:

``{"cmd": "round", "codec": C, "round": R, "members": [...], "seed": S, "size": N, "fault": F}``
    Average ``randn(N)`` drawn from seed S with the group ``members`` (dicts of Member fields).
    Prints ``{"event": "done", ...}`` with the contributor lists, missing ranges, failures, the
    sha256 of the result and the path of the raw fp32 result file (unless ``"save": false``),
    payload bytes sent and received, or ``{"event": "aborted"}``.
    ``fault`` (optional) injects a failure at (this peer, this round): ``{"kind": "kill" | "stall"
    | "truncate", "after_chunks": K}`` kills the process with SIGKILL, freezes it with SIGSTOP,
    or sends truncated payloads once K chunks have gone out.
``{"cmd": "prepare", "seed": S, "size": N}``
    Draw the vector of a coming round now (and its result buffer), so that the round itself
    starts at once; prints ``{"event": "prepared"}``. A round with the same seed and size uses
    it, and reuses the result buffer from round to round, as a trainer would.
``{"cmd": "stats"}``
    Prints ``{"event": "stats", "rss_bytes": N, "rejections": {service: {code: n}}}``.
``{"cmd": "exit"}``
    Stop the averagers gracefully and exit.

With ``--all-services`` the first codec's server also serves what a node's does besides
Averaging: State (a fixed 100,000-value state at epoch 1, its root in the ready event as
``state_root``) and Peer (GetInfo, DialBack, and Punch with 127.0.0.1 as its public address),
all sharing one request verifier and one rejection count, as in a node.

:class:`PeerProcess` is the parent's handle on such a process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from swarmgrad.node.averaging.allreduce import AllReduceConfig
from swarmgrad.node.averaging.averager import Averager, transport_limits
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.punch import PunchResponder
from swarmgrad.node.transport.transport import Transport, TransportConfig
from swarmgrad.protocol import peer, state
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.errors import RoundAborted
from swarmgrad.protocol.server import Rejections


def member_vector(seed: int, size: int) -> torch.Tensor:
    """The vector a peer averages in a round: standard normals from ``seed`` (never zeros)."""
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


class FaultHooks:
    """Injects one fault into this peer's outgoing chunks (kill, stall or truncate)."""

    def __init__(self, kind: str, after_chunks: int) -> None:
        if kind not in ("kill", "stall", "truncate"):
            raise ValueError(f"unknown fault {kind!r}")
        self.kind, self.after_chunks, self.sent = kind, after_chunks, 0

    async def before_send(self, owner: int, index: int, payload: bytes) -> bytes:
        if self.sent >= self.after_chunks:
            if self.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.kind == "stall":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                payload = payload[: len(payload) // 2]
        self.sent += 1
        return payload


def _rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _serve(args: argparse.Namespace) -> None:
    out_dir = Path(args.out_dir)
    identity = Identity.from_seed(f"allreduce-peer/{args.name}")
    averagers: dict[str, Averager] = {}
    verifier, rejections = Verifier(identity.peer_id), Rejections()
    spec_hash = bytes.fromhex(args.spec_hash)
    served = state.Snapshot.of(1, member_vector(1, 100_000))
    punch = PunchResponder(host="127.0.0.1", target=None, public_host=lambda: "127.0.0.1")
    me = peer.PeerIdentity(
        peer_id=identity.peer_id,
        run_id=args.run_id,
        spec_hash=spec_hash,
        software_version="test",
        codecs=tuple(args.codecs.split(",")),
    )
    services = [
        lambda server: state.add_to_server(
            state.StateServicer(
                run_id=args.run_id,
                spec_hash=spec_hash,
                lookup={served.checksum: served}.get,
                verifier=verifier,
                rejections=rejections,
            ),
            server,
        ),
        lambda server: peer.add_to_server(
            peer.PeerServicer(
                me, signer=identity, verifier=verifier, rejections=rejections, punch=punch
            ),
            server,
        ),
    ]
    async with contextlib.AsyncExitStack() as stack:
        for codec in args.codecs.split(","):
            everything = args.all_services and not averagers
            config = AllReduceConfig(
                run_id=args.run_id,
                spec_hash=bytes.fromhex(args.spec_hash),
                codec=codec,
                chunk_values=args.chunk_values,
                round_timeout_seconds=args.round_timeout,
                sender_timeout_seconds=args.sender_timeout,
                reducer_timeout_seconds=args.reducer_timeout,
                join_timeout_seconds=args.join_timeout,
            )
            transport = Transport(
                TransportConfig(
                    limits=transport_limits(
                        config, min_message_bytes=state.MAX_MESSAGE_BYTES if everything else 0
                    )
                ),
                rejections=rejections,
            )
            for register in services if everything else ():
                transport.register(register)
            averager = Averager(
                identity, config, transport, verifier=verifier, rejections=rejections
            )
            # Exits run in reverse: the server stops (with its grace) before the rounds close.
            averagers[codec] = await stack.enter_async_context(averager)
            await stack.enter_async_context(transport)
            if everything:
                punch.target = ("127.0.0.1", averager.port)
        # Torch and grpc leave ~10^6 long-lived objects; without this, the collector's full
        # passes over them stall the first rounds by ~0.1 s each.
        gc.collect()
        gc.freeze()
        endpoints = {c: a.endpoint for c, a in averagers.items()}
        ready = {"event": "ready", "peer_id": identity.peer_id, "endpoints": endpoints}
        _emit({**ready, "state_root": served.checksum} if args.all_services else ready)
        prepared: dict[tuple[int, int], torch.Tensor] = {}
        buffer: torch.Tensor | None = None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            command = json.loads(line)
            if command["cmd"] == "exit":
                break
            if command["cmd"] == "stats":
                services_seen = {service for service, _ in rejections.counts}
                _emit(
                    {
                        "event": "stats",
                        "rss_bytes": _rss_bytes(),
                        "rejections": {s: dict(rejections.by_code(s)) for s in services_seen},
                    }
                )
            if command["cmd"] == "prepare":
                prepared[(command["seed"], command["size"])] = member_vector(
                    command["seed"], command["size"]
                )
                if buffer is None or buffer.numel() != command["size"]:
                    buffer = torch.zeros(command["size"])
                _emit({"event": "prepared"})
            if command["cmd"] == "round":
                vector = prepared.pop((command["seed"], command["size"]), None)
                reuse = buffer if vector is not None else None
                if vector is None:
                    vector = member_vector(command["seed"], command["size"])
                await _round(averagers[command["codec"]], command, vector, reuse, out_dir)


async def _round(
    averager: Averager,
    command: dict[str, Any],
    vector: torch.Tensor,
    out: torch.Tensor | None,
    out_dir: Path,
) -> None:
    group = Group(round=command["round"], members=tuple(Member(**m) for m in command["members"]))
    fault = command.get("fault")
    hooks = FaultHooks(fault["kind"], fault["after_chunks"]) if fault else None
    traffic_before = dict(averager.traffic)
    started = time.perf_counter()
    try:
        result = await averager.all_reduce(vector, group, hooks=hooks, out=out)
    except RoundAborted as error:
        _emit(
            {
                "event": "aborted",
                "round": group.round,
                "error": str(error),
                "seconds": time.perf_counter() - started,
            }
        )
        return
    seconds = time.perf_counter() - started
    traffic = {k: v - traffic_before.get(k, 0) for k, v in averager.traffic.items()}
    digest, path = "", None
    if command.get("save", True):
        data = result.averaged.numpy().tobytes()
        path = out_dir / f"{averager.peer_id}-{averager.config.codec}-{group.round}.f32"
        path.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
    _emit(
        {
            "event": "done",
            "round": group.round,
            "seconds": seconds,
            "bytes_sent": traffic.get("sent", 0),
            "bytes_received": traffic.get("received", 0),
            "contributors": list(result.contributors),
            "partial": list(result.partial),
            "missing": [list(r) for r in result.missing],
            "failures": dict(result.failures),
            "sha256": digest,
            "path": str(path) if path else None,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="this peer's key is derived from it")
    parser.add_argument("--codecs", default="int8", help="comma-separated; one averager each")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--run-id", default="test-run")
    parser.add_argument("--spec-hash", default="00" * 32)
    parser.add_argument("--chunk-values", type=int, default=1 << 20)
    parser.add_argument("--round-timeout", type=float, default=60.0)
    parser.add_argument("--sender-timeout", type=float, default=10.0)
    parser.add_argument("--reducer-timeout", type=float, default=20.0)
    parser.add_argument("--join-timeout", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--all-services", action="store_true", help="also serve State and Peer, as a node does"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(_serve(args))


class PeerProcess:
    """The parent's handle on one allreduce_peer process (asyncio subprocess, JSON lines)."""

    def __init__(self, process: asyncio.subprocess.Process, name: str) -> None:
        self.process, self.name = process, name
        self.peer_id = ""  # known once it is ready
        self.endpoints: dict[str, str] = {}
        self.state_root = ""  # the state it serves, with --all-services

    @classmethod
    async def start(
        cls, name: str, out_dir: Path, *extra: str, ready_timeout_seconds: float = 60.0
    ) -> PeerProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "swarmgrad.simulations.allreduce_peer",
            "--name",
            name,
            "--out-dir",
            str(out_dir),
            *extra,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        peer = cls(process, name)
        try:
            ready = await peer.event(ready_timeout_seconds)
        except BaseException:
            peer.kill()
            raise
        peer.peer_id, peer.endpoints = ready["peer_id"], ready["endpoints"]
        peer.state_root = ready.get("state_root", "")
        return peer

    def member(self, codec: str, *, weight: float = 1.0, bandwidth: float = 1.0) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "endpoint": self.endpoints[codec],
            "weight": weight,
            "bandwidth": bandwidth,
        }

    async def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()

    async def event(self, timeout_seconds: float) -> dict[str, Any]:
        """The next event line; raises TimeoutError, or EOFError if the process exited."""
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout_seconds):
            line = await self.process.stdout.readline()
        if not line:
            raise EOFError(f"{self.name} exited with {await self.process.wait()}")
        event: dict[str, Any] = json.loads(line)
        return event

    def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    async def stop(self, timeout_seconds: float = 10.0) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.send({"cmd": "exit"})
            try:
                async with asyncio.timeout(timeout_seconds):
                    await self.process.wait()
            except TimeoutError:
                self.kill()
        await self.process.wait()


if __name__ == "__main__":
    main()
