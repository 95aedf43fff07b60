"""How a node joins its run (operational settings, none in the run spec's hash), and the
per-part configs and limits the :class:`~swarmgrad.node.swarm.Swarm` builds its parts with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from swarmgrad.node.averaging.allreduce import AllReduceConfig
from swarmgrad.node.averaging.plan import CHECK_STEPS, CHECK_TIMEOUT_SECONDS
from swarmgrad.node.averaging.rounds import RoundsConfig
from swarmgrad.node.averaging.slots import SETTLE_SECONDS
from swarmgrad.node.discovery.directory import DirectoryConfig
from swarmgrad.node.discovery.start import DiscoveryConfig
from swarmgrad.node.reachability.dialback import ReachabilityConfig
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.sync import StateSyncConfig
from swarmgrad.node.transport.transport import TransportConfig
from swarmgrad.protocol.server import ServerLimits

#: Matchmaking's wait for stragglers' readiness records after it stops polling.
MATCHMAKING_SETTLE_SECONDS = SETTLE_SECONDS
#: A round's budget beyond its phases' own bounds (preparing the vector, withdrawals).
ROUND_SLACK_SECONDS = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmConfig:
    """How this node joins (operational: nothing here is part of the run spec's hash)."""

    host: str = "127.0.0.1"
    port: int = 0
    public_host: str = ""  # the address peers dial, if not host
    bootstrap: tuple[str, ...] = ()
    #: The DHT backend (:data:`swarmgrad.node.discovery.base.BACKENDS`); a run's nodes share one.
    discovery: str = "hivemind"
    #: libp2p only: a private run's DHT key; its DHT then never merges with any other.
    dht_secret: str = ""
    #: Relative upload capacity: the share of each round's vector this node owns.
    bandwidth: float = 1.0
    #: Cap on this node's averaging uploads (a token bucket), for simulated slow links.
    upload_bytes_per_second: float | None = None
    record_ttl_seconds: float = 60.0
    announce_interval_seconds: float = 15.0
    dht_start_timeout_seconds: float = 60.0
    state_download_timeout_seconds: float = 60.0
    #: Donors a state download draws on at once.
    max_state_donors: int = 4
    #: How this node learns and fixes its reachability (dial-back, UPnP, relays).
    reachability: ReachabilityConfig = field(default_factory=ReachabilityConfig)
    #: How long a first round waits for that verdict when there are peers to ask.
    reachability_wait_seconds: float = 15.0
    #: Open runs: where this node's bans are kept across restarts (None: in memory only).
    bans_path: Path | None = None
    #: The run key this machine joined or published the run under ("": none; node/published.py).
    run_key_id: str = ""

    def __post_init__(self) -> None:
        # Each part's own config checks its settings, here as when the part is built.
        self.discovery_config()
        self.transport(ServerLimits())
        self.directory()
        self.state_sync()
        self.rounds(budget_seconds=1.0)

    def transport(self, limits: ServerLimits) -> TransportConfig:
        return TransportConfig(
            host=self.host,
            port=self.port,
            public_host=self.public_host,
            limits=limits,
            upload_bytes_per_second=self.upload_bytes_per_second,
        )

    def discovery_config(self) -> DiscoveryConfig:
        return DiscoveryConfig(
            backend=self.discovery,
            initial_peers=self.bootstrap,
            host=self.host,
            network_secret=self.dht_secret,
            start_timeout_seconds=self.dht_start_timeout_seconds,
        )

    def directory(self) -> DirectoryConfig:
        return DirectoryConfig(
            record_ttl_seconds=self.record_ttl_seconds,
            announce_interval_seconds=self.announce_interval_seconds,
            run_key_id=self.run_key_id,
        )

    def state_sync(self) -> StateSyncConfig:
        return StateSyncConfig(
            download_timeout_seconds=self.state_download_timeout_seconds,
            max_donors=self.max_state_donors,
        )

    def rounds(self, *, budget_seconds: float) -> RoundsConfig:
        return RoundsConfig(
            bandwidth=self.bandwidth,
            reachability_wait_seconds=self.reachability_wait_seconds,
            budget_seconds=budget_seconds,
        )


def allreduce_config(spec: RunSpec) -> AllReduceConfig:
    averaging = spec.averaging
    return AllReduceConfig(
        run_id=spec.run.id,
        spec_hash=spec.hash,
        codec=averaging.codec,
        codec_options=averaging.codec_options,
        chunk_values=averaging.chunk_values,
        round_timeout_seconds=averaging.round_timeout_seconds,
        sender_timeout_seconds=averaging.sender_timeout_seconds,
        reducer_timeout_seconds=averaging.reducer_timeout_seconds,
        aggregator=spec.trust.effective_aggregator,
        uniform_weights=spec.trust.open,
        result_codec=averaging.result_codec or ("fp16" if spec.trust.open else ""),
        observe=spec.trust.open,
        spot_checks=spec.trust.spot_checks if spec.trust.open else 0,
    )


def round_budget_seconds(spec: RunSpec, config: SwarmConfig, *, dht_call_seconds: float) -> float:
    """The longest a round may take, as a trainer waits for it: the reachability wait (first
    round only), matchmaking (its timeout, the settle time, and the DHT calls at its edges: an
    announce, a read, a last read), the all-reduce, an open run's owner checks, and a little
    slack for the rest."""
    averaging = spec.averaging
    checks = CHECK_STEPS * CHECK_TIMEOUT_SECONDS if spec.trust.open else 0.0
    return (
        checks
        + config.reachability_wait_seconds
        + averaging.matchmaking_timeout_seconds
        + MATCHMAKING_SETTLE_SECONDS
        + 3 * dht_call_seconds
        + averaging.round_timeout_seconds
        + ROUND_SLACK_SECONDS
    )
