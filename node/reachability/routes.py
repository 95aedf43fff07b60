"""Routes to relayed peers by hole punching, for a node that is behind a NAT itself.

A reachable node is dialed by relayed peers (they reach it through their own outbound streams);
a node behind a NAT that wants to stream to a relayed peer asks that peer (through its relay) to
punch towards it, and dials the punched link through a local listener (``punch.py``): the
transport's route hook sends the channel there. Where punching fails, the route falls back to the
relay. ``PunchRoutes`` keeps one route per relayed endpoint, made on first need: one per peer (a
peer's new endpoint, after its relay changed, replaces its old route) and at most
``MAX_ROUTES``, the least recently dialed closed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Link, Reach
from swarmgrad.node.reachability.punch import PunchCall, PunchRoute
from swarmgrad.node.runspec import RunSpec
from swarmgrad.protocol import peer

#: Routes kept at most (each holds a listening socket): more than a run's groups need at once.
MAX_ROUTES = 64


class PunchRoutes:
    """This node's punching routes, by the relayed endpoint they lead to."""

    def __init__(
        self,
        identity: Identity,
        spec: RunSpec,
        *,
        host: str,
        public_host: Callable[[], str],
        enabled: bool,
    ) -> None:
        """``public_host()`` is this node's address as seen from outside when it is behind a
        NAT, else ""; routes are made only while it is known, and only if ``enabled``."""
        self._identity, self._spec = identity, spec
        self._host, self._public_host, self._enabled = host, public_host, enabled
        self._routes: OrderedDict[str, PunchRoute] = OrderedDict()  # least recently dialed first
        self._peer_of: dict[str, str] = {}  # routed endpoint -> its peer
        self._endpoint_of: dict[str, str] = {}  # peer -> its routed endpoint

    def resolve(self, endpoint: str) -> str:
        """Where to dial ``endpoint``: its route's local end, or the endpoint itself."""
        route = self._routes.get(endpoint)
        if route is None:
            return endpoint
        self._routes.move_to_end(endpoint)
        return route.endpoint

    def punched(self, endpoint: str) -> bool:
        route = self._routes.get(endpoint)
        return route is not None and bool(route.counts[Link.PUNCHED])

    def counts(self) -> dict[str, int]:
        """Links dialed through punching routes, by how they went ("punched", "relayed")."""
        return {
            kind: sum(r.counts[kind] for r in self._routes.values())
            for kind in (Link.PUNCHED, Link.RELAYED)
        }

    def num_punched(self) -> int:
        return sum(1 for r in self._routes.values() if r.counts[Link.PUNCHED])

    async def prepare(self, endpoints: Iterable[str], peers: Iterable[PeerRecord]) -> None:
        """Routes to the relayed peers among ``endpoints`` (their records in ``peers``)."""
        if not self._enabled or not self._public_host():
            return
        relayed = {p.endpoint: p for p in peers if p.reachability == Reach.RELAYED}
        for endpoint in endpoints:
            record = relayed.get(endpoint)
            if record is None or endpoint in self._routes:
                continue
            if record.peer_id == self._identity.peer_id:
                continue
            stale = self._endpoint_of.get(record.peer_id)
            if stale is not None:  # the peer moved (a new relay): its old route leads nowhere
                await self._drop(stale)
            route = PunchRoute(
                host=self._host,
                relayed=endpoint,
                public_host=self._public_host,
                call=self._asker(endpoint, record.peer_id),
            )
            await route.start()
            self._routes[endpoint] = route
            self._peer_of[endpoint] = record.peer_id
            self._endpoint_of[record.peer_id] = endpoint
            while len(self._routes) > MAX_ROUTES:
                await self._drop(next(iter(self._routes)))

    async def _drop(self, endpoint: str) -> None:
        route = self._routes.pop(endpoint, None)
        peer_id = self._peer_of.pop(endpoint, None)
        if peer_id is not None and self._endpoint_of.get(peer_id) == endpoint:
            del self._endpoint_of[peer_id]
        if route is not None:
            await route.close()

    def _asker(self, endpoint: str, callee: str) -> PunchCall:
        async def ask(host: str, port: int) -> tuple[str, int]:
            return await peer.ask_punch(
                endpoint,
                signer=self._identity,
                callee=callee,
                host=host,
                port=port,
                run_id=self._spec.run.id,
                spec_hash=self._spec.hash,
            )

        return ask

    async def close(self) -> None:
        for endpoint in list(self._routes):
            await self._drop(endpoint)
