"""The node's Peer service (GetInfo, DialBack, Punch), and how peers reach this node.

``PeerService`` registers the Peer servicer on the node's transport before it starts, with the
punch responder that answers a NAT'd peer's request to punch towards it. Both need to know this
node's reachability, which only exists once the transport is bound (its port): the node
:meth:`~PeerService.attach`\\ es it then. :meth:`~PeerService.summary` and
:meth:`~PeerService.links` are what the status, the record and the metrics show of it.
"""

from __future__ import annotations

import importlib.metadata
from collections import Counter
from collections.abc import Iterable
from typing import Any

from swarmgrad.compression import codec_names
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Link, Presence, Reach
from swarmgrad.node.reachability.dialback import Reachability
from swarmgrad.node.reachability.punch import PunchResponder
from swarmgrad.node.reachability.routes import PunchRoutes
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.scraped import Links
from swarmgrad.node.transport.transport import Transport
from swarmgrad.protocol import peer
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.errors import SwarmgradError
from swarmgrad.protocol.server import Rejections

#: How long a peer has to answer "are you still there?" (matchmaking asks a late peer).
LIVENESS_TIMEOUT_SECONDS = 2.0


class PeerService:
    def __init__(
        self,
        identity: Identity,
        spec: RunSpec,
        transport: Transport,
        *,
        verifier: Verifier,
        rejections: Rejections,
        punch: bool,
        round_left: peer.RoundLeft | None = None,
    ) -> None:
        """``round_left``: whether this node has left a round (its averager's registry), for
        peers that ask."""
        self.reachability: Reachability | None = None
        self._host = transport.config.host
        self._run_id, self._spec_hash = spec.run.id, spec.hash
        self.responder = (
            PunchResponder(host=self._host, target=None, public_host=self.public_host)
            if punch
            else None
        )
        self.servicer = peer.PeerServicer(
            peer.PeerIdentity(
                peer_id=identity.peer_id,
                run_id=spec.run.id,
                spec_hash=spec.hash,
                software_version=_software_version(),
                codecs=tuple(codec_names()),
            ),
            signer=identity,
            verifier=verifier,
            rejections=rejections,
            punch=self.responder,
            origin=self._origin,
            round_left=round_left,
        )
        transport.register(lambda server: peer.add_to_server(self.servicer, server))

    def attach(self, reachability: Reachability, port: int) -> None:
        """The node's reachability, and the port punched links lead to (once it is bound)."""
        self.reachability = reachability
        if self.responder is not None:
            self.responder.target = (self._host, port)

    def public_host(self) -> str:
        """This node's address as seen from outside, if it is behind a NAT (else "")."""
        reach = self.reachability
        return reach.observed_host if reach is not None and reach.behind_nat else ""

    def _origin(self, local: str) -> str | None:
        """Where a connection our relay client spliced to our server came from (Peer.Punch
        punches only towards its caller)."""
        return self.reachability.origin_of(local) if self.reachability is not None else None

    def summary(self, routes: PunchRoutes) -> dict[str, Any]:
        """How peers reach this node, and what it relays for others."""
        reach = self.reachability
        relay = reach.relay_server if reach is not None else None
        return {
            "reachability": reach.kind if reach is not None else Reach.UNKNOWN,
            "via": reach.via if reach is not None else "",
            "relay": reach.relay_endpoint if reach is not None else "",
            "relay_clients": relay.clients if relay is not None else 0,
            "relayed_bytes": sum(relay.traffic.values()) if relay is not None else 0,
            # links this node dialed through punching routes, by how they went
            "links": routes.counts(),
            "punched_in": self.responder.counts["punched"] if self.responder else 0,
        }

    def links(self, routes: PunchRoutes, peers: Iterable[PeerRecord], me: str) -> Links:
        """How this node is reached, and how it reaches each of ``peers``."""
        summary = self.summary(routes)
        others: Counter[str] = Counter(
            Link.PUNCHED if routes.punched(p.endpoint) else Link(p.reachability)
            for p in peers
            if p.peer_id != me
        )
        return Links(
            reachability=summary["reachability"],
            peers=others,
            relay_clients=summary["relay_clients"],
            relayed_bytes=summary["relayed_bytes"],
        )

    async def alive(self, record: PeerRecord) -> bool:
        """Does ``record``'s peer still answer at its endpoint (:meth:`answers`)?"""
        return await self.answers(record.peer_id, record.endpoint)

    async def answers(self, peer_id: str, endpoint: str) -> bool:
        """Does ``peer_id`` answer at ``endpoint``, as itself (signed, over a fresh challenge),
        within ``LIVENESS_TIMEOUT_SECONDS``? No for a refused or silent endpoint, and for
        another process answering there."""
        return await self.presence(peer_id, endpoint) is not Presence.GONE

    async def presence(
        self, peer_id: str, endpoint: str, round_key: tuple[int, bytes] | None = None
    ) -> Presence:
        """:meth:`answers`, and with ``round_key`` (a round both nodes are in) whether the peer
        has left that round, as it signs it: a round's question of a peer gone quiet in it."""
        try:
            info = await peer.get_info(
                endpoint,
                run_id=self._run_id,
                spec_hash=self._spec_hash,
                timeout_seconds=LIVENESS_TIMEOUT_SECONDS,
                expected_peer=peer_id,
                round_key=round_key,
            )
        except SwarmgradError:
            return Presence.GONE
        return Presence.LEFT if round_key is not None and info.left_round else Presence.THERE

    async def close(self) -> None:
        if self.responder is not None:
            await self.responder.close()
        if self.reachability is not None:
            await self.reachability.close()  # unmap ports, leave relays


def _software_version() -> str:
    try:
        return importlib.metadata.version("swarmgrad")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
