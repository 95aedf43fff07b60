"""One scenario of the adversary suite: a swarm of real node processes (``simulate``) with
malicious peers among them or an outside attacker beside them, and what it did, from the nodes'
status files and ``/proc``.

A scenario's nodes are the demo spec in an open run, with identities (and so data streams)
derived from the suite's seed: node i is the same peer in every scenario, so the honest nodes of
an attacked run are the honest reference's nodes, on the same data. Attackers are the last
nodes. An outside attacker (``adversary_floods.py``; the readiness flood: ``readiness_flood.py
--flood``) starts once every honest node has landed a round and runs for the suite's window,
aimed at node 0.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmgrad.simulations.profiles import SimulationError
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate, simulation_identity

FLOODS = Path(__file__).with_name("adversary_floods.py")
#: The readiness flood's attacker (``--flood``): another benchmark's, used as it is.
READINESS_FLOOD = Path(__file__).with_name("readiness_flood.py")
LANDED = ("averaged", "partial")
OUTSIDER_EXTRA_ROUNDS = 4
#: Rounds an outside attacker's run adds per minute of its two windows (calm, then attacked):
#: more than a calm swarm of the demo model lands on two cores, so it trains through both.
OUTSIDER_ROUNDS_PER_MINUTE = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The suite's knobs, the same for every scenario of one table."""

    nodes: int = 8
    rounds: int = 6
    seed: int = 1
    window_seconds: float = 60.0  # how long an outside attacker attacks
    timeout_seconds: float = 900.0  # one scenario's swarm, at most
    volunteers: int = 4  # the look-alike scenario's joiners


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    what: str
    attack: str = ""  # the last ``attackers`` nodes' attack (simulations/attacks.py)
    attackers: int = 0
    fewer: int = 0  # a reference of this many nodes fewer than the suite's, all honest
    group_size: int = 4
    outsider: str = ""  # an attacker from outside (adversary_floods.py), at node 0
    reference: str = "honest"  # the scenario its loss is compared with

    def nodes(self, settings: Settings) -> int:
        return settings.nodes - self.fewer

    def rounds(self, settings: Settings) -> int:
        """An outside attacker's run goes on past the suite's rounds, so the swarm still
        trains through the window, and is compared with the reference at the suite's rounds."""
        if not self.outsider:
            return settings.rounds
        windows = 2 * settings.window_seconds / 60.0
        return (
            settings.rounds
            + OUTSIDER_EXTRA_ROUNDS
            + math.ceil(OUTSIDER_ROUNDS_PER_MINUTE * windows)
        )


def spec_text(group_size: int) -> str:
    """The demo spec in an open run, in groups of ``group_size``."""
    return DEMO_SPEC.replace("group_size = 256", f"group_size = {group_size}") + (
        '\n[trust]\nmode = "open"\n'
    )


