#!/usr/bin/env python3
"""How long the README's volunteer path takes on this machine, step by step, against a run an
organizer published on loopback (a bootstrap and ``publish``; each volunteer is the run's only
node, so its first round ends at the matchmaking timeout, with no group).

    python benchmarks/volunteer_path.py              # 3 volunteers, one after another
    python benchmarks/volunteer_path.py --repeats 5 --json out.json

Each volunteer has a fresh ``$SWARMGRAD_HOME`` (its key made at its first start; the demo
corpus lent from this machine's cache, as set-up leaves it) and runs, as printed: ``doctor
--run TICKET``, ``join TICKET --status-file node.json`` (timed to "joined run" and to its first
round in the status file), ``dashboard TICKET`` (to its page answering), then Ctrl-C. Reported:
medians and ranges per step. Set-up itself (``scripts/setup.sh``) is timed by CI, not here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from swarmgrad.simulations.swarm import DEMO_SPEC

SWARMGRAD = [sys.executable, "-m", "swarmgrad.node.cli"]


def start(args: list[str], home: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SWARMGRAD_HOME": str(home)}
    with log.open("w") as out:
        return subprocess.Popen([*SWARMGRAD, *args], cwd=home, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def until(check: Any, seconds: float = 300) -> float:
    """Seconds until ``check()`` is truthy."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > seconds:
            raise SystemExit(f"gave up after {seconds:g} s")
        time.sleep(0.1)
    return time.monotonic() - started


def found(log: Path, pattern: str) -> re.Match[str] | None:
    return re.search(pattern, log.read_text(errors="replace")) if log.exists() else None


def volunteer(
    home: Path,
    ticket: str,
    cache: Path,
    steps: dict[str, list[float]],
    running: list[subprocess.Popen[bytes]],
) -> None:
    """One volunteer's path, timed into ``steps``."""
    home.mkdir()
    (home / "cache").symlink_to(cache)
    env = {**os.environ, "SWARMGRAD_HOME": str(home)}
    started = time.monotonic()
    subprocess.run([*SWARMGRAD, "doctor", "--run", ticket], cwd=home, env=env, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    steps["doctor"].append(time.monotonic() - started)
    join = start(["join", ticket, "--status-file", "node.json", "--display", "log"], home,
                 home / "join.log")  # fmt: skip
    running.append(join)
    steps["joined"].append(until(lambda: found(home / "join.log", "joined run")))
    steps["first round"].append(steps["joined"][-1] + until((home / "node.json").exists))
    page = start(["dashboard", ticket, "--status-file", "node.json", "--port", "0"], home,
                 home / "page.log")  # fmt: skip
    running.append(page)

    def answers() -> bool:
        url = found(home / "page.log", r"http://\S+/")
        if url is None:
            return False
        try:
            with urllib.request.urlopen(url[0] + "api/run", timeout=5) as answer:
                return bool(json.load(answer)["reads"])
        except (OSError, ValueError):
            return False

    steps["page"].append(until(answers))
    for process in (page, join):
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()
    cache = Path(os.environ.get("SWARMGRAD_HOME", Path.home() / ".swarmgrad")) / "cache"
    steps: dict[str, list[float]] = {"doctor": [], "joined": [], "first round": [], "page": []}
    running: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as folder:
        org = Path(folder) / "organizer"
        org.mkdir()
        (org / "run.toml").write_text(DEMO_SPEC)
        org_env = {**os.environ, "SWARMGRAD_HOME": str(org)}
        subprocess.run([*SWARMGRAD, "run-key", "org.key"], cwd=org, check=True,
                       capture_output=True, env=org_env)  # fmt: skip
        try:
            running.append(start(["bootstrap"], org, org / "boot.log"))
            until(lambda: found(org / "boot.log", r"/ip4/\S+/p2p/\w+"))
            maddr = found(org / "boot.log", r"/ip4/\S+/p2p/\w+")[0]  # type: ignore[index]
            running.append(start(["publish", "run.toml", "--run-key", "org.key", "--bootstrap",
                                  maddr], org, org / "publish.log"))  # fmt: skip
            until(lambda: found(org / "publish.log", r"sgrun1\.\S+"))
            ticket = found(org / "publish.log", r"sgrun1\.\S+")[0]  # type: ignore[index]
            for k in range(args.repeats):
                volunteer(Path(folder) / f"volunteer-{k}", ticket, cache, steps, running)
        finally:
            for process in running:
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)
            for process in running:
                process.wait(timeout=60)
    results = {
        name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
        for name, v in steps.items()
    }
    print(f"{args.repeats} volunteers, one after another (median, range), seconds")
    for name, s in results.items():
        print(f"{name:<12} {s['median']:6.1f} ({s['min']:.1f}-{s['max']:.1f})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
