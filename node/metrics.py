"""A node's Prometheus metrics, on a registry of its own, and the HTTP endpoint that serves them.

Each :class:`Swarm` owns one :class:`NodeMetrics` (``swarm.metrics``): the swarm records rounds,
failures and state syncs; a trainer (the CLI's, or a researcher's loop through the same API)
records steps, loss and checkpoints. Byte and failure counters are read from the node's own tallies
when Prometheus scrapes, so the wire code knows nothing of Prometheus. A registry per node, never
the global default one: two nodes in one process (tests) would otherwise clash.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from swarmgrad.node.kinds import Failure, Link, RoundOutcome
from swarmgrad.protocol.errors import SetupError

log = logging.getLogger(__name__)

#: Why a member or a round failed, as counted in ``swarmgrad_failures_total{kind=...}``.
FAILURE_KINDS = tuple(Failure)
ROUND_OUTCOMES = tuple(outcome.label for outcome in RoundOutcome)
TRAFFIC_KINDS = ("averaging", "state")
_ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)
#: Open runs: per-peer score series cover the peers seen in this many of the latest rounds
#: (ids come and go; a series per id ever seen would grow the scrape without end).
PEER_SERIES_ROUNDS = 100

#: (direction, kind) -> bytes so far; direction is "sent" or "received".
TrafficSource = Callable[[], Mapping[tuple[str, str], int]]
#: kind -> failures so far (kinds from FAILURE_KINDS).
FailureSource = Callable[[], Mapping[str, int]]
#: (service, result code name) -> requests this node's services refused so far.
RejectionSource = Callable[[], Mapping[tuple[str, str], int]]
#: How peers reach this node and how it reaches them: see :meth:`NodeMetrics.read_links`.
LinkSource = Callable[[], "Links"]
#: How this node reaches its peers, and how it is reached.
LINK_KINDS = tuple(Link)
#: The relay this node offers: its clients and connections refused ("refused: <why>"), clients
#: evicted ("evicted: <why>"), and reads held back by a client's byte budget ("throttled").
RelaySource = Callable[[], Mapping[str, int]]


class Tallies:
    """What happened to this node, by event ("aborted", "state downloads", ...), and its
    failures by kind (:data:`FAILURE_KINDS`): one call per event keeps the two in step."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()

    def count(self, event: str) -> None:
        self.counts[event] += 1

    def failed(self, event: str, kind: Failure) -> None:
        """Count ``event`` and a failure of ``kind`` (one of :data:`FAILURE_KINDS`)."""
        self.counts[event] += 1
        self.failures[kind] += 1


@dataclass(frozen=True, slots=True)
class Links:
    reachability: str  # this node's
    peers: Mapping[str, int]  # the other peers, by their reachability
    relay_clients: int  # peers this node relays for
    relayed_bytes: int  # bytes it carried for them, both ways


class _LinkTallies(Collector):
    def __init__(self, links: LinkSource) -> None:
        self._links = links

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        links = self._links()
        mine = GaugeMetricFamily(
            "swarmgrad_reachability",
            "How peers reach this node's endpoint (1 for the current kind).",
            labels=["kind"],
        )
        peers = GaugeMetricFamily(
            "swarmgrad_peer_links",
            "Known peers by how this node reaches them: direct, upnp, relayed, unreachable.",
            labels=["kind"],
        )
        for kind in LINK_KINDS:
            mine.add_metric([kind], float(kind == links.reachability))
            peers.add_metric([kind], float(links.peers.get(kind, 0)))
        yield mine
        yield peers
        yield GaugeMetricFamily(
            "swarmgrad_relay_clients",
            "Unreachable peers this node relays connections for.",
            value=links.relay_clients,
        )
        yield CounterMetricFamily(
            "swarmgrad_relayed_bytes",
            "Bytes this node carried for its relay clients, both ways.",
            value=links.relayed_bytes,
        )


