"""Real WAN conditions for real node processes (``simulate --netem``, root): each node in its own
network namespace on the NAT lab's public segment (``natlab.py``), its links shaped from its
profile by what this kernel has.

- upload: a tbf on the host's ``wan0``; download: a tbf on the bridge port that leads to it;
- loss: nftables drops that share of the packets the host receives (``numgen random``);
- partitions: nftables drops everything on ``wan0`` until the partition heals;
- latency and jitter (this kernel has no netem qdisc): when any profile asks for them, every
  node's gRPC port is fixed (``GRPC_PORT``) and nftables redirects the connections a node makes
  to that port on other hosts to a delay proxy in its own namespace (``delay_proxy.py``), which
  delays both directions by the two ends' one-way latencies (from the peers file this class
  keeps). The DHT's own traffic is not delayed.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType

from swarmgrad.simulations.natlab import Host, LabError, NatLab, missing_tools
from swarmgrad.simulations.profiles import PeerProfile

log = logging.getLogger(__name__)

_PARTITION_TABLE = "swarmgrad_partition"
_LOSS_TABLE = "swarmgrad_loss"
_DELAY_TABLE = "swarmgrad_delay"
#: With delays, every node serves gRPC on this port (each in its own namespace) and its delay
#: proxy listens on the next one; the proxy's own packets carry this mark.
GRPC_PORT = 7070
PROXY_PORT = GRPC_PORT + 1
PROXY_MARK = 0x5347


def unavailable() -> list[str]:
    """What this machine lacks for ``--netem`` (empty when it can)."""
    return missing_tools() + (["tc"] if shutil.which("tc") is None else [])


def _tbf(rate_bytes_per_second: float) -> list[str]:
    """A token bucket at the rate, with a burst of ~4 ms (at least 16 KiB) and 0.4 s of queue."""
    burst = max(int(rate_bytes_per_second / 250), 16 * 1024)
    return ["tbf", "rate", f"{int(rate_bytes_per_second * 8)}bit", "burst", str(burst),
            "latency", "400ms"]  # fmt: skip


class Wan:
    """A shaped public segment: one host per node (and the bootstrap), built and torn down with
    ``with Wan() as wan:``."""

    def __init__(self, token: str | None = None, *, delays: bool = False) -> None:
        """``delays``: put a delay proxy in front of every node's gRPC port (some profile asks
        for latency or jitter; a node without any still adds its peers')."""
        self.lab = NatLab(token)
        self.delays = delays
        self._folder = tempfile.TemporaryDirectory(prefix="swarmgrad-wan-")
        #: Every delayed host's one-way latency, by address, for the proxies to look up.
        self.peers_file = Path(self._folder.name) / "peers.json"
        self._latencies: dict[str, float] = {}

    def __enter__(self) -> Wan:
        self.lab.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        try:
            self.lab.close()  # its hosts' processes (the proxies too) go with it
        finally:
            self._folder.cleanup()

    def host(self, profile: PeerProfile | None = None) -> Host:
        """A new host on the segment, its links shaped by ``profile``."""
        host = self.lab.public()
        if profile is None:
            return host
        if profile.upload_bytes_per_second is not None:
            self._tc(host.namespace, "wan0", profile.upload_bytes_per_second)
        if profile.download_bytes_per_second is not None:
            self._tc(self.lab.wan, self.lab.port_of(host), profile.download_bytes_per_second)
        if profile.loss > 0:
            per_mille = round(profile.loss * 1000)
            self._nft(
                host.namespace,
                f"table inet {_LOSS_TABLE} {{\n  chain input {{ type filter hook input priority 0; "
                f'iifname "wan0" numgen random mod 1000 < {per_mille} drop; }}\n}}\n',
            )
        if self.delays:
            self._delay(host, profile)
        return host

    def _delay(self, host: Host, profile: PeerProfile) -> None:
        """The delay proxy in ``host``, and the redirect of its calls to other nodes' gRPC port
        through it."""
        self._latencies[host.address] = profile.latency_ms
        self.peers_file.write_text(json.dumps(self._latencies))
        proxy = host.popen(
            [sys.executable, "-m", "swarmgrad.simulations.delay_proxy",
             "--listen", f"127.0.0.1:{PROXY_PORT}", "--mark", str(PROXY_MARK),
             "--latency-ms", str(profile.latency_ms), "--jitter-ms", str(profile.jitter_ms),
             "--peers", str(self.peers_file), "--seed", str(len(self._latencies))],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        assert proxy.stdout is not None
        with proxy.stdout:  # one line once it listens, then nothing
            ready = proxy.stdout.readline()
        if not ready.startswith(b"listening"):
            raise LabError(f"{host.namespace}: the delay proxy did not start ({ready!r})")
        self._nft(
            host.namespace,
            f"table ip {_DELAY_TABLE} {{\n  chain output {{ type nat hook output priority -100; "
            f'oifname "wan0" tcp dport {GRPC_PORT} meta mark != {PROXY_MARK} '
            f"redirect to :{PROXY_PORT}; }}\n}}\n",
        )

    def partition(self, host: Host) -> None:
        """Cut ``host`` off the segment (every packet in or out dropped)."""
        self._nft(
            host.namespace,
            f"table inet {_PARTITION_TABLE} {{\n"
            f'  chain input {{ type filter hook input priority -10; iifname "wan0" drop; }}\n'
            f'  chain output {{ type filter hook output priority -10; oifname "wan0" drop; }}\n'
            "}\n",
        )

    def heal(self, host: Host) -> None:
        NatLab.run_in(host.namespace, "nft", "delete", "table", "inet", _PARTITION_TABLE)

    @staticmethod
    def _tc(namespace: str, device: str, rate: float) -> None:
        NatLab.run_in(namespace, "tc", "qdisc", "add", "dev", device, "root", *_tbf(rate))

    @staticmethod
    def _nft(namespace: str, rules: str) -> None:
        NatLab.run_in(namespace, "nft", "-f", "-", stdin=rules)
