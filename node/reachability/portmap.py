"""Port mapping on the home router (UPnP IGD, through miniupnpc): the cheapest way to be reachable.

miniupnpc's calls block (SSDP discovery waits ``discover_ms``; each SOAP call is an HTTP request
to the router), so they run in a worker thread, each under a deadline. A mapping asks for the
same external port as the internal one and falls back to any free port the router picks. It is
leased (routers forget mappings whose owner vanished) and renewed on every re-check; ``remove``
deletes it on exit.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

from swarmgrad.protocol.errors import PeerUnavailable

log = logging.getLogger(__name__)

LEASE_SECONDS = 3600
_DESCRIPTION = "swarmgrad"


class PortMapError(PeerUnavailable):
    """No gateway answered, or it refused the mapping."""


@dataclass(slots=True)
class PortMapping:
    internal_host: str
    internal_port: int
    external_host: str
    external_port: int
    _upnp: Any
    timeout_seconds: float

    async def renew(self) -> None:
        await _call(self._add, self.external_port, timeout_seconds=self.timeout_seconds)

    def _add(self, external_port: int) -> bool:
        return bool(
            self._upnp.addportmapping(
                external_port,
                "TCP",
                self.internal_host,
                self.internal_port,
                _DESCRIPTION,
                "",
                LEASE_SECONDS,
            )
        )

    async def remove(self) -> None:
        await _call(
            self._upnp.deleteportmapping,
            self.external_port,
            "TCP",
            timeout_seconds=self.timeout_seconds,
        )
        log.info("removed port mapping %s:%d", self.external_host, self.external_port)


async def _call(function: Any, *args: Any, timeout_seconds: float) -> Any:
    try:
        async with asyncio.timeout(timeout_seconds):
            return await asyncio.to_thread(function, *args)
    except TimeoutError:
        raise PortMapError(f"the gateway did not answer in {timeout_seconds:g} s") from None
    except Exception as error:  # miniupnpc raises plain Exception with the router's message
        raise PortMapError(str(error)) from error


async def map_port(
    host: str, port: int, *, discover_ms: int = 1500, timeout_seconds: float = 10.0
) -> PortMapping:
    """Map a TCP port on the gateway to ``port`` on this host; PortMapError if there is none."""
    try:
        import miniupnpc
    except ImportError:
        raise PortMapError("miniupnpc is not installed") from None
    upnp = miniupnpc.UPnP()
    upnp.discoverdelay = discover_ms
    try:
        found = await _call(upnp.discover, timeout_seconds=timeout_seconds)
    except PortMapError:  # when nothing answers, miniupnpc raises with errno's text: "Success"
        found = 0
    if not found:
        raise PortMapError("no UPnP gateway answered on this network")
    try:
        await _call(upnp.selectigd, timeout_seconds=timeout_seconds)
    except PortMapError as error:
        raise PortMapError(f"no UPnP internet gateway on this network ({error})") from None
    external_host = await _call(upnp.externalipaddress, timeout_seconds=timeout_seconds)
    try:  # "" (no WAN address yet) and garbage are common gateway answers
        if ipaddress.ip_address(str(external_host)).is_unspecified:
            raise ValueError
    except ValueError:
        raise PortMapError(
            f"the gateway reports no usable public address ({str(external_host)[:64]!r})"
        ) from None
    internal_host = host if host not in ("0.0.0.0", "::", "") else upnp.lanaddr
    mapping = PortMapping(internal_host, port, str(external_host), port, upnp, timeout_seconds)
    for external_port in (port, 0):  # the same port if free, else any
        try:
            if external_port == 0:
                mapping.external_port = int(
                    await _call(
                        upnp.addanyportmapping,
                        port,
                        "TCP",
                        internal_host,
                        port,
                        _DESCRIPTION,
                        "",
                        LEASE_SECONDS,
                        timeout_seconds=timeout_seconds,
                    )
                )
            else:
                await mapping.renew()
            break
        except PortMapError as error:
            if external_port == 0:
                raise PortMapError(f"the gateway refused a mapping: {error}") from None
    log.info(
        "mapped %s:%d -> %s:%d on the gateway",
        mapping.external_host,
        mapping.external_port,
        internal_host,
        port,
    )
    return mapping
