"""``swarmgrad status``: a run's peers as the DHT shows them, read by a short-lived DHT node (a
pipeline's stage replicas too, with a row per stage), and from a node's status file what one node
of an open run thinks of each peer (``--scores``) or what a pipeline trainer saw of each stage
(``--traffic``). Status files are strict JSON: a number not known (NaN) is null there. A private
run's peers are those on its allowlist (the others are counted apart), and a pipeline that is not
private is flagged: its stage replicas are trusted."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from swarmgrad.node.discovery.base import Discovery, DiscoveryError, dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import start_reader
from swarmgrad.node.published import announced_spec, on_allowlist
from swarmgrad.node.runspec import RunSpec


@dataclass(frozen=True, slots=True)
class RunPeers:
    """A run's peers as the DHT shows them."""

    #: One per peer record of the run (a private run's: of the peers on its allowlist).
    rows: list[dict[str, Any]]
    #: Private runs: peer records of peers not on the allowlist, left out of ``rows``.
    not_on_allowlist: int = 0
    #: What the user must know about whom the run trusts (``RunSpec.warnings``).
    warnings: list[str] = field(default_factory=list)


async def run_peers(
    *,
    bootstrap: Sequence[str],
    run_id: str,
    spec: RunSpec | None,
    timeout_seconds: float,
    backend: str = "hivemind",
    network_secret: str = "",
) -> RunPeers:
    """The peers of ``run_id`` (of ``spec`` and its pipeline's stages, or of every spec in use),
    read once within ``timeout_seconds``."""
    async with asyncio.timeout(timeout_seconds):
        async with peer_reader(
            bootstrap,
            run_id=run_id,
            spec=spec,
            timeout_seconds=timeout_seconds,
            backend=backend,
            network_secret=network_secret,
        ) as read:
            return await read()


@contextlib.asynccontextmanager
async def peer_reader(
    bootstrap: Sequence[str],
    *,
    run_id: str,
    spec: RunSpec | None,
    timeout_seconds: float,
    backend: str = "hivemind",
    network_secret: str = "",
) -> AsyncIterator[Callable[[], Awaitable[RunPeers]]]:
    """A DHT reader joined once (``status --watch`` reads through it again and again): yields
    the coroutine function that reads the run's peers now. The reader joins with a throwaway
    identity and announces nothing; starting it is bounded by ``timeout_seconds``, each read is
    not (the caller bounds it)."""
    async with asyncio.timeout(timeout_seconds):
        discovery = await start_reader(
            bootstrap,
            backend=backend,
            network_secret=network_secret,
            timeout_seconds=timeout_seconds,
            run_id=run_id,
            spec_hash=spec.hash if spec is not None else bytes(32),
        )

    async def read() -> RunPeers:
        specs: list[tuple[str, RunSpec | None]]
        if spec is not None:
            specs = [(spec.hash.hex(), spec)]
        else:
            announced = await discovery.find_specs()
            specs = [(h, announced_spec(announced[h], h)) for h in sorted(announced)]
        rows, strangers, warnings = [], 0, []
        for spec_hash, each in specs:
            view = discovery.for_spec(bytes.fromhex(spec_hash))
            views = [view]
            if each is not None and spec is not None and each.pipeline.enabled:
                stages = [each.stage_spec(k) for k in range(each.pipeline.stages)]
                views += [discovery.for_run(stage.run.id, stage.hash) for stage in stages]
            found, left_out = await _members(view, views, each)
            rows += [_row(record, dht_time()) for record in found]
            strangers += left_out
            warnings += each.warnings() if each is not None else []
        return RunPeers(rows, not_on_allowlist=strangers, warnings=list(dict.fromkeys(warnings)))

    try:
        yield read
    finally:
        await discovery.close()


async def _members(
    run: Discovery, views: Sequence[Discovery], spec: RunSpec | None
) -> tuple[list[PeerRecord], int]:
    """The peer records under ``views``; in a private run, only the peers on the allowlist
    its run key sealed under ``run``, and how many were not."""
    records = [record for view in views for record in await view.find()]
    if spec is None or not spec.trust.private:
        return records, 0
    return on_allowlist(records, spec, await run.find_allowlists())


#: The largest peers page read from a node (a run of thousands of peers is ~1 MB).
MAX_PAGE_BYTES = 16 << 20
#: Where a node's metrics server answers with its view of the run's peers (``status --node``).
PEERS_PAGE = "/peers.json"
#: Where it answers with its own status: what ``--status-file`` holds (the run page's curves).
STATUS_PAGE = "/status.json"


def peers_page(spec: RunSpec, records: Sequence[PeerRecord]) -> dict[str, Any]:
    """What a node serves at :data:`PEERS_PAGE`: the run's peers as it last read them."""
    now = dht_time()
    return {"run": spec.run.id, "spec": spec.hash.hex(), "read_at": now,
            "peers": [_row(record, now) for record in records]}  # fmt: skip


