"""``swarmgrad doctor``'s reachability check: can the run's peers dial this machine?

For a few seconds doctor answers ``Peer.GetInfo`` on the port the node would use, as the node's
own key if this machine has one (a private run's peers serve only keys on its allowlist), else a
throwaway one, and asks up to three of the run's reachable peers to dial it back, as a node does
at start (``reachability/dialback.py``), every request from one local port: the ports they saw
it come from tell the NAT's kind (``reachability/nat_kind.py``). It announces nothing and writes
nothing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import grpc

from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Reach
from swarmgrad.node.metrics import parse_address
from swarmgrad.node.reachability.nat_kind import Seen, classify, from_one_port
from swarmgrad.protocol import peer
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.errors import SwarmgradError

#: Peers asked at once; one that got through is enough.
HELPERS = 3


def _ipv4(endpoint: str) -> bool:
    """An IPv4 ``host:port`` (the calls leave from one IPv4 port, as punching's do)."""
    try:
        return isinstance(ipaddress.ip_address(parse_address(endpoint)[0]), ipaddress.IPv4Address)
    except ValueError:
        return False


async def reachability(
    records: Sequence[PeerRecord],
    *,
    identity: Identity,
    run_id: str,
    spec_hash: bytes,
    host: str,
    port: int,
) -> tuple[bool, str, str]:
    """Whether peers reached this machine: (ok, what was found, what to do). Never fails the
    doctor for a NAT (the node gets a relay); only for a port nobody may listen on."""
    helpers = [
        r
        for r in records
        if r.endpoint and r.peer_id != identity.peer_id and _ipv4(r.endpoint)
        and r.reachability in (Reach.DIRECT, Reach.UPNP, Reach.UNKNOWN)
    ][:HELPERS]  # fmt: skip
    if not helpers:
        return True, "no reachable peer of the run to ask to dial this machine back yet", ""
    server = grpc.aio.server()
    me = peer.PeerIdentity(
        peer_id=identity.peer_id, run_id=run_id, spec_hash=spec_hash,
        software_version="doctor", codecs=(),
    )  # fmt: skip
    servicer = peer.PeerServicer(me, signer=identity, verifier=Verifier(identity.peer_id))
    peer.add_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as error:
        return False, f"cannot listen on {host}:{port} to be dialed back: {error}", "--port"
    await server.start()
    try:

        async def ask(i: int, endpoint: str) -> peer.DialBack | None:
            helper = helpers[i]
            try:
                return await peer.ask_dial_back(
                    endpoint, signer=identity, helper_id=helper.peer_id, port=bound,
                    run_id=run_id, spec_hash=spec_hash,
                )  # fmt: skip
            except SwarmgradError:
                return None

        # Every call from one local port: the ports the helpers saw tell the NAT's kind.
        calls = await from_one_port([parse_address(h.endpoint) for h in helpers], ask)
    finally:
        await server.stop(grace=None)
    answers = [(local, a) for local, a in calls if local is not None and a is not None]
    if not answers:
        return True, f"none of {len(helpers)} peer(s) asked could dial back (they refused)", ""
    nat = classify([Seen(local, (a.observed_host, a.observed_port)) for local, a in answers])
    reached = next((a for _, a in answers if a.reachable), None)
    if reached is not None:
        said = f"direct: a peer dialed this machine back at {reached.observed_host}"
        return True, f"{said}; {nat.said}", ""
    seen = answers[0][1].observed_host
    return (
        True,
        f"behind a NAT or firewall (peers see {seen}, and could not dial port {bound} back): "
        f"{nat.said}; the node maps a port by UPnP or takes a relay",
        "",
    )
