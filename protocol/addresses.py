"""Endpoints as this project writes them (``host:port``, ``[v6]:port``) and the parts of the
peer strings gRPC hands a servicer (``context.peer()``: ``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""

from __future__ import annotations

import ipaddress


def endpoint_of(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_of(peer: str) -> str:
    """The address in a gRPC ``context.peer()`` string ("" for any other kind of address)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return ""


def port_of(peer: str) -> int:
    """The port of a gRPC ``context.peer()`` string (0 for any other kind of address)."""
    kind, _, rest = peer.partition(":")
    port = rest.rsplit(":", 1)[-1]
    return int(port) if kind in ("ipv4", "ipv6") and port.isdigit() else 0


def local_endpoint(peer: str) -> str:
    """``host:port`` of a gRPC ``context.peer()`` string, as :func:`endpoint_of` writes it."""
    kind, _, rest = peer.partition(":")
    return rest if kind in ("ipv4", "ipv6") else ""


def is_ipv4(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False