#: What a row of the peers page must hold (what ``status`` prints of it).
_ROW_KEYS = frozenset(("peer_id", "spec", "role", "epoch", "throughput", "endpoint",
                       "reachability", "via", "punched", "last_seen_seconds"))  # fmt: skip


def node_page_url(address: str) -> str:
    """The peers page of the node whose metrics are at ``address`` (``host:port``, or the URL
    its log gives: ``http://127.0.0.1:9464/metrics``)."""
    address = address.strip().removesuffix("/").removesuffix("/metrics")
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise ValueError(f"--node takes a node's metrics address (host:port), not {address!r}")
    return address + PEERS_PAGE


def status_page_url(peers_url: str) -> str:
    """The status page of the node whose peers page is ``peers_url``."""
    return peers_url.removesuffix(PEERS_PAGE) + STATUS_PAGE


def read_page(url: str, timeout_seconds: float) -> Any:
    """A node's JSON page at ``url`` (at most :data:`MAX_PAGE_BYTES`); DiscoveryError if the node
    does not answer, or not with JSON."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as answer:
            body = answer.read(MAX_PAGE_BYTES + 1)
        if len(body) > MAX_PAGE_BYTES:
            raise ValueError(f"a page over {MAX_PAGE_BYTES >> 20} MiB")
        return json.loads(body)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise DiscoveryError(f"the node at {url} did not answer: {error}") from None


def read_node_page(url: str, timeout_seconds: float) -> tuple[str, RunPeers]:
    """The run id and the run's peers as the node serving ``url`` last read them; DiscoveryError
    if it does not answer, or answers with something else."""
    page = read_page(url, timeout_seconds)
    if (
        not isinstance(page, dict)
        or not isinstance(page.get("run"), str)
        or not isinstance(rows := page.get("peers"), list)
        or not all(isinstance(r, dict) and set(r) >= _ROW_KEYS for r in rows)
    ):
        raise DiscoveryError(f"{url} is not a swarmgrad node's peers page")
    return page["run"], RunPeers(rows)


@contextlib.asynccontextmanager
async def node_reader(
    url: str, timeout_seconds: float
) -> AsyncIterator[Callable[[], Awaitable[RunPeers]]]:
    """Like :func:`peer_reader`, from a local node's page: no DHT to join."""

    async def read() -> RunPeers:
        return (await asyncio.to_thread(read_node_page, url, timeout_seconds))[1]

    yield read


def _row(record: PeerRecord, now: float) -> dict[str, Any]:
    row = {
        "peer_id": record.peer_id,
        "spec": record.spec_hash[:12],
        "role": "stage" if record.stage >= 0 else record.role,
        "epoch": record.epoch,
        "throughput": record.throughput,
        "bandwidth": record.bandwidth,
        "endpoint": record.endpoint,
        "reachability": record.reachability,
        "via": record.via,
        "punched": record.punched,
        "checksum": record.checksum,
        "last_seen_seconds": max(0.0, now - record.issued_at),
        "expires_in_seconds": record.expires_at - now,
    }
    if record.stage >= 0:
        row["stage"] = {
            "index": record.stage,
            "span": [record.span_start, record.span_end],
            "state": record.state,
            "queue_depth": record.queue_depth,
            "version": record.version,
        }
    return row


