"""Churn schedules for ``swarmgrad simulate --churn``: which node dies, leaves or (re)joins when.

A schedule is TOML, one ``[[event]]`` table per event, fired in order once the swarm (the newest
epoch any running node reports) reaches ``at_epoch``::

    [[event]]
    at_epoch = 3
    action = "kill"          # SIGKILL: no leave, no checkpoint (a crash, a power cut)
    node = 1
    during = "round"         # wait until the node is in an all-reduce (default: at once;
                             # a pause may wait too: a peer that freezes mid-round)

    [[event]]
    at_epoch = 4
    action = "start"         # node 4 joins (a new one), or a stopped/killed node restarts
    node = 4                 # with its identity and checkpoints

    [[event]]
    at_epoch = 4
    action = "kill"
    node = 4
    during = "state_download"  # while it downloads the swarm's state
                               # ("checkpoint": just after it wrote one, mid-round too)

    [[event]]
    at_epoch = 6
    action = "stop"          # SIGTERM: a graceful leave (record withdrawn, checkpoint written)
    node = 2

    [[event]]
    at_epoch = 6
    action = "pause"         # SIGSTOP: a partitioned or frozen peer (its DHT process lives on)
    node = 3

    [[event]]
    at_epoch = 8
    action = "resume"        # SIGCONT: it comes back, stale, and must catch up
    node = 3

With ``--netem`` (nodes in network namespaces) there are also ``partition`` (every packet to or
from the node dropped: it trains on, alone) and ``heal``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

ACTIONS = ("kill", "stop", "start", "pause", "resume", "partition", "heal")
#: Actions that may wait for a phase of the node's (``during``).
ARMED = ("kill", "pause")
#: Actions that cut a node off for a while, and the action that ends each.
UNTIL = {"pause": "resume", "partition": "heal"}
ENDS = {end: cut for cut, end in UNTIL.items()}
#: What a node logs when it enters each phase an event can wait for.
MARKERS = {
    "round": "averaging in a group of",
    "state_download": "downloading state",
    "checkpoint": "checkpoint epoch-",  # written (a failed write logs "checkpoint failed")
}


class ScheduleError(ValueError):
    """The churn schedule is invalid; the message names the event and what is wrong."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChurnEvent:
    at_epoch: int
    action: str
    node: int
    during: str = ""  # "" or a MARKERS key: a kill or a pause waits for that phase

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ScheduleError(f"action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if self.at_epoch < 0 or self.node < 0:
            raise ScheduleError("at_epoch and node must be >= 0")
        if self.during and (self.action not in ARMED or self.during not in MARKERS):
            raise ScheduleError(
                f"during = {self.during!r}: only a kill or a pause waits, for one of "
                f"{', '.join(MARKERS)}"
            )

    def describe(self) -> str:
        when = f" during its {self.during.replace('_', ' ')}" if self.during else ""
        if self.during == "checkpoint":
            when = " just after a checkpoint"
        return f"epoch {self.at_epoch}: {self.action} node {self.node}{when}"


def load_schedule(path: Path, *, nodes: int) -> list[ChurnEvent]:
    """The events in ``path``, checked against a swarm that starts with ``nodes`` nodes."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ScheduleError(f"cannot read churn schedule {path}: {error}") from None
    tables = raw.get("event")
    if set(raw) != {"event"} or not isinstance(tables, list) or not tables:
        raise ScheduleError(f"{path}: expected one or more [[event]] tables and nothing else")
    events = []
    for i, table in enumerate(tables):
        unknown = set(table) - {"at_epoch", "action", "node", "during"}
        if unknown:
            raise ScheduleError(f"{path}: event {i}: unknown key(s) {', '.join(sorted(unknown))}")
        try:
            events.append(ChurnEvent(**table))
        except (TypeError, ScheduleError) as error:
            raise ScheduleError(f"{path}: event {i}: {error}") from None
    if [e.at_epoch for e in events] != sorted(e.at_epoch for e in events):
        raise ScheduleError(f"{path}: list the events in the order of their at_epoch")
    running = set(range(nodes))
    ever = set(running)
    cut: dict[int, str] = {}  # node -> the action that cut it off (pause or partition)
    for i, event in enumerate(events):
        if event.action in ENDS:
            if cut.get(event.node) != ENDS[event.action]:
                raise ScheduleError(
                    f"{path}: event {i}: node {event.node} is not {_past(ENDS[event.action])}"
                )
            del cut[event.node]
        elif event.node in cut:
            raise ScheduleError(f"{path}: event {i}: node {event.node} is {_past(cut[event.node])}")
        elif event.action in UNTIL:
            if event.node not in running:
                raise ScheduleError(f"{path}: event {i}: node {event.node} is not running then")
            cut[event.node] = event.action
        elif event.action == "start":
            if event.node in running:
                raise ScheduleError(f"{path}: event {i}: node {event.node} is already running")
            if event.node not in ever and event.node != max(ever) + 1:
                raise ScheduleError(
                    f"{path}: event {i}: a new node must take the next index, {max(ever) + 1}"
                )
            running.add(event.node)
            ever.add(event.node)
        else:
            if event.node not in running:
                raise ScheduleError(f"{path}: event {i}: node {event.node} is not running then")
            running.discard(event.node)
    if not running - set(cut):
        raise ScheduleError(f"{path}: no node is left running at the end")
    if cut:
        ending = {"resume": "resumed", "heal": "healed"}
        never = " or ".join(sorted({ending[UNTIL[a]] for a in cut.values()}))
        raise ScheduleError(f"{path}: node(s) {sorted(cut)} are never {never}")
    return events


def _past(action: str) -> str:
    return {"pause": "paused then", "partition": "partitioned then"}[action]
