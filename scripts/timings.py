#!/usr/bin/env python3
"""The suite's time by lane, and its slowest tests, from the last run's
``.pytest_cache/timings.json`` (``tests/conftest.py`` writes it): ``scripts/timings.py [N]``."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main() -> int:
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    path = Path(__file__).resolve().parent.parent / ".pytest_cache" / "timings.json"
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"no timings to read ({error}): run the tests first", file=sys.stderr)
        return 1
    lanes: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        lanes[row["lane"]].append((row["seconds"], row.get("cpu_seconds", 0.0)))
    for lane, times in sorted(lanes.items()):
        wall, cpu = sum(t for t, _ in times), sum(c for _, c in times)
        print(f"{lane}: {len(times)} tests, {wall:.0f} s, {cpu:.0f} CPU s")
    print(f"slowest {top} (wall s, CPU s of the test and the processes it reaped):")
    for row in rows[:top]:
        cpu = row.get("cpu_seconds", 0.0)
        print(f"  {row['seconds']:7.1f} s {cpu:7.1f} cpu  {row['lane']:<13} {row['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
