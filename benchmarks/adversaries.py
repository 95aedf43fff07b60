#!/usr/bin/env python3
"""The adversary suite: issue 42's attacks on an open run of real node processes, each beside
the honest reference, on this tree and (``--before-tree``) on an older checkout, one table.

    .venv/bin/python benchmarks/adversaries.py                       # every scenario, this tree
    .venv/bin/python benchmarks/adversaries.py --scenarios honest withhold_lie --nodes 5 --rounds 4
    git worktree add /tmp/before 38f1593
    .venv/bin/python benchmarks/byzantine.py --swarm --before-tree /tmp/before \\
        --json docs/results/adversaries-cpu.json                      # ~2 h on 2 cores
    .venv/bin/python benchmarks/adversaries.py --from-json docs/results/adversaries-cpu.json

Each scenario runs in a process of its own (``--worker``), under the tree it measures: for
``--before-tree`` that process imports the old tree's ``node``, ``protocol``, ``compression``
and ``simulations`` through a package folder of links, with this tree's attackers
(``simulations/adversary.py``, ``attacks.py``) in place of the old ones, so both trees face
the same attacks. Scenarios alternate before, after, so a change in the machine's load hits both
alike; the load average is recorded around each run. Raw records go to ``--json`` after each run;
the table is printed at the end (``adversary_table.py``). Scenarios: ``adversary_runs.py``
(swarms) and ``adversary_join.py`` (the look-alike spec); outside attackers:
``adversary_floods.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from adversary_runs import Scenario, Settings, run_swarm
from adversary_table import markdown

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = {
    s.name: s
    for s in (
        Scenario(name="honest", what="every node honest: the reference"),
        Scenario(name="honest6", what="the honest nodes of a 2-attacker run alone", fewer=2),
        Scenario(name="honest_g8", what="every node honest, groups of 8", group_size=8),
        Scenario(name="scale", what="x100 from 2 nodes", attack="scale", attackers=2,
                 reference="honest6"),
        Scenario(name="sign_flip", what="sign flip from 2 nodes", attack="sign_flip", attackers=2,
                 reference="honest6"),
        Scenario(name="noise", what="noise of 3x the norm from 2 nodes", attack="noise",
                 attackers=2, reference="honest6"),
        Scenario(name="noise_g8", what="noise of 3x the norm from 2 nodes, groups of 8",
                 attack="noise", attackers=2, group_size=8, reference="honest_g8"),
        Scenario(name="collude_g4", what="a colluding pair, groups of 4", attack="collude",
                 attackers=2, reference="honest6"),
        Scenario(name="collude_g8", what="a colluding pair, groups of 8", attack="collude",
                 attackers=2, group_size=8, reference="honest_g8"),
        Scenario(name="withhold_lie", what="an owner withholding one account a round, in turn, "
                 "and returning x(-3), groups of 8 (as the review ran it)", attack="withhold_lie",
                 attackers=1, group_size=8, reference="honest_g8"),
        Scenario(name="lookalike", what="a look-alike spec under the run id; volunteers join "
                 "with the run key", reference=""),
        Scenario(name="stream_flood", what="600 silent keyless Aggregate streams at node 0",
                 outsider="streams"),
        Scenario(name="early_flood", what="80 throwaway keys' streams waiting in node 0's "
                 "early-stream slots", outsider="early"),
        Scenario(name="readiness_flood", what="310 throwaway keys' readiness records (100 with "
                 "peer records) under the next 20 round keys", outsider="readiness"),
        Scenario(name="readiness_placebo", what="the readiness flood's attacker storing into a "
                 "DHT node of its own: its windows' control", outsider="readiness_placebo"),
        Scenario(name="relay_abuse", what="a stranger pushing bytes through node 0's relay",
                 outsider="relay"),
    )
}  # fmt: skip


def tree_state(tree: Path) -> dict[str, Any]:
    """The commit a tree is at, and (a working tree) what is changed on top of it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else ""

    diff = git("diff", "HEAD")
    return {
        "path": str(tree),
        "commit": git("rev-parse", "HEAD").strip(),
        "changed": git("status", "--short").splitlines(),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else "",
    }


def overlay(before: Path, folder: Path) -> Path:
    """A folder whose ``swarmgrad`` package is ``before``'s, with this tree's attackers: what
    goes first on PYTHONPATH for the before runs."""
    package = folder / "swarmgrad"
    simulations = package / "simulations"
    simulations.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()
    for name in ("node", "protocol", "compression"):
        link = package / name
        link.unlink(missing_ok=True)
        link.symlink_to(before / name)
    ours = {"adversary.py", "attacks.py"}
    for entry in (before / "simulations").iterdir():
        if entry.name == "__pycache__":
            continue
        link = simulations / entry.name
        link.unlink(missing_ok=True)
        link.symlink_to(REPO / "simulations" / entry.name if entry.name in ours else entry)
    return folder


