"""``swarmgrad status --node``: a local node serves its view of the run's peers beside its
metrics, and status reads it without joining the DHT; a node that does not answer, or a page
that is not a node's (too big, the wrong shape), is refused with a reason."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from swarmgrad.node.cli import app
from swarmgrad.node.discovery.base import DiscoveryError, dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.metrics import NodeMetrics
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.status import (
    MAX_PAGE_BYTES,
    PEERS_PAGE,
    node_page_url,
    peers_page,
    read_node_page,
)

SPEC = RunSpec.from_toml('[run]\nid = "local"\n')
PEERS = [Identity.from_seed(f"status-node/{i}") for i in range(2)]


def _record(index: int) -> PeerRecord:
    return PeerRecord.create(PEERS[index].peer_id, run_id="local", spec_hash=SPEC.hash,
                             endpoint=f"127.0.0.1:{4000 + index}", now=dht_time(),
                             ttl_seconds=60, epoch=5 + index)  # fmt: skip


def _records() -> list[PeerRecord]:
    return [_record(i) for i in range(len(PEERS))]


@pytest.fixture
def node() -> Iterator[str]:
    """A node's metrics server with its peers page: its metrics address."""
    metrics = NodeMetrics(peer_id=PEERS[0].peer_id, run_id="local", spec_hash="ab",
                          algorithm="diloco", codec="int8")  # fmt: skip
    metrics.pages[PEERS_PAGE] = lambda: peers_page(SPEC, _records())
    server = metrics.serve("127.0.0.1:0")
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.close()


def test_status_reads_a_local_nodes_view_without_the_dht(node: str) -> None:
    for address in (node, f"http://{node}/metrics"):  # as its log gives it, too
        shown = CliRunner().invoke(app, ["status", "--node", address, "--json"])
        assert shown.exit_code == 0, shown.output
        document = json.loads(shown.output)
        assert document["run"] == "local"
        assert sorted(row["epoch"] for row in document["peers"]) == [5, 6]
    table = CliRunner().invoke(app, ["status", "--node", node], terminal_width=200)
    assert "run local: 2 peer(s)" in table.output
    with urllib.request.urlopen(f"http://{node}/metrics", timeout=10) as metrics:
        assert b"swarmgrad_" in metrics.read()  # the metrics still served beside it


def test_a_node_not_listening_is_said_plainly() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    shown = CliRunner().invoke(app, ["status", "--node", f"127.0.0.1:{port}"])
    assert shown.exit_code == 4
    assert f"the node at http://127.0.0.1:{port}{PEERS_PAGE} did not answer" in " ".join(
        shown.output.split()
    )


def _serving(body: bytes) -> tuple[ThreadingHTTPServer, str]:
    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize(
    "body",
    [
        b"<html>a web server, not a node</html>",
        json.dumps({"run": "x", "peers": [{"peer_id": "only that"}]}).encode(),
        json.dumps([1, 2, 3]).encode(),
        b'{"run": "x", "peers": [' + b'{"a": 1},' * (MAX_PAGE_BYTES // 9) + b"]}",
    ],
    ids=["html", "rows-missing-fields", "not-an-object", "bigger-than-the-cap"],
)
def test_a_page_that_is_not_a_nodes_is_refused(body: bytes) -> None:
    server, address = _serving(body)
    try:
        with pytest.raises(DiscoveryError):
            read_node_page(node_page_url(address), timeout_seconds=10)
    finally:
        server.shutdown()
        server.server_close()


def test_only_http_addresses_are_asked() -> None:
    assert node_page_url("127.0.0.1:9464") == f"http://127.0.0.1:9464{PEERS_PAGE}"
    with pytest.raises(ValueError, match="metrics address"):
        node_page_url("file:///etc/passwd")
