"""The node's terminal display: a live rich panel on a terminal, one log line a round otherwise."""

from __future__ import annotations

import asyncio
import math
import sys

from rich.console import Console
from rich.live import Live
from rich.table import Table

from swarmgrad.node.training.progress import Progress


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _loss(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def render(progress: Progress, *, endpoint: str, run: str) -> Table:
    table = Table(title=f"swarmgrad node {progress.peer_id[:16]}  run {run}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("endpoint", endpoint),
        ("algorithm / device", f"{progress.algorithm} / {progress.device or '-'}"),
        ("round (epoch)", str(progress.epoch)),
        ("loss (train / val)", f"{_loss(progress.loss)} / {_loss(progress.val_loss)}"),
        ("tokens/s", f"{progress.tokens_per_second:,.0f}"),
        ("MFU", "-" if math.isnan(progress.mfu) else f"{progress.mfu:.1%}"),
        ("inner lr", "-" if math.isnan(progress.lr) else f"{progress.lr:.3g}"),
        ("peers / group size", f"{progress.peers} / {progress.group_size}"),
        ("sent / received", f"{_bytes(progress.bytes_sent)} / {_bytes(progress.bytes_received)}"),
        ("last round", f"{progress.last_round_seconds:.2f} s"),
        ("rounds", ", ".join(f"{k} {v}" for k, v in sorted(progress.outcomes.items())) or "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


class Display:
    """``live`` redraws a panel twice a second; ``log``/``none`` leave output to the log lines."""

    def __init__(self, mode: str, *, endpoint: str, run: str) -> None:
        if mode == "auto":
            mode = "live" if sys.stderr.isatty() else "log"
        self.mode = mode
        self._endpoint, self._run = endpoint, run

    async def run(self, progress: Progress, done: asyncio.Task[None]) -> None:
        if self.mode != "live":
            return
        console = Console(stderr=True)
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while not done.done():
                live.update(render(progress, endpoint=self._endpoint, run=self._run))
                await asyncio.wait([done], timeout=0.5)
            live.update(render(progress, endpoint=self._endpoint, run=self._run))