def _settings_args(settings: Settings) -> list[str]:
    return [
        "--nodes", str(settings.nodes), "--rounds", str(settings.rounds),
        "--seed", str(settings.seed), "--window", str(settings.window_seconds),
        "--timeout", str(settings.timeout_seconds), "--volunteers", str(settings.volunteers),
    ]  # fmt: skip


def run_one(
    name: str, tree: str, settings: Settings, work: Path, env: dict[str, str]
) -> dict[str, Any]:
    """Scenario ``name`` in a worker process under ``env``'s tree; its record."""
    out = work / f"{name}-{tree}"
    result_path = work / f"{name}-{tree}.json"
    result_path.unlink(missing_ok=True)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    began = time.time()
    command = [sys.executable, __file__, "--worker", name, "--out", str(out),
               "--json", str(result_path), *_settings_args(settings)]  # fmt: skip
    with open(work / f"{name}-{tree}.log", "w") as log:
        done = subprocess.run(
            command, env=env, stdout=log, stderr=subprocess.STDOUT,
            timeout=settings.timeout_seconds + 600,
        )  # fmt: skip
    if done.returncode != 0 or not result_path.exists():
        tail = (work / f"{name}-{tree}.log").read_text()[-3000:]
        result: dict[str, Any] = {"error": f"worker exited {done.returncode}:\n{tail}"}
    else:
        result = json.loads(result_path.read_text())
    return {
        "scenario": name,
        "tree": tree,
        "reference": SCENARIOS[name].reference,
        "what": SCENARIOS[name].what,
        "settings": dataclasses.asdict(settings),
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "seconds": time.time() - began,
        "result": result,
    }


def worker(name: str, settings: Settings, out: Path, path: Path) -> None:
    """Run one scenario here, under whatever tree this process imports."""
    import swarmgrad.node

    if name == "lookalike":
        from adversary_join import run_join

        result = run_join(settings, out)
    else:
        result = run_swarm(SCENARIOS[name], settings, out)
    result["imported_from"] = str(Path(swarmgrad.node.__file__).resolve().parent.parent)
    path.write_text(json.dumps(result, indent=1, default=str))


def report(records: list[dict[str, Any]], order: list[str]) -> None:
    print(markdown(records, order))
    for record in records:
        load = f"load {' '.join(record['loadavg_before'])} -> {' '.join(record['loadavg_after'])}"
        error = record["result"].get("error")
        print(
            f"  {record['scenario']:<16} {record['tree']:<6} {record['seconds']:5.0f} s, "
            f"{load}" + (f"; ERROR: {error.strip().splitlines()[-1][:150]}" if error else "")
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Settings()
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--before-tree", type=Path, help="also run each scenario on this tree")
    parser.add_argument("--trees", nargs="+", default=["before", "after"],
                        choices=["before", "after"], help="which trees to run")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=defaults.nodes)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--window", type=float, default=defaults.window_seconds,
                        help="seconds an outside attacker attacks")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=defaults.timeout_seconds)
    parser.add_argument("--volunteers", type=int, default=defaults.volunteers)
    parser.add_argument("--work", type=Path, help="keep the runs' logs here (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the records here, after each run "
                        "(default: WORK/records.json)")  # fmt: skip
    parser.add_argument("--from-json", type=Path, nargs="+", help="only print these records")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = Settings(
        nodes=args.nodes, rounds=args.rounds, seed=args.seed, window_seconds=args.window,
        timeout_seconds=args.timeout, volunteers=args.volunteers,
    )  # fmt: skip
    if args.worker:
        worker(args.worker, settings, args.out, args.json)
        return
    if args.from_json:
        saved = [r for path in args.from_json for r in json.loads(path.read_text())["records"]]
        report(saved, list(dict.fromkeys(r["scenario"] for r in saved)))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="adversaries-"))
    work.mkdir(parents=True, exist_ok=True)
    path: Path = args.json or work / "records.json"
    print(f"runs in {work}; records in {path}", flush=True)
    trees: dict[str, dict[str, str]] = {}
    states = {"after": tree_state(REPO)}
    if args.before_tree and "before" in args.trees:
        before = args.before_tree.resolve()
        imports = f"{overlay(before, work / 'before-pkg')}{os.pathsep}{before}"
        trees["before"] = os.environ | {"PYTHONPATH": imports}
        states["before"] = tree_state(before)
    if "after" in args.trees or not args.before_tree:
        trees["after"] = dict(os.environ)
    records: list[dict[str, Any]] = []
    for name in args.scenarios:
        for tree, env in trees.items():
            record = run_one(name, tree, settings, work, env)
            records.append(record)
            report([record], [name])
            path.write_text(json.dumps({"trees": states, "records": records}, indent=1))
    print()
    report(records, args.scenarios)


if __name__ == "__main__":
    main()
