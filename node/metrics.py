"""A node's Prometheus metrics, on a registry of its own, and the HTTP endpoint that serves them.

Each :class:`Swarm` owns one :class:`NodeMetrics` (``swarm.metrics``): the swarm records rounds,
failures and state syncs; a trainer (the CLI's, or a researcher's loop through the same API)
records steps, loss and checkpoints. Byte and failure counters are read from the node's own tallies
when Prometheus scrapes (``scraped.py``), so the wire code knows nothing of Prometheus. A registry
per node, never the global default one: two nodes in one process (tests) would otherwise clash.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from swarmgrad.node.kinds import RoundOutcome
from swarmgrad.node.scraped import (
    FailureSource,
    LinkCollector,
    LinkSource,
    RejectionCollector,
    RejectionSource,
    RelayCollector,
    RelaySource,
    StageCollector,
    TallyCollector,
    TrafficSource,
    TrustCollector,
    TrustSource,
)
from swarmgrad.protocol.errors import SetupError

log = logging.getLogger(__name__)

ROUND_OUTCOMES = tuple(outcome.label for outcome in RoundOutcome)
_ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)


class NodeMetrics:
    """The metrics of one node; thread-safe (prometheus-client's instruments are)."""

    def __init__(self, *, peer_id: str, run_id: str, spec_hash: str, algorithm: str, codec: str):
        registry = self.registry = CollectorRegistry()
        #: JSON pages served beside ``/metrics``: path -> what to send (called per request, on
        #: the server's thread: it must only read).
        self.pages: dict[str, Callable[[], object]] = {}
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
        self.registry.register(TallyCollector(traffic, failures))

    def read_rejections(self, rejections: RejectionSource) -> None:
        """Read the counts of refused requests from ``rejections`` at every scrape."""
        self.registry.register(RejectionCollector(rejections))

    def read_trust(self, trust: TrustSource) -> None:
        """Read the trust ledger's scores, flags and bans from ``trust`` at every scrape."""
        self.registry.register(TrustCollector(trust))

    def read_stage(self, read: Callable[[], dict[str, Any]]) -> None:
        """A pipeline stage server: read its status (``node/pipeline/server.py``) at every
        scrape."""
        self.registry.register(StageCollector(read))

    def read_links(self, links: LinkSource) -> None:
        """Read reachability and relay figures from ``links`` at every scrape."""
        self.registry.register(LinkCollector(links))

    def read_relay(self, relay: RelaySource) -> None:
        """Read the counts of the relay this node offers from ``relay`` at every scrape."""
        self.registry.register(RelayCollector(relay))

    def serve(self, address: str) -> MetricsServer:
        """Serve ``/metrics`` (and :attr:`pages`) on ``host:port`` (port 0: any free port) in a
        daemon thread."""
        host, port = parse_address(address)
        try:
            server, thread = _start(host, port, _application(self.registry, self.pages))
        except OSError as error:
            raise OSError(
                f"cannot serve metrics on {address}: {error.strerror} (use another "
                f"--metrics-address, port 0 for any free port, or 'off')"
            ) from None
        return MetricsServer(server=server, thread=thread, host=host)


def _application(
    registry: CollectorRegistry, pages: dict[str, Callable[[], object]]
) -> Callable[..., Iterable[bytes]]:
    """Prometheus's exposition, and each of ``pages`` (path -> what to send as JSON)."""
    metrics = make_wsgi_app(registry)

    def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        page = pages.get(environ.get("PATH_INFO", ""))
        if page is None:
            return metrics(environ, start_response)
        body = json.dumps(page(), allow_nan=False).encode()
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(body))),
                                  ("Cache-Control", "no-store")])  # fmt: skip
        return [body]

    return application


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape a second is not news


def _start(
    host: str, port: int, application: Callable[..., Iterable[bytes]]
) -> tuple[WSGIServer, threading.Thread]:
    server: WSGIServer = make_server(
        host, port, application, _Server6 if ":" in host else _Server, _Quiet
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http")
    thread.start()
    return server, thread


#: Where ``metrics_address = "auto"`` serves when it can (Prometheus's port for exporters of
#: client libraries); a second node on the machine takes a free port instead.
AUTO_ADDRESS = "127.0.0.1:9464"


def _auto(metrics: NodeMetrics) -> MetricsServer:
    try:
        return metrics.serve(AUTO_ADDRESS)
    except OSError:
        log.info("metrics: %s is taken (another node here?); serving on a free port", AUTO_ADDRESS)
        return metrics.serve(AUTO_ADDRESS.rsplit(":", 1)[0] + ":0")


@contextlib.contextmanager
def serving(metrics: NodeMetrics, address: str) -> Iterator[MetricsServer | None]:
    """Serve ``metrics`` on ``address`` ("off": not at all) while the block runs; an address
    that cannot be served is a SetupError."""
    if address == "off":
        yield None
        return
    try:
        server = _auto(metrics) if address == "auto" else metrics.serve(address)
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
