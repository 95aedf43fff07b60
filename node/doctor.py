"""``swarmgrad doctor``: can this machine run a node of this run? One line a check, OK or the
problem and what to do about it.

Each check is a function returning a :class:`Finding`; none changes anything on the machine
(ports are probed with a bind let go at once, the DHT with a short-lived reader).
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.ticket import Ticket
from swarmgrad.protocol.auth import CLOCK_WINDOW_SECONDS

#: What a node keeps per parameter, roughly: fp32 weights, the outer state (a copy and its
#: momentum), Adam's two moments, gradients and the averaging buffers.
STATE_BYTES_PER_PARAMETER = 4 * 8
#: How often a node re-issues its peer record (``DirectoryConfig.announce_interval_seconds``).
ANNOUNCE_SECONDS = 15.0
#: How far off a clock may look before it is called off: half the signed messages' window.
CLOCK_SLACK_SECONDS = CLOCK_WINDOW_SECONDS / 2


@dataclass(frozen=True, slots=True)
class Finding:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = "OK  " if self.ok else "FAIL"
        fix = f" -> {self.fix}" if self.fix and not self.ok else ""
        return f"{mark} {self.name:<10} {self.detail}{fix}"


def python() -> Finding:
    version = platform.python_version()
    ok = sys.version_info >= (3, 11)
    return Finding("python", ok, version, "install Python 3.11 or newer")


def device(wanted: str) -> Finding:
    """Which device a node with ``--device wanted`` trains on, and whether that is possible."""
    import torch

    cuda = torch.cuda.is_available()
    if wanted == "cuda" and not cuda:
        return Finding(
            "device",
            False,
            f"cuda asked for, but torch {torch.__version__} sees no CUDA device",
            "install a CUDA build of torch (docs/gpu.md) or use --device cpu",
        )
    if cuda and wanted != "cpu":
        name = torch.cuda.get_device_name(0)
        bf16 = "bf16" if torch.cuda.is_bf16_supported() else "no bf16 (fp32 instead)"
        return Finding("device", True, f"cuda: {name}, {bf16} (torch {torch.__version__})")
    threads = torch.get_num_threads()
    return Finding("device", True, f"cpu, {threads} threads (torch {torch.__version__})")


def memory(spec: RunSpec) -> Finding:
    from swarmgrad.node.training.model import parameter_count

    need = parameter_count(spec.model) * STATE_BYTES_PER_PARAMETER
    available = _available_memory()
    if available is None:
        return Finding(
            "memory", True, f"~{_size(need)} needed; this system does not say how much is free"
        )
    return Finding(
        "memory",
        available > need,
        f"~{_size(need)} needed for the model's state, {_size(available)} available",
        "close other programs, or join a run with a smaller model",
    )


def disk(spec: RunSpec, folder: Path) -> Finding:
    from swarmgrad.node.preflight import checkpoint_bytes

    need = checkpoint_bytes(spec) * (spec.node.keep_checkpoints + 1)
    where = folder if folder.exists() else next(p for p in folder.parents if p.exists())
    free = shutil.disk_usage(where).free
    return Finding(
        "disk",
        free > need,
        f"~{_size(need)} for {spec.node.keep_checkpoints} checkpoints, "
        f"{_size(free)} free in {where}",
        "free some space, or point $SWARMGRAD_HOME (or --checkpoint-dir) at a larger disk",
    )


def port(host: str, number: int, what: str, option: str) -> Finding:
    from swarmgrad.node.preflight import in_use

    if number == 0:
        return Finding(what, True, "any free port (0)")
    taken = in_use(host, number)
    return Finding(
        what,
        not taken,
        f"{host}:{number} {'is in use' if taken else 'is free'}",
        f"stop what listens there, or choose another {option}",
    )


@dataclass(frozen=True, slots=True)
class RunRead:
    """What reading the run's DHT found: the finding, the run's spec (a ticket's, read from its
    publication), and the issue times its peers' records carry (their clocks)."""

    finding: Finding
    spec: RunSpec | None = None
    issued: tuple[float, ...] = ()
    read_at: float = 0.0
    #: Whether the run's peers could dial this machine back (None: not asked).
    reach: Finding | None = None


