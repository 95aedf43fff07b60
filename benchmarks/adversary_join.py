"""The adversary suite's look-alike scenario: an organizer publishes the demo run, a stranger
publishes a look-alike spec under the same run id with a run key of its own and keeps announcing
it as a node would; volunteers run ``swarmgrad join RUN --run-key-id <the organizer's key>``.
Do they join, and train (issue 42, finding 5)?
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from adversary_runs import FLOODS, Settings, read_status, spec_text

from swarmgrad.node import config as node_config
from swarmgrad.node.identity import Identity
from swarmgrad.simulations.launchers import LocalProcess, Process, stop_all
from swarmgrad.simulations.processes import node_command

RUN_ID = "shakespeare-demo"
#: What the look-alike changes: a model the volunteers' data and checkpoints do not fit.
LOOK_ALIKE = ("d_model = 128", "d_model = 96")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
    return env | {"SWARMGRAD_HOME": str(home)}


def _wait(what: str, ready: Any, deadline: float, processes: list[Process]) -> None:
    while not ready():
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{process.name} exited:\n{process.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen in time")
        time.sleep(0.2)


def run_join(settings: Settings, out: Path) -> dict[str, Any]:
    """Run the scenario in ``out``; what each volunteer did."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + settings.timeout_seconds
    started: list[Process] = []
    announcer = None
    error, exits = None, []
    boot = out / "bootstrap.json"
    began = time.time()
    try:
        started.append(LocalProcess(
            "bootstrap", node_command("bootstrap", "--maddrs-file", str(boot)),
            out / "bootstrap.log", _env(out / "boot"), warm=True,
        ))  # fmt: skip
        _wait("the bootstrap", boot.exists, deadline, started)
        keys = {}
        for name, text in (
            ("organizer", spec_text(4)),
            ("stranger", spec_text(4).replace(*LOOK_ALIKE)),
        ):
            keys[name] = key = Identity.from_seed(f"adversary-suite/{name}")
            key.save(out / f"{name}.key")
            (out / f"{name}.toml").write_text(text)
            started.append(LocalProcess(
                f"publish-{name}", node_command(
                    "publish", str(out / f"{name}.toml"), "--run-key", str(out / f"{name}.key"),
                    "--bootstrap-file", str(boot)),
                out / f"publish-{name}.log", _env(out / name), warm=True,
            ))  # fmt: skip
        for process in started[1:]:
            _wait(f"{process.name}'s publication",
                  lambda p=process: "published run" in p.tail(50), deadline, started)  # fmt: skip
        # The stranger's node: the look-alike under the run id, renewed (a real node's slot).
        announcer = subprocess.Popen(
            [sys.executable, str(FLOODS), "announce", "--bootstrap-file", str(boot),
             "--spec", str(out / "stranger.toml"), "--seconds", str(settings.timeout_seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert announcer.stdout is not None
        for line in announcer.stdout:
            if line.strip() == "announced":
                break
        else:
            raise RuntimeError("the look-alike's announcer failed")
        volunteers = []
        for i in range(settings.volunteers):
            home = out / f"volunteer-{i}"
            volunteers.append(LocalProcess(
                f"join-{i}", node_command(
                    "join", RUN_ID, "--run-key-id", keys["organizer"].peer_id,
                    "--bootstrap-file", str(boot),
                    "--cache-dir", str(node_config.home() / "cache"),
                    "--max-epochs", str(settings.rounds), "--linger", "--threads", "1",
                    "--status-file", str(home / "status.json"), "--display", "log",
                    "--metrics-address", "off"),
                out / f"join-{i}.log", _env(home), warm=True,
            ))  # fmt: skip
        started += volunteers

        def settled() -> bool:
            return all(
                v.poll() is not None or read_status(out / f"volunteer-{i}" / "status.json").get(
                    "finished") for i, v in enumerate(volunteers)
            )  # fmt: skip

        try:
            _wait("every volunteer's last epoch", settled, deadline, [])
        except RuntimeError as failed:
            error = str(failed)
        exits = [v.poll() for v in volunteers]  # None: it trained to the end and lingers
    finally:
        if announcer is not None:
            announcer.communicate(input="", timeout=60)
        stop_all(started[::-1])
    rows = []
    for i, code in enumerate(exits):
        status = read_status(out / f"volunteer-{i}" / "status.json")
        log = (out / f"join-{i}.log").read_text(errors="replace")
        refused = re.search(r"(being trained with a different run spec[^\n]*)", log)
        rows.append({
            "exit": code,
            "joined": "joined run" in log,  # the node passed the spec check and is in the swarm
            "refused": refused[1][:200] if refused else "",
            "ignored_look_alikes": len(re.findall(r"ignoring run spec \w+ announced", log)),
            "epoch": status.get("epoch", 0),
            "outcomes": status.get("outcomes", {}),
            "val_loss": status.get("val_loss"),
        })  # fmt: skip
    return {
        "volunteers": rows,
        "trained": sum(1 for r in rows if r["epoch"] >= settings.rounds),
        "error": error,
        "wall_seconds": time.time() - began,
        "organizer_key": keys["organizer"].peer_id,
        "stranger_key": keys["stranger"].peer_id,
    }


if __name__ == "__main__":  # one scenario alone: python benchmarks/adversary_join.py OUT
    print(json.dumps(run_join(Settings(), Path(sys.argv[1])), indent=1))
