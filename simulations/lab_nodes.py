"""Node processes in a NAT lab (``natlab.py``): a bootstrap and trainers on the lab's hosts,
their status files and logs, and a wait on all of them with a deadline."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmgrad.simulations.natlab import Host, LabError, read_if_there
from swarmgrad.simulations.processes import Child, node_command, stop_gracefully


@dataclass(slots=True)
class LabNode:
    """A node process on a lab host, with its status file and log."""

    host: Host
    name: str
    status_path: Path
    log_path: Path
    args: list[str]
    process: Child | None = None

    def start(self) -> None:
        self.status_path.unlink(missing_ok=True)
        self.process = self.host.fork(self.name, node_command(*self.args), self.log_path)

    def status(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.status_path.read_text()))
        except (OSError, ValueError):
            return {}

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(line for line in text if "fork_posix" not in line)[-3000:]

    def stop(self, timeout_seconds: float = 15.0) -> None:
        if self.process is not None:
            stop_gracefully(self.process, timeout_seconds)


def start_bootstrap(host: Host, out_dir: Path, timeout_seconds: float = 60.0) -> list[str]:
    """A DHT bootstrap node on ``host``; returns its multiaddrs."""
    maddrs = out_dir / "bootstrap.json"
    maddrs.unlink(missing_ok=True)
    process = host.fork(
        "bootstrap",
        node_command(
            "bootstrap",
            "--host",
            host.address,
            "--maddrs-file",
            str(maddrs),
            "--identity",
            str(out_dir / "bootstrap.key"),
        ),
        out_dir / "bootstrap.log",
    )
    deadline = time.monotonic() + timeout_seconds
    while not maddrs.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise LabError(
                f"the bootstrap did not start: {read_if_there(out_dir / 'bootstrap.log')!r}"
            )
        time.sleep(0.1)
    return list(json.loads(maddrs.read_text())["maddrs"])


def lab_node(
    host: Host,
    name: str,
    *,
    spec_path: Path,
    bootstrap: Sequence[str],
    out_dir: Path,
    rounds: int,
    extra_args: Sequence[str] = (),
) -> LabNode:
    """A trainer on ``host`` that trains ``rounds`` epochs, then serves peers until stopped."""
    args = [
        "node",
        str(spec_path),
        *(a for m in bootstrap for a in ("--bootstrap", m)),
        "--host", host.address,
        "--identity", str(out_dir / f"{name}.key"),
        "--checkpoint-dir", str(out_dir / "checkpoints" / name),
        "--status-file", str(out_dir / f"{name}.json"),
        "--max-epochs", str(rounds),
        "--linger",
        "--display", "log",
        "--threads", "1",
        "--metrics-address", "off",
        *extra_args,
    ]  # fmt: skip
    return LabNode(host, name, out_dir / f"{name}.json", out_dir / f"{name}.log", args)


def wait_until(
    nodes: Sequence[LabNode],
    done: Callable[[dict[str, Any]], bool],
    *,
    timeout_seconds: float,
    what: str,
) -> list[dict[str, Any]]:
    """Poll the nodes' status files until ``done`` holds for each; their statuses then."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        statuses = [node.status() for node in nodes]
        if all(done(s) for s in statuses):
            return statuses
        for node in nodes:
            code = node.process.poll() if node.process is not None else None
            if code is not None:
                raise LabError(f"{node.name} exited ({code}):\n{node.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"== {n.name}: {n.status()}\n{n.tail()}" for n in nodes)
            raise LabError(f"not {what} within {timeout_seconds:g} s:\n{tails}")
        time.sleep(0.25)


def prepare_corpus(spec_path: Path) -> Path:
    """The cache folder holding the run's demo corpus, prepared by this process if it is not
    there yet: it runs outside the lab, where the corpus can be fetched; a node inside the
    lab's namespaces reaches nothing beyond them."""
    from swarmgrad.node.config import home
    from swarmgrad.node.runspec import RunSpec
    from swarmgrad.node.training.data import load_demo

    spec = RunSpec.load(spec_path)
    cache_dir = home() / "cache"
    if spec.data.source == "demo":
        load_demo(cache_dir, vocab_size=spec.model.vocab_size)
    return cache_dir


def start_swarm(
    boot: Host, hosts: Sequence[Host], *, spec_path: Path, out_dir: Path, rounds: int
) -> list[LabNode]:
    """A bootstrap on ``boot`` and a trainer on each of ``hosts`` (``node-0``, ...), started
    (the demo corpus prepared first, outside the lab)."""
    cache_dir = prepare_corpus(spec_path)
    maddrs = start_bootstrap(boot, out_dir)
    nodes = [
        lab_node(
            h,
            f"node-{i}",
            spec_path=spec_path,
            bootstrap=maddrs,
            out_dir=out_dir,
            rounds=rounds,
            extra_args=("--cache-dir", str(cache_dir)),
        )
        for i, h in enumerate(hosts)
    ]
    for node in nodes:
        node.start()
    return nodes