def run(
    bootstrap: Sequence[str],
    *,
    spec: RunSpec | None = None,
    ticket: Ticket | None = None,
    timeout_seconds: float,
    dial_back: tuple[Identity, str, int] | None = None,
) -> RunRead:
    """Whether the run's DHT answers through ``bootstrap`` and how many peers it lists. For a
    ``ticket``, the run's spec is read from its publication: sealed by the ticket's run key,
    with the ticket's hash. With ``dial_back`` (the key, host and port the node would use), the
    run's peers are also asked to dial this machine back."""
    from swarmgrad.node import published
    from swarmgrad.node.discovery.base import DiscoveryError, dht_time
    from swarmgrad.node.discovery.start import start_reader
    from swarmgrad.node.doctor_reach import reachability

    if not bootstrap:
        return RunRead(
            Finding("run", False, "no bootstrap multiaddr to reach the run through",
                    "give --bootstrap (or [network] bootstrap in the spec)")
        )  # fmt: skip
    if spec is not None:
        run_id, backend, secret, spec_hash = (
            spec.run.id, spec.node.discovery, spec.node.dht_secret, spec.hash
        )  # fmt: skip
    elif ticket is not None:
        run_id, backend, secret = ticket.run_id, ticket.discovery, ""
        spec_hash = bytes.fromhex(ticket.spec_hash)
    else:
        raise ValueError("a spec or a ticket")

    async def read() -> RunRead:
        async with asyncio.timeout(timeout_seconds):
            dht = await start_reader(
                bootstrap,
                backend=backend,
                network_secret=secret,
                timeout_seconds=timeout_seconds,
                run_id=run_id,
                spec_hash=spec_hash,
            )
            try:
                found = spec
                if ticket is not None:
                    listing = await published.fetch(dht, ticket.run_id, ticket.run_key_id)
                    found = listing.spec
                    if found.hash.hex() != ticket.spec_hash:
                        return RunRead(Finding(
                            "run", False, f"{run_id} is published with spec {found.short_hash}, "
                            f"the ticket names {ticket.spec_hash[:12]}",
                            "the organizer changed the run: ask for its new ticket"))  # fmt: skip
                records = await dht.find()
                read_at = dht_time()
                reach = None
                if dial_back is not None:
                    key, host, port = dial_back
                    ok, said, fix = await reachability(
                        records, identity=key, run_id=run_id, spec_hash=spec_hash,
                        host=host, port=port,
                    )  # fmt: skip
                    reach = Finding("reach", ok, said, fix)
                return RunRead(
                    Finding("run", True,
                            f"{run_id}: the DHT answers, {len(records)} peer(s) listed"),
                    found, tuple(r.issued_at for r in records), read_at, reach,
                )  # fmt: skip
            finally:
                await dht.close()

    try:
        return asyncio.run(read())
    except published.RunNotFound as error:
        return RunRead(Finding("run", False, str(error), "check the ticket with its organizer"))
    except (DiscoveryError, TimeoutError, OSError) as error:
        said = str(error) or f"no answer in {timeout_seconds:g} s"
        return RunRead(
            Finding("run", False, f"the run's DHT is unreachable: {said}",
                    "check the bootstrap multiaddr and this machine's connection")
        )  # fmt: skip


def clock(read: RunRead) -> Finding:
    """This clock against the run's peers', from their records' issue times. A record is
    re-issued every ``ANNOUNCE_SECONDS``, so with clocks that agree its age is 0 to that; the
    median over peers (a few that lie move it little) says how far off this one is."""
    if not read.issued:
        return Finding("clock", True, "no peers' records to compare this clock with")
    ages = sorted(read.read_at - issued for issued in read.issued)
    median = ages[len(ages) // 2]
    if median < -CLOCK_SLACK_SECONDS:
        off = f"~{-median:.0f} s behind"
    elif median > ANNOUNCE_SECONDS + CLOCK_SLACK_SECONDS:
        off = f"~{median - ANNOUNCE_SECONDS:.0f} s or more ahead of"
    else:
        return Finding("clock", True, f"agrees with {len(ages)} peer(s)' records")
    return Finding(
        "clock",
        False,
        f"this clock is {off} the run's peers' (signed messages allow {CLOCK_WINDOW_SECONDS:g} s)",
        "sync it: enable NTP (timedatectl set-ntp true, or chrony)",
    )


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
