"""Why a join through bootstrap multiaddrs failed, address by address, said so a volunteer knows
what to do: nobody listens there (the bootstrap is down, or the address is wrong), or something
answers but the DHT join failed anyway (most often a bootstrap restarted with a new peer id:
``swarmgrad bootstrap --identity`` keeps it)."""

from __future__ import annotations

import socket
from collections.abc import Sequence

__all__ = ["explain"]

#: How long the probe of one address may take (it runs after a join already failed).
PROBE_SECONDS = 2.0


def explain(maddrs: Sequence[str]) -> str:
    """One clause per bootstrap multiaddr: what a TCP connection to it found."""
    return "; ".join(_one(maddr) for maddr in maddrs)


def _one(maddr: str) -> str:
    parts = maddr.strip("/").split("/")
    try:
        host = parts[parts.index("ip4") + 1] if "ip4" in parts else parts[parts.index("ip6") + 1]
        port = int(parts[parts.index("tcp") + 1])
    except (ValueError, IndexError):
        return f"{maddr}: not a TCP multiaddr this node can probe"
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            pass
    except ConnectionRefusedError:
        return f"nobody listens at {where} (is the bootstrap node up? is this its address?)"
    except OSError as error:  # unreachable, filtered, timed out
        return f"{where} is unreachable ({error.strerror or error}: a firewall, or a wrong address)"
    return (
        f"{where} accepts connections, yet joining through it failed: if it is the bootstrap, "
        f"its peer id may have changed (restarted without --identity): ask its operator for "
        f"the current multiaddr"
    )