def stage_summary(rows: list[dict[str, Any]], spans: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per stage of a pipeline (``spans``: each one's layers), from its replicas' rows: how many
    serve, their capacity (samples/s), versions and queued microbatches."""
    every = [r["stage"] | {"throughput": r["throughput"]} for r in rows if "stage" in r]
    summary = []
    for index, span in enumerate(spans):
        replicas = [r for r in every if r["index"] == index]
        serving = [r for r in replicas if r["state"] == "serving"]
        versions = [r["version"] for r in replicas]
        summary.append(
            {
                "stage": index,
                "layers": list(span),
                "replicas": len(replicas),
                "serving": len(serving),
                "capacity": sum(r["throughput"] for r in serving),
                "versions": [min(versions), max(versions)] if versions else [],
                "queued": sum(r["queue_depth"] for r in replicas),
            }
        )
    return summary


def stages_table(summary: list[dict[str, Any]]) -> Table:
    """The stage summary as a table; a stage with no replica serving is marked."""
    table = Table(title=f"pipeline: {len(summary)} stages")
    columns = ("stage", "layers", "serving", "samples/s", "versions", "queued")
    for column in columns:
        table.add_column(column, justify="left" if column == "layers" else "right")
    for row in summary:
        start, end = row["layers"]
        versions = row["versions"]
        table.add_row(
            str(row["stage"]),
            f"{start}..{end - 1}",
            f"{row['serving']} of {row['replicas']}" if row["serving"] else "[bold red]none[/]",
            f"{row['capacity']:.1f}",
            f"{versions[0]}..{versions[1]}" if versions else "-",
            str(row["queued"]),
        )
    return table


def read_traffic(path: Path) -> dict[str, Any]:
    """What a pipeline trainer's ``--status-file`` says of each stage: bytes per sample each
    way, retries, resends, failures, samples lost to failed steps."""
    status = _status_file(path, "stages", list, "a pipeline trainer's")
    return {
        "trainer": status.get("peer_id", ""),
        "step": status.get("step", 0),
        "samples": status.get("samples", 0),
        "stages": status["stages"],
    }


def traffic_table(traffic: dict[str, Any]) -> Table:
    """A trainer's view of each stage as a table."""
    table = Table(
        title=f"stages as trainer {traffic['trainer']} saw them: step {traffic['step']}, "
        f"{traffic['samples']} samples"
    )
    columns = ("stage", "up B/sample", "down B/sample", "calls", "retries", "resends", "lost")
    for column in columns:
        table.add_column(column, justify="right")
    table.add_column("failures", justify="left")
    for index, stage in enumerate(traffic["stages"]):
        failures = ", ".join(f"{k} {v}" for k, v in stage.get("failures", {}).items())
        table.add_row(
            str(index),
            _cell(stage.get("bytes_up_per_sample"), ",.0f"),
            _cell(stage.get("bytes_down_per_sample"), ",.0f"),
            str(stage.get("calls", 0)),
            str(stage.get("retries", 0)),
            str(stage.get("resends", 0)),
            str(stage.get("lost_samples", 0)),
            failures or "-",
        )
    return table


class ScoresError(ValueError):
    """A node's status file that cannot be read, or holds no scores."""


def read_scores(path: Path) -> dict[str, Any]:
    """What a node's ``--status-file`` says of its peers in an open run: its peer id, its
    ledger's row per peer (rounds, clip and cosine EMAs, flags, disputes, ban), its owner
    checks (checked, failed), and what it made of the ban records other nodes published."""
    status = _status_file(path, "trust", dict, "a node's")
    return {
        "node": status.get("peer_id", ""),
        "epoch": status.get("epoch"),
        "peers": status["trust"],
        "owner_checks": status.get("owner_checks", {}),
        "ban_records": status.get("ban_records", {}),
    }


def _status_file(path: Path, section: str, kind: type, whose: str) -> dict[str, Any]:
    """The status file at ``path``, if it has ``section`` (of type ``kind``); ScoresError if not."""
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ScoresError(f"cannot read the status file {path}: {error}") from None
    if not isinstance(status, dict) or not isinstance(status.get(section), kind):
        raise ScoresError(f"{path} is not {whose} status file (no {section} section)")
    return status


def scores_table(scores: dict[str, Any]) -> Table:
    """The scores as a table, worst first (banned, then by cosine)."""
    checks = scores["owner_checks"]
    table = Table(
        title=f"scores by {scores['node']} at epoch {scores['epoch']}: "
        f"{checks.get('checked', 0)} owner results checked, {checks.get('failed', 0)} failed; "
        f"{scores.get('ban_records', {}).get('adopted', 0)} bans adopted from published evidence"
    )
    for column in ("peer", "rounds", "clip", "cosine", "loss gain", "flags", "disputes", "banned"):
        table.add_column(
            column,
            justify="right" if column in ("rounds", "clip", "cosine", "loss gain") else "left",
        )
    rows = sorted(
        scores["peers"].items(),
        key=lambda item: (not item[1].get("banned"), item[1].get("cosine_ema") or 0.0),
    )
    for peer, row in rows:
        ban = row.get("banned")
        flags = ", ".join(f"{k} {v}" for k, v in row.get("flags", {}).items())
        table.add_row(
            peer,
            str(row.get("rounds", 0)),
            _cell(row.get("clip_ema"), ".2f"),
            _cell(row.get("cosine_ema"), ".2f"),
            _gain_cell(row),
            flags or "-",
            str(row.get("disputes", 0)),
            _ban_cell(ban),
        )
    return table


def _cell(value: float | None, spec: str) -> str:
    """A number as a cell; "-" where the status file has none (null: not known)."""
    return "-" if value is None else format(value, spec)


def _gain_cell(row: dict[str, Any]) -> str:
    """The spot checks' loss gain EMA, and how many there were."""
    gain = row.get("loss_gain_ema")
    return "-" if gain is None else f"{gain:+.4f} ({row.get('spot_checks', 0)})"


def _ban_cell(ban: dict[str, Any] | None) -> str:
    """A ban as a cell: its round and reason, whether it carries evidence, and the peer it was
    adopted from (a ban read in the DHT)."""
    if not ban:
        return "-"
    cell = f"round {ban['round']}: {ban['reason']}"
    if ban.get("source"):
        cell += f" (evidence from {str(ban['source'])[:16]}…)"
    elif ban.get("evidence"):
        cell += " (evidence published)"
    return cell
