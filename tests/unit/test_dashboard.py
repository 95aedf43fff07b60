"""The run page's server and what it shows: each peer's share of a round's parts by how it is
reached, a node's rounds split by where the time went, strict JSON whatever a record holds, and
a server that serves its own files and nothing else. (The page itself, in a real browser on a
live swarm: tests/integration/test_observing.py.)"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.node.dashboard.server import (
    DashboardError,
    RunState,
    application,
    keep_reading,
    serving,
)
from swarmgrad.node.dashboard.view import MAX_ROUNDS, node_view, run_view, status_view
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.status import RunPeers


def _row(peer: str, reach: str, *, bandwidth: float = 1.0, throughput: float = 10.0) -> dict:
    return {"peer_id": peer, "reachability": reach, "bandwidth": bandwidth,
            "throughput": throughput, "role": "trainer", "epoch": 3, "via": "",
            "last_seen_seconds": 1.0}  # fmt: skip


def _status(tmp_path: Path, **fields: Any) -> Path:
    history = [
        {"epoch": 1, "outcome": "averaged", "val_loss": 6.0, "train_loss": 6.2, "samples": 80,
         "round_seconds": 2.0, "allreduce_seconds": 0.5, "outer_seconds": 0.1, "group_size": 3},
        {"epoch": 2, "outcome": "resynced", "val_loss": 5.5, "round_seconds": 0.2},
    ]  # fmt: skip
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"peer_id": "sgme", "epoch": 2, "history": history} | fields))
    return path


def test_shares_follow_reachability_and_bandwidth_and_trust_comes_from_the_node() -> None:
    state = RunState(run_id="demo")
    state.peers = RunPeers(
        [_row("a", "direct", bandwidth=2.0), _row("b", "relayed", bandwidth=10.0),
         _row("c", "unreachable"), _row("d", "no such kind"), _row("e", "direct")]
    )  # fmt: skip
    node = {"trust": {"b": {"cosine_ema": 0.9, "banned": None}}}
    shown = run_view(state, node)
    shares = {row["peer_id"]: row["share"] for row in shown["peers"]}
    assert shares == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.0, "d": 0.0, "e": 0.25})
    assert [row["trust"] for row in shown["peers"]][:2] == [None, {"cosine_ema": 0.9,
                                                                    "banned": None}]  # fmt: skip
    assert shown["samples_per_second"] == 50.0


def test_a_record_holding_nan_or_infinity_still_gives_strict_json() -> None:
    state = RunState(run_id="demo")
    state.peers = RunPeers([_row("a", "direct", throughput=math.nan),
                            _row("b", "direct", bandwidth=math.inf)])  # fmt: skip
    text = json.dumps(run_view(state, None), allow_nan=False)
    shown = json.loads(text)
    assert shown["peers"][0]["throughput"] is None
    assert shown["samples_per_second"] is None


def test_a_nodes_rounds_are_split_by_where_the_time_went(tmp_path: Path) -> None:
    node = node_view(_status(tmp_path))
    first, second = node["rounds"]
    assert first["matchmaking_seconds"] == pytest.approx(1.4)  # 2.0 - 0.5 - 0.1
    assert (first["outcome"], second["outcome"]) == ("averaged", "resynced")
    assert second["matchmaking_seconds"] == pytest.approx(0.2)
    long = [{"epoch": k, "round_seconds": 1.0} for k in range(MAX_ROUNDS + 7)]
    node = node_view(_status(tmp_path, history=long))
    assert len(node["rounds"]) == MAX_ROUNDS
    assert node["rounds"][0]["epoch"] == 7  # the newest kept


def test_a_status_file_not_there_or_not_a_nodes_says_so(tmp_path: Path) -> None:
    assert "cannot read the status file" in node_view(tmp_path / "none.json")["error"]
    (tmp_path / "other.json").write_text('{"trust": {}}')
    assert "no history" in node_view(tmp_path / "other.json")["error"]


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read()
    except urllib.error.HTTPError as error:
        error.close()
        return error.code, "", b""


async def test_the_server_serves_the_page_plotly_and_the_run_and_nothing_else(
    tmp_path: Path,
) -> None:
    state = RunState(run_id="demo", status_file=_status(tmp_path))
    state.peers = RunPeers([_row("a", "direct")])
    async with serving(application(state, refresh_seconds=2), "127.0.0.1", 0) as url:
        code, kind, body = await asyncio.to_thread(_get, url)
        assert (code, kind.split(";")[0]) == (200, "text/html")
        assert b'data-refresh-ms="2000"' in body
        assert b'<script src="plotly.min.js">' in body
        code, kind, body = await asyncio.to_thread(_get, url + "plotly.min.js")
        assert code == 200
        assert b"plotly" in body[:2000].lower()
        code, kind, body = await asyncio.to_thread(_get, url + "api/run")
        shown = json.loads(body)
        assert (shown["run"], shown["node"]["peer_id"]) == ("demo", "sgme")
        for path in ("../pyproject.toml", "%2e%2e/server.py", "server.py", "view.py", "x.html"):
            assert (await asyncio.to_thread(_get, url + path))[0] == 404, path
        request = urllib.request.Request(url + "api/run", data=b"x" * 4096, method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(urllib.request.urlopen, request, timeout=10)
        refused.value.close()
        assert refused.value.code == 405


async def test_a_port_in_use_is_refused_with_a_reason() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = application(RunState(run_id="demo"), refresh_seconds=2)
        with pytest.raises(DashboardError, match=f"cannot serve the run page on 127.0.0.1:{port}"):
            async with serving(app, "127.0.0.1", port):
                pass


async def test_a_read_that_fails_keeps_the_last_good_one_and_says_why() -> None:
    state, stop = RunState(run_id="demo"), asyncio.Event()
    answers: list[Any] = [RunPeers([_row("a", "direct")]), DiscoveryError("bootstrap gone")]

    async def peers() -> RunPeers:
        answer = answers.pop(0) if answers else None
        if answer is None:
            stop.set()
            raise TimeoutError
        if isinstance(answer, Exception):
            raise answer
        return answer

    async with asyncio.timeout(30):
        await keep_reading(state, peers, refresh_seconds=0.01, timeout_seconds=5, stop=stop)
    assert state.peers is not None
    assert [row["peer_id"] for row in state.peers.rows] == ["a"]
    assert state.reads == 1
    assert "no answer" in state.error or "DHT" in state.error


def test_a_status_holding_what_is_not_a_number_gives_none_not_an_error() -> None:
    odd = {"history": [{"epoch": "1; drop", "round_seconds": "2", "allreduce_seconds": math.nan,
                        "outcome": "<b>x</b>" * 100, "val_loss": True}, "not a round"]}  # fmt: skip
    (entry,) = status_view(odd, "a page")["rounds"]
    assert [entry[k] for k in ("epoch", "round_seconds", "allreduce_seconds", "val_loss")] == [
        None, None, None, None,
    ]  # fmt: skip
    assert entry["matchmaking_seconds"] == 0.0
    assert len(entry["outcome"]) == 40  # text, cut; the page writes it as text only
    assert status_view({"error": "no round yet"}, "node x") == {"error": "node x: no round yet"}
    assert "no history" in status_view([1, 2], "node x")["error"]


async def test_with_a_nodes_address_its_curves_come_from_its_metrics_server(
    tmp_path: Path,
) -> None:
    """``dashboard --node``: the node's status page, read with its peers at each refresh."""
    from swarmgrad.node.metrics import NodeMetrics
    from swarmgrad.node.status import STATUS_PAGE

    status = json.loads(_status(tmp_path).read_text())
    metrics = NodeMetrics(peer_id="sgme", run_id="demo", spec_hash="ab", algorithm="diloco",
                          codec="int8")  # fmt: skip
    metrics.pages[STATUS_PAGE] = lambda: status
    server = metrics.serve("127.0.0.1:0")
    state, stop = RunState(run_id="demo", status_url=server.url.removesuffix("/metrics")
                           + STATUS_PAGE), asyncio.Event()  # fmt: skip

    read_before_peers: list[bool] = []

    async def peers() -> RunPeers:
        # A page that shows the peers shows the node too: its page is read first.
        read_before_peers.append(state.node_status is not None)
        stop.set()
        return RunPeers([_row("sgme", "direct")])

    try:
        async with asyncio.timeout(30):
            await keep_reading(state, peers, refresh_seconds=0.01, timeout_seconds=5, stop=stop)
        assert read_before_peers == [True]
        node = state.document()["node"]
        assert node["peer_id"] == "sgme"
        assert [r["epoch"] for r in node["rounds"]] == [1, 2]
        assert node["rounds"][0]["matchmaking_seconds"] == pytest.approx(1.4)
        server.close()
        stop.clear()
        async with asyncio.timeout(30):
            await keep_reading(state, peers, refresh_seconds=0.01, timeout_seconds=5, stop=stop)
        assert "did not answer" in state.document()["node"]["error"]  # the node went away
    finally:
        server.close()
