"""Watching a 3-node local swarm train: a real Prometheus server scrapes it and the round and
byte counters it stores rise; what the nodes expose passes ``promtool check metrics``;
``swarmgrad status`` lists the peers from the DHT (and from a node's own view); and the run
page (``swarmgrad dashboard``), loaded in a real headless browser, draws the run's peers and a
node's loss curve and rounds (its screenshot kept in .pytest_cache/artefacts/)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate
from tests.helpers import light, wait_for_pattern

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/setup.sh dev installs it with apt-get)")
    return path


def _wait_for(pattern: str, path: Path, deadline: float) -> re.Match[str]:
    return wait_for_pattern(path, pattern, timeout_seconds=deadline - time.monotonic())


def _swarmgrad(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmgrad.node.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )


def _query(prometheus: str, promql: str) -> dict[str, float]:
    """Instant query: ``{instance: value}``."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return {r["metric"]["instance"]: float(r["value"][1]) for r in body["data"]["result"]}


def test_prometheus_and_status_see_the_swarm_train(tmp_path: Path) -> None:
    prometheus_bin, promtool = _binary("prometheus"), _binary("promtool")
    spec = tmp_path / "run.toml"
    spec.write_text(light(DEMO_SPEC).replace("group_size = 256", "group_size = 3"))
    out = tmp_path / "sim"
    result: dict[str, Any] = {}
    # The nodes stay in the swarm until status has seen them (on a busy machine the 20 rounds
    # can end before the checks below do); 20 rounds: the counters rise for Prometheus to see.
    seen = threading.Event()

    def run() -> None:
        try:
            result["summary"] = simulate(
                SimulationConfig(
                    nodes=3, rounds=20, spec_path=spec, profile_path=None, out_dir=out, hold=seen
                )
            )
        except Exception as error:  # reported by the main thread
            result["error"] = error

    swarm = threading.Thread(target=run)
    swarm.start()
    prometheus: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 120
        urls = [
            _wait_for(r"metrics on (http://\S+/metrics)", out / f"node-{i}.log", deadline)[1]
            for i in range(3)
        ]
        targets = [urllib.parse.urlparse(u).netloc for u in urls]
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: swarmgrad\n"
            f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
        )
        log = tmp_path / "prometheus.log"
        with log.open("w") as stderr:
            prometheus = subprocess.Popen(
                [
                    prometheus_bin,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    "--web.listen-address=127.0.0.1:0",
                ],
                stdout=stderr,
                stderr=stderr,
                text=True,
            )
        address = _wait_for(r'msg="Listening on" address=(\S+)', log, deadline)[1]
        api = f"http://{address}"

        # What the nodes expose is valid exposition format.
        with urllib.request.urlopen(urls[0], timeout=5) as response:
            exposition = response.read()
        checked = subprocess.run(
            [promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=30
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr

        # Through Prometheus: both nodes up, and their counters rising while they train.
        first: dict[str, dict[str, float]] = {}
        rose: set[tuple[str, str]] = set()
        queries = {
            "rounds": 'swarmgrad_rounds_total{outcome="averaged"}',
            "sent": 'swarmgrad_sent_bytes_total{kind="averaging"}',
            "received": 'swarmgrad_received_bytes_total{kind="averaging"}',
        }
        while len(rose) < len(queries) * len(targets):
            assert time.monotonic() < deadline, f"counters that rose: {sorted(rose)}"
            assert "error" not in result, result.get("error")
            if _query(api, "up") == dict.fromkeys(targets, 1.0):
                for name, promql in queries.items():
                    for instance, value in _query(api, promql).items():
                        start = first.setdefault(name, {}).setdefault(instance, value)
                        if value > start:
                            rose.add((name, instance))
            time.sleep(0.5)
        assert set(first["rounds"]) == set(targets)

        # Requests a node refuses are counted by service and code, and exported.
        endpoint = _wait_for(r"gRPC (\S+);", out / "node-0.log", deadline)[1]
        sent = {"Peer": "/swarmgrad.v1.Peer/GetInfo", "State": "/swarmgrad.v1.State/Manifest"}
        with grpc.insecure_channel(endpoint) as channel:
            for method in [sent["Peer"]] * 3 + [sent["State"]] * 2:
                with pytest.raises(grpc.RpcError) as refused:
                    channel.unary_unary(method)(b"\x0a\xff\xff", timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        instance = urllib.parse.urlparse(urls[0]).netloc
        for service, count in (("Peer", 3), ("State", 2)):
            promql = f'swarmgrad_rejected_requests_total{{service="{service}",code="BAD_PAYLOAD"}}'
            while _query(api, promql).get(instance, 0) < count:
                assert time.monotonic() < deadline, (promql, _query(api, promql))
                time.sleep(0.5)

        # swarmgrad status: both trainers, from the DHT, by spec or by run id.
        endpoints = {
            _wait_for(r"gRPC (\S+);", out / f"node-{i}.log", deadline)[1] for i in range(3)
        }
        bootstrap = str(out / "bootstrap.json")
        shown = _swarmgrad("status", str(spec), "--bootstrap-file", bootstrap, "--json")
        assert shown.returncode == 0, shown.stderr
        peers = json.loads(shown.stdout)["peers"]
        assert {p["endpoint"] for p in peers} == endpoints
        for peer in peers:
            assert peer["role"] == "trainer"
            assert peer["reachability"] == "direct"  # every node dialed back on loopback
            assert peer["epoch"] >= 1
            assert peer["last_seen_seconds"] < 60
        table = _swarmgrad("status", "--run", "shakespeare-demo", "--bootstrap-file", bootstrap)
        assert table.returncode == 0, table.stderr
        assert "3 peer(s)" in table.stdout
        assert peers[0]["peer_id"][:10] in table.stdout
        # ... and from a local node's own view, without joining the DHT.
        local = _swarmgrad("status", "--node", urls[0], "--json")
        assert local.returncode == 0, local.stderr
        assert {p["endpoint"] for p in json.loads(local.stdout)["peers"]} == endpoints

        # The run page, in a real browser, from node 0's metrics server alone: the peers as it
        # read them, its loss and rounds (test_readme_paths serves it from a ticket's DHT and
        # a status file).
        ids, page_deadline = {p["peer_id"] for p in peers}, time.monotonic() + 150
        _run_page_shows_the_swarm(urls[0], ids, tmp_path, page_deadline)
    finally:
        seen.set()
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        swarm.join(timeout=200)
    assert "error" not in result, result.get("error")
    assert result["summary"]["replicas_identical"]


def _run_page_shows_the_swarm(
    node: str, peer_ids: set[str], tmp_path: Path, deadline: float
) -> None:
    browser = _binary("chromium-headless-shell")
    log = tmp_path / "dashboard.log"
    command = [sys.executable, "-m", "swarmgrad.node.cli", "dashboard", "--node", node,
               "--port", "0", "--refresh", "1"]  # fmt: skip
    with log.open("w") as output:
        page = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        url = _wait_for(r"run page at (http://\S+)", log, deadline)[1]

        def shown() -> dict[str, Any]:
            with urllib.request.urlopen(url + "api/run", timeout=30) as answer:
                return dict(json.load(answer))

        while len((run := shown())["peers"]) < 3 or len(run["node"].get("rounds", [])) < 2:
            assert time.monotonic() < deadline, run
            time.sleep(0.5)
        assert {p["peer_id"] for p in run["peers"]} == peer_ids
        assert sum(p["share"] for p in run["peers"]) == pytest.approx(1.0)

        def load(*args: str) -> str:
            loaded = subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 "--virtual-time-budget=15000", *args, url],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert loaded.returncode == 0, loaded.stderr[-3000:]
            return loaded.stdout

        dom = load("--dump-dom")
        body = re.search(r"<body([^>]*)>", dom)
        assert body is not None, dom[:2000]
        drawn = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body[1]))
        assert int(drawn["reads"]) >= 1, drawn
        assert int(drawn["peers"]) == 3, drawn
        assert int(drawn["loss-points"]) >= 2, drawn
        assert int(drawn["rounds"]) >= 2, drawn
        assert dom.count('class="main-svg"') >= 3  # plotly drew each of the three charts
        assert dom.count('class="trace scatter') >= 2  # the loss curves
        assert dom.count('class="trace bars') >= 2  # the rounds' parts and the peers
        for peer in peer_ids:  # a row each, as text
            assert f'data-peer="{peer}"' in dom
        assert "the last read failed" not in dom
        artefacts = Path(__file__).parents[2] / ".pytest_cache" / "artefacts"
        artefacts.mkdir(parents=True, exist_ok=True)
        screenshot = artefacts / "run-page.png"
        load(f"--screenshot={screenshot}", "--window-size=1280,1500")
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        page.terminate()
        page.wait(timeout=30)
