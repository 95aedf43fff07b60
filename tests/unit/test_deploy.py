"""The deployment files (no docker here): docker-compose.yml validates against the compose spec
and wires a bootstrap, trainers and Prometheus together as the node expects; the Grafana dashboard
shows every metric a node exposes and nothing else."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from swarmgrad.node.config import CommandLine, node_config
from swarmgrad.node.metrics import NodeMetrics
from swarmgrad.node.runspec import RunSpec

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
TRAINERS = sorted(name for name in SERVICES if name.startswith("trainer-"))


def _option(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (volume name or host path)."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def test_the_compose_file_follows_the_compose_spec() -> None:
    checked = subprocess.run(
        [
            Path(sys.executable).parent / "check-jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            ROOT / "docker-compose.yml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_services_and_ports() -> None:
    assert set(SERVICES) == {"bootstrap", "prometheus", *TRAINERS}
    assert len(TRAINERS) >= 2
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    published = [str(p).rsplit(":", 2)[1] for s in SERVICES.values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)), "two services publish one host port"


def test_trainers_join_through_the_bootstrap_and_announce_their_names(tmp_path: Path) -> None:
    bootstrap = SERVICES["bootstrap"]
    maddrs_file = _option(bootstrap["command"], "--maddrs-file")
    shared = str(Path(maddrs_file).parent)
    assert _option(bootstrap["command"], "--host") == "0.0.0.0"
    health = " ".join(bootstrap["healthcheck"]["test"])
    assert maddrs_file in health  # healthy once written by this start, and listening
    assert "create_connection(('127.0.0.1', 31337)" in health
    key = _option(bootstrap["command"], "--identity")  # a peer id that survives restarts
    assert str(Path(key).parent) in _mounts(bootstrap)  # kept on a volume of its own
    assert str(Path(key).parent) != shared  # not where trainers read
    spec_file = tmp_path / "bootstrap.json"  # what the bootstrap writes
    spec_file.write_text(json.dumps({"maddrs": ["/ip4/172.18.0.2/tcp/31337/p2p/QmBootstrap"]}))
    for name in TRAINERS:
        trainer = SERVICES[name]
        command, env = trainer["command"], trainer["environment"]
        assert command[0] == "node"
        assert _option(command, "--bootstrap-file") == maddrs_file
        assert _mounts(trainer)[shared] == _mounts(bootstrap)[shared]  # the same volume
        assert trainer["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        assert env["SWARMGRAD_PUBLIC_HOST"] == name  # peers dial the service name
        # The node accepts this configuration as it stands (unknown variables are errors).
        run_toml = ROOT / _mounts(trainer)[command[1]]
        config = node_config(
            spec_path=run_toml,
            environ={k: str(v) for k, v in env.items()},
            cli=CommandLine(
                bootstrap_file=spec_file, cache_dir=Path(_option(command, "--cache-dir"))
            ),
        )
        assert config.swarm.public_host == name
        assert config.swarm.bootstrap == ("/ip4/172.18.0.2/tcp/31337/p2p/QmBootstrap",)
        assert _mounts(trainer)["/data"] == name  # keys and checkpoints in its own volume
        assert env["SWARMGRAD_HOME"] == "/data"


def test_prometheus_scrapes_exactly_the_trainers() -> None:
    prometheus = SERVICES["prometheus"]
    config_path = _mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    scrape = yaml.safe_load((ROOT / config_path).read_text())["scrape_configs"]
    targets = {t for job in scrape for c in job["static_configs"] for t in c["targets"]}
    expected = {
        f"{name}:{SERVICES[name]['environment']['SWARMGRAD_METRICS_ADDRESS'].rsplit(':', 1)[1]}"
        for name in TRAINERS
    }
    assert targets == expected


def test_the_run_spec_and_the_image_fit_the_swarm() -> None:
    spec = RunSpec.load(ROOT / "deploy" / "run.toml")
    assert 2 <= spec.averaging.group_size <= len(TRAINERS)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["swarmgrad"\]$', dockerfile, re.M)
    assert "-c requirements/constraints.txt" in dockerfile
    cache = _option(SERVICES[TRAINERS[0]]["command"], "--cache-dir")
    assert f"prepare-data --cache-dir {cache}" in dockerfile  # the corpus is in the image


def _exposed_families() -> set[str]:
    metrics = NodeMetrics(peer_id="a", run_id="r", spec_hash="h", algorithm="diloco", codec="int8")
    metrics.read_tallies(traffic=dict, failures=dict)
    text = generate_latest(metrics.registry).decode()
    # prometheus-client's "_created" timestamps are bookkeeping, not metrics to chart.
    return {f for f in re.findall(r"^# TYPE (\S+) ", text, re.M) if not f.endswith("_created")}


def test_the_grafana_dashboard_shows_every_metric_and_only_real_ones() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "swarmgrad-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    families = _exposed_families()
    series = families | {
        f"{f}{suffix}" for f in families for suffix in ("_bucket", "_sum", "_count")
    }
    used = {name for expr in exprs for name in re.findall(r"\bswarmgrad_[a-z_]+", expr)}
    assert used <= series, f"unknown metrics: {sorted(used - series)}"
    shown = {
        family
        for family in families
        if any(name == family or name.startswith(f"{family}_") for name in used)
    }
    missing = families - shown - {"swarmgrad_node_info"}
    assert not missing, f"no panel shows {sorted(missing)}"
    for variable in dashboard["templating"]["list"]:
        used |= set(re.findall(r"\bswarmgrad_[a-z_]+", variable["query"]))
    assert used <= series


@pytest.mark.parametrize("name", ["docker-compose.yml", "deploy/prometheus.yml"])
def test_the_yaml_files_parse(name: str) -> None:
    assert yaml.safe_load((ROOT / name).read_text())