class _RelayTallies(Collector):
    def __init__(self, relay: RelaySource) -> None:
        self._relay = relay

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self._relay()
        families = {
            "refused": CounterMetricFamily(
                "swarmgrad_relay_refusals",
                "Peers and connections this node's relay refused, by reason (no live record in "
                "this run, not on the allowlist, full, protocol, ...).",
                labels=["reason"],
            ),
            "evicted": CounterMetricFamily(
                "swarmgrad_relay_evictions",
                "Clients this node's relay evicted, by reason (idle, over its byte budget).",
                labels=["reason"],
            ),
        }
        for key, count in sorted(counts.items()):
            kind, _, reason = key.partition(": ")
            if kind in families and reason:
                families[kind].add_metric([reason], float(count))
        yield from families.values()
        yield CounterMetricFamily(
            "swarmgrad_relay_throttled_reads",
            "Reads this node's relay held back until a client's byte budget refilled.",
            value=counts.get("throttled", 0),
        )


class _Tallies(Collector):
    """Byte and failure counters read, at each scrape, from where the node keeps them."""

    def __init__(self, traffic: TrafficSource, failures: FailureSource) -> None:
        self._traffic, self._failures = traffic, failures

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals = self._traffic()
        for direction in ("sent", "received"):
            family = CounterMetricFamily(
                f"swarmgrad_{direction}_bytes",
                f"Payload bytes {direction} by this node, by kind of traffic.",
                labels=["kind"],
            )
            for kind in TRAFFIC_KINDS:
                family.add_metric([kind], float(totals.get((direction, kind), 0)))
            yield family
        failures = self._failures()
        family = CounterMetricFamily(
            "swarmgrad_failures", "Failures by kind; each is survived, not fatal.", labels=["kind"]
        )
        for kind in FAILURE_KINDS:
            family.add_metric([kind], float(failures.get(kind, 0)))
        yield family


class _Rejections(Collector):
    def __init__(self, rejections: RejectionSource) -> None:
        self._rejections = rejections

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "swarmgrad_rejected_requests",
            "Requests from peers this node refused, by service and result code (UNAUTHENTICATED:"
            " unsigned, forged or replayed; BAD_PAYLOAD: malformed; ...).",
            labels=["service", "code"],
        )
        for (service, code), count in sorted(self._rejections().items()):
            family.add_metric([service, code], float(count))
        yield family


#: Per peer (the ledger's table), and (flags by kind, bans by reason, owner checks by result,
#: published evidence read by outcome).
TrustSource = Callable[[], tuple[Mapping[str, Mapping[str, object]], "TrustCounts"]]
TrustCounts = tuple[Mapping[str, int], Mapping[str, int], Mapping[str, int], Mapping[str, int]]


def _counts(
    name: str, help_text: str, counts: Mapping[str, int], results: Sequence[str]
) -> CounterMetricFamily:
    """A counter of ``counts`` by ``result`` label, every one of ``results`` shown (0 if none)."""
    family = CounterMetricFamily(name, help_text, labels=["result"])
    for result in results:
        family.add_metric([result], float(counts.get(result, 0)))
    return family


class _Trust(Collector):
    """Open runs: what this node's trust ledger thinks of each peer it aggregated."""

    def __init__(self, trust: TrustSource) -> None:
        self._trust = trust

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        table, (flags, bans, checks, evidence) = self._trust()
        family = CounterMetricFamily(
            "swarmgrad_trust_flags",
            "Members' updates flagged by this node as an owner, by kind (zero, non_finite, "
            "scale, misaligned, clipped, replay, duplicate).",
            labels=["kind"],
        )
        for kind, count in sorted(flags.items()):
            family.add_metric([str(kind)], float(count))
        yield family
        yield _counts(
            "swarmgrad_owner_checks",
            "Owners' results this node checked with its group after open rounds, by result "
            "(checked: passed or failed; failed: dropped, the owner convicted), and the parts "
            "it audited (audit_passed, audit_failed: someone convicted, audit_inconclusive: "
            "the owner did not answer).",
            checks,
            ("checked", "failed", "audit_passed", "audit_failed", "audit_inconclusive"),
        )
        yield _counts(
            "swarmgrad_ban_evidence",
            "Evidence in other nodes' published ban records, by what this node made of it "
            "(adopted: a ban; known: already held; rejected: proves nothing; against_me), and "
            "this node's own records published.",
            evidence,
            ("adopted", "known", "rejected", "against_me", "published"),
        )
        banned = GaugeMetricFamily(
            "swarmgrad_banned_peers", "Peers this node no longer averages with, by reason.",
            labels=["reason"],
        )  # fmt: skip
        for reason, count in sorted(bans.items()):
            banned.add_metric([reason], float(count))
        yield banned
        seen = {peer: row.get("seen_round") for peer, row in table.items()}
        newest = max((r for r in seen.values() if isinstance(r, int)), default=0)
        recent = sorted(
            (peer, table[peer])
            for peer, r in seen.items()
            if isinstance(r, int) and r > newest - PEER_SERIES_ROUNDS
        )
        for name, key, help_text in (
            ("swarmgrad_peer_clip_ema", "clip_ema",
             "EMA of a peer's CenteredClip coefficient (1: like its peers)."),
            ("swarmgrad_peer_cosine_ema", "cosine_ema",
             "EMA of a peer's cosine to the others (1: like its peers)."),
            ("swarmgrad_peer_loss_gain_ema", "loss_gain_ema",
             "EMA of the loss a peer's values took off in this node's spot checks (positive: "
             "its update helps; node/training/spot_check.py)."),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, help_text, labels=["peer"])
            for peer, row in recent:
                if row.get(key) is not None:  # a peer never spot-checked has no loss gain
                    gauge.add_metric([peer], float(row[key]))  # type: ignore[arg-type]
            yield gauge


