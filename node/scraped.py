"""What a node's metrics read at each scrape: the tallies its wire code keeps, the callables
that hand figures over, and the Prometheus collectors that turn them into series.

The code that counts (rounds, the directory, state sync, reachability, the relay) fills plain
:class:`Tallies` and :class:`Links` and knows nothing of Prometheus; ``metrics.py`` registers
the collectors below on a node's own registry (``NodeMetrics.read_*``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from swarmgrad.node.kinds import Failure, Link

#: Why a member or a round failed, as counted in ``swarmgrad_failures_total{kind=...}``.
FAILURE_KINDS = tuple(Failure)
TRAFFIC_KINDS = ("averaging", "state")
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


class LinkCollector(Collector):
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


class RelayCollector(Collector):
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


class TallyCollector(Collector):
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


class RejectionCollector(Collector):
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


class TrustCollector(Collector):
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


class StageCollector(Collector):
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
