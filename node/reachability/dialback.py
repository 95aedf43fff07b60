"""Reachability of this node's gRPC endpoint: learned from peers, then made good if it is missing.

The DHT's own NAT tricks only carry DHT traffic; the gRPC endpoint is this module's job. A node
never trusts its own view of its address. It asks a few peers to dial its port back
(``protocol/peer.py``): any success makes it *direct*. If helpers answered and none got through,
it is behind a NAT or a firewall; it then:

1. asks its router for a port mapping (UPnP IGD, ``portmap.py``), and has peers dial
   the mapped port back: *upnp*. Finding a gateway takes seconds, so it holds a relay (2.)
   meanwhile and leaves it once the mapped port is dialed back;
2. otherwise takes a relay: a peer not known to be NAT'd that offers one (its record's ``relay``)
   carries connections to this node (``relay.py``): *relayed*, announced with the relay's
   peer id. When the relay goes silent, another is found within seconds;
3. with no relay to take, it is *unreachable*: it still averages, as a member that owns no part
   (members only dial owners; the results come back on the same streams), and it is not
   offered as a state donor.

Nodes offer a relay (bounded, ``RelayLimits``, to the peers ``admit`` lets in: ``relay.py``)
unless its ``max_clients`` is 0, from the start until they learn they are behind a NAT: when the
only reachable peer is one node, nobody can confirm it until NAT'd peers hold a relay (through
which they can be asked to dial back). Until some peer has answered, a node is *unknown* and is
treated as reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Reach
from swarmgrad.node.metrics import parse_address
from swarmgrad.node.reachability.portmap import PortMapError, PortMapping, map_port
from swarmgrad.node.reachability.relay import Admit, RelayError, RelayLimits
from swarmgrad.node.reachability.relay_client import RelayClient
from swarmgrad.node.reachability.relay_server import RelayServer
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.transport.transport import Transport
from swarmgrad.protocol.addresses import endpoint_of
from swarmgrad.protocol.errors import SwarmgradError
from swarmgrad.protocol.peer import DialBack, ask_dial_back

log = logging.getLogger(__name__)

#: The share of the vector a member owns, relative to its bandwidth, by how it is reached:
#: relayed links cost the relay's upload too, and an unreachable member cannot be dialed at all.
_WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReachabilityConfig:
    #: Peers asked to dial back at once; one success is enough.
    helpers: int = 3
    #: How often to look for helpers (or a relay) while there are none.
    retry_seconds: float = 2.0
    #: How often a settled verdict is checked again (a router reboots, a mapping expires).
    recheck_seconds: float = 300.0
    #: Ask the router for a port mapping when unreachable.
    upnp: bool = True
    #: Punch through to relayed peers when this node is behind a NAT too (else: their relays).
    punch: bool = True
    #: How long a relay this node leaves for a better address (a mapped port, a direct one)
    #: still carries connections: peers that read the relayed endpoint before the new one was
    #: announced dial it until they read again (a record lives ``record_ttl_seconds``, 60 s).
    handover_seconds: float = 60.0
    #: The relay this node offers; ``max_clients=0`` offers none.
    relay_limits: RelayLimits = field(default_factory=RelayLimits)

    def __post_init__(self) -> None:
        if self.helpers < 1:
            raise ValueError("helpers must be positive")
        if not 0 < self.retry_seconds <= self.recheck_seconds:
            raise ValueError("retry_seconds must be positive and at most recheck_seconds")
        if self.handover_seconds < 0:
            raise ValueError("handover_seconds must not be negative")


class Reachability:
    """What this node announces about its endpoint; :meth:`run` keeps it true."""

    def __init__(
        self,
        identity: Identity,
        spec: RunSpec,
        transport: Transport,
        *,
        peers: Callable[[], Awaitable[Sequence[PeerRecord]]],
        changed: Callable[[], None],
        admit: Admit,
        config: ReachabilityConfig | None = None,
    ) -> None:
        """``transport`` is the node's, already serving: its port is what peers must reach.
        ``peers`` reads the run's peer records; ``changed`` hears a new verdict; ``admit`` says
        whom the relay this node offers serves."""
        self._identity = identity
        self._run_id, self._spec_hash = spec.run.id, spec.hash
        host, port = transport.config.host, transport.port
        public_host = transport.config.public_host
        self._host, self._port = host, port
        self._peers, self._changed, self._admit = peers, changed, admit
        self.config = config or ReachabilityConfig()
        self.kind = Reach.UNKNOWN
        self.endpoint = endpoint_of(public_host or host, port)
        self.relay_endpoint = ""  # the relay this node offers
        self.via = ""  # the relay peer carrying this node's endpoint
        self.observed_host = ""
        self._relay_server: RelayServer | None = None
        self._relay_client: RelayClient | None = None
        #: Relays left for a better address, still carrying what was dialed through them.
        self._handing_over: dict[RelayClient, asyncio.Task[None]] = {}
        self._mapping: PortMapping | None = None
        self._bad_relays: dict[str, float] = {}  # peer id -> until (loop time)
        self._public_host = public_host
        #: Set once a verdict other than "unknown" is in.
        self.settled = asyncio.Event()
        #: Checks that failed with an unexpected error (logged, and tried again).
        self.failures = 0

    @property
    def behind_nat(self) -> bool:
        """Known to be undialable directly, with a public address peers saw (for punching)."""
        return self.kind in (Reach.RELAYED, Reach.UNREACHABLE) and bool(self.observed_host)

    @property
    def owner_share(self) -> float:
        return self.kind.owner_share

    def _set(self, kind: Reach, endpoint: str, via: str = "") -> None:
        if (kind, endpoint, via) != (self.kind, self.endpoint, self.via):
            log.info("reachability: %s at %s%s", kind, endpoint, f" via {via}" if via else "")
            self.kind, self.endpoint, self.via = kind, endpoint, via
            self._changed()
        if kind != Reach.UNKNOWN:
            self.settled.set()

    async def run(self) -> None:
        try:
            # Offer a relay from the start: when the only reachable peer is this one, nobody can
            # confirm it before NAT'd peers hold a relay through which they can be asked back.
            if (self._public_host or self._host) not in _WILDCARDS:
                await self._start_relay_server(self.endpoint)
            while True:
                try:
                    pause = await self._check()
                except Exception:  # a bug or an answer nobody foresaw must not end the checks
                    self.failures += 1
                    log.exception(
                        "reachability check failed; again in %g s", self.config.retry_seconds
                    )
                    pause = self.config.retry_seconds
                await asyncio.sleep(pause)
        finally:
            await self.close()

    async def _check(self) -> float:
        """One pass: probe, then be direct, mapped or relayed; the seconds until the next."""
        verdict = await self._probe(self._port)
        if verdict is None:
            return self.config.retry_seconds
        if verdict.reachable:
            await self._become_reachable(Reach.DIRECT, self._direct_endpoint(verdict))
            return self.config.recheck_seconds
        self.observed_host = verdict.observed_host
        await self._stop_relay_server()
        if not self.config.upnp:
            await self._relay_until_recheck()
            return 0.0
        # Finding a gateway takes seconds (miniupnpc asks for six device types in turn: ~9 s
        # where none answers, the common case): hold a relay meanwhile, and move to the mapped
        # port once a peer has dialed it back.
        relaying = asyncio.create_task(self._relay_until_recheck())
        try:
            mapped = await self._mapped_endpoint()
        except BaseException:
            await _cancelled(relaying)
            raise
        if mapped is None:
            await relaying
            return 0.0
        await _cancelled(relaying)
        await self._become_reachable(Reach.UPNP, mapped)
        return self.config.recheck_seconds

    def _direct_endpoint(self, verdict: DialBack) -> str:
        host = self._public_host or self._host
        if host in _WILDCARDS:  # bound to every interface: announce the address peers saw
            host = verdict.observed_host
        return endpoint_of(host, self._port)

    async def _become_reachable(self, kind: Reach, endpoint: str) -> None:
        self._hand_over_relay()
        host = parse_address(endpoint)[0]
        if self._relay_server is not None and parse_address(self.relay_endpoint)[0] != host:
            await self._stop_relay_server()  # reachable at another address than it offered
        await self._start_relay_server(endpoint)
        self._set(kind, endpoint)

    async def _start_relay_server(self, endpoint: str) -> None:
        if self._relay_server is None and self.config.relay_limits.max_clients > 0:
            server = RelayServer(
                host=self._host, admit=self._admit, limits=self.config.relay_limits
            )
            port = await server.start()
            self._relay_server = server
            self.relay_endpoint = endpoint_of(parse_address(endpoint)[0], port)
            self._changed()

    async def _probe(self, port: int) -> DialBack | None:
        """Ask up to ``helpers`` peers to dial ``port`` back: the first yes, else a no, else None
        (nobody could be asked)."""
        me = self._identity.peer_id
        peers = [p for p in await self._peers() if p.peer_id != me and p.endpoint]
        random.shuffle(peers)
        # Relayed peers only after the others: a call through a relay reaches them from their
        # own relay client, and they dial back where the relay says it came from (Peer.DialBack,
        # ``origin``), one hop more. Where this node is the only reachable one, they are all
        # there is (it offers their relays), and without them it stayed "unknown" and held its
        # first round for ``reachability_wait_seconds`` (15 s).
        helpers = sorted(
            (p for p in peers if p.reachability != Reach.UNREACHABLE),
            key=lambda p: p.reachability == Reach.RELAYED,
        )
        candidates = helpers[: self.config.helpers]
        if not candidates:
            return None

        async def ask(peer: PeerRecord) -> DialBack | None:
            try:
                return await ask_dial_back(
                    peer.endpoint,
                    signer=self._identity,
                    helper_id=peer.peer_id,
                    port=port,
                    run_id=self._run_id,
                    spec_hash=self._spec_hash,
                )
            except SwarmgradError as error:
                log.debug("could not ask %s to dial back: %s", peer.peer_id, error)
                return None

        answers = [a for a in await asyncio.gather(*map(ask, candidates)) if a is not None]
        if not answers:
            return None
        return next((a for a in answers if a.reachable), answers[0])

    async def _mapped_endpoint(self) -> str | None:
        """Map this node's port on the router and have a peer dial it back: the endpoint to
        announce, or None (no gateway, or the mapped port is not reachable either)."""
        try:
            if self._mapping is None:
                self._mapping = await map_port(self._host, self._port)
            else:
                await self._mapping.renew()
        except PortMapError as error:
            log.info("no port mapping: %s", error)
            self._mapping = None
            return None
        verdict = await self._probe(self._mapping.external_port)
        if verdict is None or not verdict.reachable:
            log.info("the mapped port %d is not reachable either", self._mapping.external_port)
            await self._unmap()
            return None
        # The address the helper saw and dialed back, not the one the gateway reports: behind
        # a second NAT the gateway's own WAN address reaches nobody.
        return endpoint_of(verdict.observed_host, self._mapping.external_port)

    async def _relay_until_recheck(self) -> None:
        """Hold a relay (finding another whenever one dies) until it is time to check again."""
        loop = asyncio.get_running_loop()
        recheck_at = loop.time() + self.config.recheck_seconds
        while loop.time() < recheck_at:
            held = self._relay_client
            if held is not None and held.alive:  # checked again while relayed: keep this one
                if not await self._hold(held, recheck_at):
                    return
                continue
            relay = await self._pick_relay()
            if relay is None:
                self._set(Reach.UNREACHABLE, endpoint_of(self._host, self._port))
                await asyncio.sleep(self.config.retry_seconds)
                continue
            client = RelayClient(
                relay.relay,
                self._identity,
                target=(self._host, self._port),
                limits=self.config.relay_limits,
            )
            try:
                endpoint = await client.connect()
            except RelayError as error:
                log.info("relay %s: %s", relay.peer_id, error)
                self._bad_relays[relay.peer_id] = loop.time() + 60.0
                continue
            except BaseException:  # cancelled mid-handshake: the mapped port won
                await client.close()
                raise
            self._relay_client = client
            self._set(Reach.RELAYED, endpoint, via=relay.peer_id)
            if not await self._hold(client, recheck_at):
                return

    async def _hold(self, client: RelayClient, recheck_at: float) -> bool:
        """Wait until the relay goes (True: find another) or it is time to check again (False:
        probe again; the relay stays until a better verdict)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(0.0, recheck_at - loop.time())):
                await client.wait_closed()
        except TimeoutError:
            return False
        except RelayError as error:
            log.warning("relay %s lost: %s; finding another", self.via, error)
        self._bad_relays[self.via] = loop.time() + 60.0
        await self._leave_relay()
        return True

    async def _pick_relay(self) -> PeerRecord | None:
        now = asyncio.get_running_loop().time()
        offers = [
            p
            for p in await self._peers()
            if p.relay
            and p.reachability in (Reach.DIRECT, Reach.UPNP, Reach.UNKNOWN)
            and p.peer_id != self._identity.peer_id
            and self._bad_relays.get(p.peer_id, 0.0) < now
        ]
        return random.choice(offers) if offers else None

    async def _leave_relay(self) -> None:
        client, self._relay_client = self._relay_client, None
        if client is not None:
            await client.close()

    def _hand_over_relay(self) -> None:
        """Leave the relay for a better address without breaking what peers dial: a peer that
        read the relayed endpoint a moment ago (a round's group is formed from records) still
        reaches this node through it for ``handover_seconds``, then the link closes."""
        client, self._relay_client = self._relay_client, None
        if client is None:
            return

        async def close_later() -> None:
            try:
                # Its end (the time is up, or the relay or its link went) is all that counts.
                with contextlib.suppress(TimeoutError, RelayError, OSError):
                    async with asyncio.timeout(self.config.handover_seconds):
                        await client.wait_closed()
            finally:
                self._handing_over.pop(client, None)
                await client.close()

        self._handing_over[client] = asyncio.create_task(close_later())

    async def _stop_relay_server(self) -> None:
        server, self._relay_server = self._relay_server, None
        self.relay_endpoint = ""
        if server is not None:
            await server.close()

    async def _unmap(self) -> None:
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            with contextlib.suppress(PortMapError):
                await mapping.remove()

    @property
    def relay_server(self) -> RelayServer | None:
        return self._relay_server

    def origin_of(self, local: str) -> str | None:
        """The address a connection relayed to this node came from, given the ``host:port`` its
        local end has (None: not a relayed connection)."""
        for client in (self._relay_client, *self._handing_over):
            if client is not None and local in client.origins:
                return client.origins[local]
        return None

    async def close(self) -> None:
        for task in list(self._handing_over.values()):
            await _cancelled(task)
        await self._leave_relay()
        await self._stop_relay_server()
        await self._unmap()


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