class _Stage(Collector):
    """A pipeline stage server: its stage's numbers, read from its status at every scrape."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        status = self._read()
        stage = [str(status["stage"])]
        for name, key, help_text in (
            ("swarmgrad_stage_version", "version", "Inner steps this stage replica took."),
            ("swarmgrad_stage_samples_per_second", "samples_per_second",
             "This replica's throughput: samples over their backwards' compute seconds."),
            ("swarmgrad_stage_parameter_bytes", "parameter_bytes",
             "Bytes of parameters this replica holds (its layer span)."),
            ("swarmgrad_stage_queue_depth", "queue_depth", "Requests waiting for compute."),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, help_text, labels=["stage"])
            gauge.add_metric(stage, float(status[key]))
            yield gauge
        work = CounterMetricFamily(
            "swarmgrad_stage_work",
            "What this replica computed, by kind (forwards, backwards, recomputed: backwards "
            "from resent inputs, duplicates, need_inputs: refused for want of inputs, samples: "
            "accumulated into inner steps).",
            labels=["stage", "kind"],
        )
        for kind in ("forwards", "backwards", "recomputed", "duplicates", "need_inputs", "samples"):
            work.add_metric([*stage, kind], float(status["stats"][kind]))
        yield work
        payload = CounterMetricFamily(
            "swarmgrad_stage_payload_bytes",
            "Tensor payload bytes this replica received (in) and sent (out), by kind.",
            labels=["stage", "direction", "kind"],
        )
        for direction in ("in", "out"):
            for kind, count in sorted(status[f"bytes_{direction}"].items()):
                payload.add_metric([*stage, direction, kind], float(count))
        yield payload


class NodeMetrics:
    """The metrics of one node; thread-safe (prometheus-client's instruments are)."""

    def __init__(self, *, peer_id: str, run_id: str, spec_hash: str, algorithm: str, codec: str):
        registry = self.registry = CollectorRegistry()
        info = Gauge(
            "swarmgrad_node_info",
            "Constant 1, labelled with what this node is.",
            ["peer_id", "run_id", "spec_hash", "algorithm", "codec"],
            registry=registry,
        )
        info.labels(peer_id, run_id, spec_hash, algorithm, codec).set(1)
        self.rounds = Counter(
            "swarmgrad_rounds",
            "Rounds (DiLoCo outer rounds, sync global steps) by outcome.",
            ["outcome"],
            registry=registry,
        )
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome)
        self.epoch = Gauge("swarmgrad_epoch", "Epoch of this node's replica.", registry=registry)
        self.inner_steps = Counter(
            "swarmgrad_inner_steps", "Local training steps (forward + backward).", registry=registry
        )
        self.samples = Counter(
            "swarmgrad_samples", "Training samples processed here.", registry=registry
        )
        self.tokens = Counter(
            "swarmgrad_tokens", "Training tokens processed here.", registry=registry
        )
        self.tokens_per_second = Gauge(
            "swarmgrad_tokens_per_second",
            "Training tokens per second since the node started.",
            registry=registry,
        )
        self.mfu = Gauge(
            "swarmgrad_mfu",
            "Model FLOPs utilization: 6 x parameters x tokens/s over the device's dense bf16 "
            "peak (NaN where the peak is unknown, e.g. on a CPU).",
            registry=registry,
        )
        self.train_loss = Gauge(
            "swarmgrad_train_loss", "Moving average of the training loss.", registry=registry
        )
        self.validation_loss = Gauge(
            "swarmgrad_validation_loss",
            "Loss on held-out data after the last round.",
            registry=registry,
        )
        self.round_duration = Histogram(
            "swarmgrad_round_duration_seconds",
            "Time spent in a round: matchmaking, all-reduce, outer step (or a state download).",
            buckets=_ROUND_BUCKETS,
            registry=registry,
        )
        self.compression_ratio = Gauge(
            "swarmgrad_compression_ratio",
            "fp32 bytes per encoded byte of the run's codec.",
            registry=registry,
        )
        self.group_size = Gauge(
            "swarmgrad_group_size", "Members of the last round's group.", registry=registry
        )
        self.peers = Gauge(
            "swarmgrad_peers", "The run's peers known from the DHT (this one included).",
            registry=registry,
        )  # fmt: skip
        self.state_sync_duration = Histogram(
            "swarmgrad_state_sync_duration_seconds",
            "Time to download the swarm's state from a peer.",
            buckets=_ROUND_BUCKETS,
            registry=registry,
        )
        self.checkpoints = Counter(
            "swarmgrad_checkpoints", "Checkpoints written.", registry=registry
        )
        self.checkpoint_failures = Counter(
            "swarmgrad_checkpoint_failures",
            "Checkpoints that could not be written (a full disk): training went on.",
            registry=registry,
        )
        self.checkpoint_duration = Histogram(
            "swarmgrad_checkpoint_duration_seconds",
            "Time to write (and fsync) one checkpoint.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )

    def read_tallies(self, *, traffic: TrafficSource, failures: FailureSource) -> None:
        """Read byte and failure counters from these callables at every scrape."""
        self.registry.register(_Tallies(traffic, failures))

    def read_rejections(self, rejections: RejectionSource) -> None:
        """Read the counts of refused requests from ``rejections`` at every scrape."""
        self.registry.register(_Rejections(rejections))

    def read_trust(self, trust: TrustSource) -> None:
        """Read the trust ledger's scores, flags and bans from ``trust`` at every scrape."""
        self.registry.register(_Trust(trust))

    def read_stage(self, read: Callable[[], dict[str, Any]]) -> None:
        """A pipeline stage server: read its status (``node/pipeline/server.py``) at every
        scrape."""
        self.registry.register(_Stage(read))

    def read_links(self, links: LinkSource) -> None:
        """Read reachability and relay figures from ``links`` at every scrape."""
        self.registry.register(_LinkTallies(links))

    def read_relay(self, relay: RelaySource) -> None:
        """Read the counts of the relay this node offers from ``relay`` at every scrape."""
        self.registry.register(_RelayTallies(relay))

    def serve(self, address: str) -> MetricsServer:
        """Serve ``/metrics`` on ``host:port`` (port 0: any free port) in a daemon thread."""
        host, port = parse_address(address)
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            raise OSError(
                f"cannot serve metrics on {address}: {error.strerror} (use another "
                f"--metrics-address, port 0 for any free port, or 'off')"
            ) from None
        return MetricsServer(server=server, thread=thread, host=host)


@contextlib.contextmanager
def serving(metrics: NodeMetrics, address: str) -> Iterator[MetricsServer | None]:
    """Serve ``metrics`` on ``address`` ("off": not at all) while the block runs; an address
    that cannot be served is a SetupError."""
    if address == "off":
        yield None
        return
    try:
        server = metrics.serve(address)
    except (OSError, ValueError) as error:
        raise SetupError(str(error)) from None
    log.info("metrics on %s", server.url)
    try:
        yield server
    finally:
        server.close()


@dataclass(frozen=True, slots=True)
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread
    host: str

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as a pair; ValueError says what is wrong."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected host:port (e.g. 127.0.0.1:9464), got {address!r}")
    return host, int(port)
