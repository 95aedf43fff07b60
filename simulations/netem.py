"""Real WAN conditions for real node processes (``simulate --netem``, root): each node in its own
network namespace on the NAT lab's public segment (``natlab.py``), its links shaped from its
profile by what this kernel has.

- upload: a tbf on the host's ``wan0``; download: a tbf on the bridge port that leads to it;
- loss: nftables drops that share of the packets the host receives (``numgen random``);
- partitions: nftables drops everything on ``wan0`` until the partition heals.

Latency is not applied yet: this kernel has no netem qdisc (``../shared/FACTS.md``), and the delay
proxy that would stand in for it is not built; a profile that asks for latency is told so.
"""

from __future__ import annotations

import logging
import shutil
from types import TracebackType

from swarmgrad.simulations.natlab import Host, NatLab, missing_tools
from swarmgrad.simulations.profiles import PeerProfile

log = logging.getLogger(__name__)

_PARTITION_TABLE = "swarmgrad_partition"
_LOSS_TABLE = "swarmgrad_loss"


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

    def __init__(self, token: str | None = None) -> None:
        self.lab = NatLab(token)

    def __enter__(self) -> Wan:
        self.lab.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.lab.close()

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
        if profile.latency_ms:
            log.warning(
                "%s: latency_ms = %g is not applied (no delay proxy yet; this kernel has no netem)",
                host.namespace,
                profile.latency_ms,
            )
        return host

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
