#!/usr/bin/env python3
"""Where the test suite's CPU goes, machine-wide: what ``scripts/timings.py`` cannot see (a test's
node processes are forked by a zygote, their DHT processes by a fork server: no test reaps them).

    scripts/suite_cpu.py sample cpu.jsonl &        # every second, until cpu.jsonl.stop exists
    scripts/test.sh; touch cpu.jsonl.stop
    scripts/suite_cpu.py report cpu.jsonl          # with .pytest_cache/timings.json: per test

Each sample is the CPU seconds every process used since the last one, by xdist worker (the
``PYTEST_XDIST_WORKER`` its process tree inherited; "other" when none) and by process name
(``node-0``, ``p2pd``, ``python``...), and the machine's busy share. The report sums them over
the pytest phase and, per test, over its seconds (``started_at`` in the timings file).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _machine() -> tuple[int, int]:
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    return sum(values), values[3] + values[4]  # all, idle + iowait


def _worker(pid: int, ppid: int, known: dict[int, str]) -> str:
    if pid not in known:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        named = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"PYTEST_XDIST_WORKER=")]
        known[pid] = named[0] if named else known.get(ppid, "other")
    return known[pid]


def sample(out: Path) -> None:
    stop = out.with_name(out.name + ".stop")
    last: dict[int, float] = {}
    known: dict[int, str] = {}
    total, idle = _machine()
    first = True  # the processes running before sampling began: their past is not counted
    with out.open("w") as sink:
        while not stop.exists():
            time.sleep(1.0)
            by_name: Counter[str] = Counter()
            alive = set()
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                pid = int(entry)
                try:
                    text = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                name, rest = (
                    text[text.index("(") + 1 : text.rindex(")")],
                    text[text.rindex(")") + 2 :].split(),
                )
                cpu = (int(rest[11]) + int(rest[12])) / TICK
                alive.add(pid)
                spent, last[pid] = cpu - last.get(pid, cpu if first else 0.0), cpu
                if spent > 0:
                    by_name[f"{_worker(pid, int(rest[1]), known)}:{name}"] += spent
            first = False
            for pid in set(last) - alive:
                del last[pid]
                known.pop(pid, None)
            now_total, now_idle = _machine()
            busy = 1 - (now_idle - idle) / max(1, now_total - total)
            total, idle = now_total, now_idle
            row = {"t": round(time.time(), 2), "busy": round(busy, 3),
                   "cpu": {k: round(v, 2) for k, v in by_name.items()}}  # fmt: skip
            sink.write(json.dumps(row) + "\n")
            sink.flush()


def report(path: Path, timings: Path) -> None:
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    rows = json.loads(timings.read_text()) if timings.exists() else []
    start = min((r["started_at"] for r in rows if r.get("started_at")), default=0.0)
    phase = [s for s in samples if s["t"] >= start]
    by_name: Counter[str] = Counter()
    for s in phase:
        for key, spent in s["cpu"].items():
            by_name[key.split(":", 1)[1]] += spent
    seconds, cpu = len(phase), sum(by_name.values())
    busy = sum(s["busy"] for s in phase) / max(1, seconds)
    print(f"{seconds} s sampled, {cpu:.0f} CPU s ({cpu / max(1, seconds):.2f} cores), "
          f"machine busy {busy:.0%}")  # fmt: skip
    for name, spent in by_name.most_common(12):
        print(f"  {spent:7.1f} CPU s  {spent / cpu:4.0%}  {name}")
    if rows:
        print("tests by CPU used while they ran (every process; a test beside it shares it):")
        per_test = []
        for r in rows:
            t0, t1 = r.get("started_at", 0.0), r.get("started_at", 0.0) + r["seconds"]
            inside = [s for s in phase if t0 < s["t"] <= t1 + 0.5]
            used = sum(sum(s["cpu"].values()) for s in inside)
            idle = sum(2 * (1 - s["busy"]) for s in inside)
            per_test.append((used, idle, r))
        for used, idle, r in sorted(per_test, key=lambda p: -p[0])[:15]:
            print(f"  {r['seconds']:6.1f} s {used:6.1f} CPU s {idle:5.1f} idle core-s  {r['test']}")


if __name__ == "__main__":
    command, target = sys.argv[1], Path(sys.argv[2])
    if command == "sample":
        sample(target)
    else:
        report(target, Path(__file__).resolve().parent.parent / ".pytest_cache" / "timings.json")