class ProcWatch(threading.Thread):
    """Samples the CPU seconds of the processes whose output goes to ``folder``'s
    ``<name>.log`` files (the nodes, the bootstrap), so a node's CPU is known even though the
    zygote forked it and it has exited since."""

    def __init__(self, folder: Path, *, period_seconds: float = 0.5) -> None:
        super().__init__(name="proc-watch", daemon=True)
        self.folder = folder.resolve()
        self.period_seconds = period_seconds
        self.samples: dict[int, list[tuple[float, float]]] = {}  # pid -> (time, cpu seconds)
        self.names: dict[int, str] = {}  # pid -> log name (node-3)
        self.parents: dict[int, int] = {}  # pid -> its parent's pid
        self.done = threading.Event()
        self._ticks = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.done.wait(self.period_seconds):
            now = time.time()
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                pid = int(entry)
                with contextlib.suppress(OSError, ValueError, IndexError):
                    if pid not in self.names:
                        out = Path(os.readlink(f"/proc/{pid}/fd/1"))
                        if out.parent != self.folder or out.suffix != ".log":
                            continue
                        self.names[pid] = out.stem
                    with open(f"/proc/{pid}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                    cpu = (int(fields[11]) + int(fields[12])) / self._ticks
                    self.parents[pid] = int(fields[1])
                    self.samples.setdefault(pid, []).append((now, cpu))

    def pids(self, name: str) -> list[int]:
        """The processes logging to ``name``.log: a node, and its DHT's (which inherit it)."""
        return [pid for pid, n in self.names.items() if n == name]

    def main_pid(self, name: str) -> int:
        """The node itself: the one of ``pids(name)`` whose parent is none of them."""
        pids = self.pids(name)
        return next(p for p in pids if self.parents.get(p) not in pids)

    def cpu_seconds(self, name: str, start: float = 0.0, end: float = math.inf) -> float:
        """CPU seconds the processes logging to ``name``.log spent between two wall times."""
        total = 0.0
        for pid in self.pids(name):
            inside = [cpu for t, cpu in self.samples.get(pid, []) if start <= t <= end]
            if inside:
                before = [cpu for t, cpu in self.samples[pid] if t < start]
                total += inside[-1] - (before[-1] if before else 0.0)
        return total


def read_status(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _outsider(
    scenario: Scenario, settings: Settings, out: Path, honest: list[int], watch: ProcWatch
) -> dict[str, Any]:
    """Start the attacker at once (its imports take a while on a busy machine); once every
    honest node landed a round, a calm window as long as the attack's (the pace to compare
    with), then aim it at node 0 and let it attack for the window; what it reported, and the
    windows (wall times)."""
    sim = out / "sim"
    spec = out / "run.toml"
    deadline = time.monotonic() + settings.timeout_seconds
    if scenario.outsider.startswith("readiness"):  # readiness_flood.py's: joins the DHT first
        while not (sim / "bootstrap.json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        command = [sys.executable, str(READINESS_FLOOD), "--flood",
                   "--bootstrap-file", str(sim / "bootstrap.json"), "--status-dir", str(sim),
                   "--spec", str(spec), "--nodes", str(max(honest) + 1)]  # fmt: skip
        if scenario.outsider == "readiness_placebo":  # the control: its own DHT node, not ours
            command.append("--placebo")
    else:
        # A bound of its own past the window (the relay's abuser keeps to it: it reads no stdin).
        seconds = settings.window_seconds + (0 if scenario.outsider == "relay" else 60)
        options = {"early": ["--spec", str(spec), "--width", "80"]}.get(scenario.outsider, [])
        command = [sys.executable, str(FLOODS), scenario.outsider, "--wait",
                   "--seconds", str(seconds), *options]  # fmt: skip
    with open(out / "outsider.log", "w") as log:
        attacker = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
    assert attacker.stdin is not None
    assert attacker.stdout is not None
    result: dict[str, Any] = {}
    try:
        while time.monotonic() < deadline:
            statuses = [read_status(sim / f"node-{i}.json") for i in honest]
            if all(s.get("epoch", 0) >= 1 for s in statuses):
                result["calm_start"] = time.time()
                time.sleep(settings.window_seconds)  # the calm window (a benchmark's)
                result["calm_end"] = time.time()
                target = statuses[0]
                go = {
                    "endpoint": target["endpoint"],
                    "receiver": target["peer_id"],
                    "relay": target.get("relay", ""),
                    "pid": watch.main_pid("node-0"),
                }
                attacker.stdin.write(json.dumps(go) + "\n")
                attacker.stdin.flush()
                if attacker.stdout.readline().strip() in ("attacking", "flooding"):
                    result["start"] = time.time()
                    time.sleep(settings.window_seconds)  # the attack's window (a benchmark's)
                    result["end"] = time.time()  # told to stop now (its report may take a while)
                break
            time.sleep(0.5)
    finally:  # whatever happened, the attacker goes: stdin closed, it stops, reports, exits
        try:
            lines = attacker.communicate(input="", timeout=120)[0].strip().splitlines()
        except subprocess.TimeoutExpired:
            attacker.kill()
            lines = attacker.communicate()[0].strip().splitlines()
    result.setdefault("end", time.time())
    result["exit"] = attacker.returncode
    if lines and lines[-1].startswith("{"):
        result["attacker"] = json.loads(lines[-1])
    else:
        result["error"] = (out / "outsider.log").read_text()[-2000:]
    return result


def run_swarm(scenario: Scenario, settings: Settings, out: Path) -> dict[str, Any]:
    """Run ``scenario``'s swarm in ``out``; its measurements (``measure``)."""
    out.mkdir(parents=True, exist_ok=True)
    n = scenario.nodes(settings)
    (out / "run.toml").write_text(spec_text(scenario.group_size))
    attackers = list(range(n - scenario.attackers, n))
    profile = out / "peers.toml"
    profile.write_text(
        "".join(
            "[[peer]]\n" + (f'attack = "{scenario.attack}"\n' if i in attackers else "")
            for i in range(n)
        )
    )
    honest = [i for i in range(n) if i not in attackers]
    watch = ProcWatch(out / "sim")
    watch.start()
    outside: dict[str, Any] = {}
    thread = None
    if scenario.outsider:

        def attack() -> None:
            outside.update(_outsider(scenario, settings, out, honest, watch))

        thread = threading.Thread(target=attack, name="outsider", daemon=True)
        thread.start()
    began, error = time.time(), None
    try:
        simulate(
            SimulationConfig(
                nodes=n, rounds=scenario.rounds(settings), spec_path=out / "run.toml",
                profile_path=profile, out_dir=out / "sim", seed=settings.seed,
                timeout_seconds=settings.timeout_seconds,
            )
        )  # fmt: skip
    except SimulationError as failed:  # a swarm the attack stopped: measured all the same
        error = str(failed)[-1500:]
    finally:
        if thread is not None:
            thread.join(settings.window_seconds + 300)
        watch.done.set()
        watch.join()
    result = measure(
        out / "sim", watch, n=n, attackers=attackers, seed=settings.seed, rounds=settings.rounds
    )
    result.update(wall_seconds=time.time() - began, error=error)
    if scenario.outsider:
        result["outsider"] = outside
        if "start" in outside:  # the window: from the attack's start to its report
            result["window"] = window(out / "sim", watch, honest, outside["start"], outside["end"])
            calm = window(out / "sim", watch, honest, outside["calm_start"], outside["calm_end"])
            result["calm_window"] = calm
            result["window"]["pace_vs_calm"] = (
                result["window"]["epochs_per_minute"] / calm["epochs_per_minute"]
                if calm["epochs_per_minute"] > 0
                else math.nan
            )
    return result


def _rate(history: list[dict[str, Any]], started_at: float) -> tuple[float, float, int, int]:
    """(first, last) wall time of a landed round, and the epochs then, in a node's history."""
    landed = [e for e in history if e["outcome"] in LANDED]
    if len(landed) < 2:
        return math.nan, math.nan, 0, 0
    first, last = landed[0], landed[-1]
    return (started_at + first["time"], started_at + last["time"], first["epoch"], last["epoch"])


def _loss_at(status: dict[str, Any], epoch: int) -> float:
    """A node's validation loss when it landed ``epoch`` (NaN if it did not)."""
    landed = [
        e for e in status.get("history", []) if e["epoch"] == epoch and e["outcome"] in LANDED
    ]
    value = landed[-1].get("val_loss") if landed else None
    return math.nan if value is None else float(value)


def measure(
    sim: Path, watch: ProcWatch, *, n: int, attackers: list[int], seed: int, rounds: int
) -> dict[str, Any]:
    """What a user would look at after the run: the honest nodes' loss (at the end, and
    after ``rounds``), replicas, epochs, bytes, CPU and pace; who banned whom in which round."""
    statuses = {i: read_status(sim / f"node-{i}.json") for i in range(n)}
    ids = {simulation_identity(seed, i).peer_id: i for i in range(n)}
    honest = [i for i in range(n) if i not in attackers]
    mine = [statuses[i] for i in honest if statuses[i]]
    bans = []
    for i, status in statuses.items():
        for peer_id, row in status.get("trust", {}).items():
            if row.get("banned"):
                banned = row["banned"]
                bans.append({"by": i, "of": ids.get(peer_id, peer_id), "round": banned["round"],
                             "reason": banned["reason"]})  # fmt: skip
    by_honest = [b for b in bans if b["by"] in honest]
    # The last round an attacker's values reached an honest owner's part (its ledger's
    # seen_round): when the honest nodes stopped grouping with it, whoever banned it.
    last_seen: dict[int, int] = {}
    for i in honest:
        for peer_id, row in statuses[i].get("trust", {}).items():
            who = ids.get(peer_id)
            if who in attackers and row.get("seen_round") is not None:
                last_seen[who] = max(last_seen.get(who, -1), row["seen_round"])
    outcomes: dict[str, int] = {}
    checks: dict[str, int] = {}
    for status in mine:
        for name, count in status.get("outcomes", {}).items():
            outcomes[name] = outcomes.get(name, 0) + count
        for name, count in (status.get("owner_checks") or {}).items():
            checks[name] = checks.get(name, 0) + count
    rates = []
    for status in mine:
        t0, t1, e0, e1 = _rate(status.get("history", []), status.get("started_at", 0.0))
        if t1 > t0:
            rates.append((e1 - e0) / (t1 - t0) * 60)
    losses = [math.nan if s.get("val_loss") is None else s["val_loss"] for s in mine]
    at_rounds = [x for x in (_loss_at(s, rounds) for s in mine) if math.isfinite(x)]
    cpu = [watch.cpu_seconds(f"node-{i}") for i in honest]
    return {
        "nodes": n,
        "honest": honest,
        "attackers": attackers,
        "final_val_loss": statistics.fmean(losses) if losses else math.nan,
        "val_loss_at_rounds": statistics.fmean(at_rounds) if at_rounds else math.nan,
        "initial_val_loss": statistics.fmean(s["initial_val_loss"] for s in mine) if mine else None,
        "replicas_identical": len({s.get("checksum") for s in mine}) == 1,
        "epochs": {i: statuses[i].get("epoch", 0) for i in range(n)},
        "bans": bans,
        "attackers_banned": {
            a: sorted((b["round"], b["by"]) for b in by_honest if b["of"] == a) for a in attackers
        },
        "attackers_last_in_honest_parts": {a: last_seen.get(a) for a in attackers},
        "honest_banned": [b for b in by_honest if b["of"] in honest],
        "outcomes": outcomes,
        "owner_checks": checks,
        "bytes_sent": statistics.fmean(s["bytes_sent"] for s in mine) if mine else 0,
        "bytes_received": statistics.fmean(s["bytes_received"] for s in mine) if mine else 0,
        "cpu_seconds": statistics.fmean(cpu) if cpu else 0.0,
        "epochs_per_minute": statistics.median(rates) if rates else math.nan,
    }


def _epoch_at(history: list[dict[str, Any]], started_at: float, t: float) -> float:
    """A node's epoch at wall time ``t``, linear between the rounds it ended (0 at its start;
    its last epoch after its last round)."""
    points = [(started_at, 0.0)] + [(started_at + e["time"], float(e["epoch"])) for e in history]
    if t >= points[-1][0]:
        return points[-1][1]
    for (t0, e0), (t1, e1) in itertools.pairwise(points):
        if t0 <= t < t1:
            return e0 + (e1 - e0) * (t - t0) / (t1 - t0)
    return 0.0


def window(
    sim: Path, watch: ProcWatch, honest: list[int], start: float, end: float
) -> dict[str, Any]:
    """The honest nodes from ``start`` to ``end``: epochs a minute (the median node's, its
    epoch read between the times it landed rounds, so a window holding a few rounds is not
    rounded to whole ones), rounds of node 0, CPU."""
    advanced: list[float] = []
    target: dict[str, int] = {}
    for i in honest:
        status = read_status(sim / f"node-{i}.json")
        started = status.get("started_at", 0.0)
        history = status.get("history", [])
        advanced.append(_epoch_at(history, started, end) - _epoch_at(history, started, start))
        if i == 0:
            for e in history:
                if start <= started + e["time"] <= end:
                    target[e["outcome"]] = target.get(e["outcome"], 0) + 1
                    missing = target.get("missing_values", 0) + e["missing_values"]
                    target["missing_values"] = missing
    seconds = end - start
    cpu = {i: watch.cpu_seconds(f"node-{i}", start, end) / seconds for i in honest}
    others = [cpu[i] for i in honest if i != 0]
    return {
        "seconds": seconds,
        "epochs_per_minute": statistics.median(advanced) / seconds * 60,
        "node0_rounds": target,
        "node0_cpu_share": cpu[0],
        "others_cpu_share": statistics.fmean(others) if others else math.nan,
    }
