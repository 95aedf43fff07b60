"""The README's "Organizing a run" and "Volunteering for a run" blocks, run as printed, on
loopback: an organizer's run key, bootstrap, publication and listing; then a volunteer's doctor,
join from the ticket publish printed, the run page, and Ctrl-C.

Only what a machine of its own would make different is changed, each named in ``_literal``:
``0.0.0.0`` and port 31337 become loopback and a free port, the placeholders (``MADDR``,
``sgrun1...``) what the commands before printed, ``[optional parts]`` are left out, and
``swarmgrad`` / ``.venv/bin/swarmgrad`` is this environment's. ``scripts/setup.sh`` is what
this suite's own set-up ran; its corpus cache is lent to the volunteer's home.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from swarmgrad.simulations.swarm import DEMO_SPEC
from tests.helpers import ROOT, stop_processes, wait_for_pattern, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SWARMGRAD = str(Path(sys.executable).parent / "swarmgrad")


def _block(heading: str) -> list[str]:
    """The command lines of the first bash block under ``## heading`` (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _literal(line: str, values: dict[str, str]) -> list[str]:
    """``line`` as this machine runs it (see the module's docstring for what changes)."""
    line = re.sub(r"\s\[[^\]]*\]", "", line)  # [--json], [--bootstrap MADDR2]: optional
    words = shlex.split(line)
    if words[0] in ("swarmgrad", ".venv/bin/swarmgrad"):
        words[0] = SWARMGRAD
    swapped = {"0.0.0.0": "127.0.0.1", "31337": values["port"]} | values
    return [swapped.get(word, word) for word in words]


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_the_organizer_and_volunteer_paths_work_as_printed(tmp_path: Path, cache_dir: Path) -> None:
    organizer, volunteer = tmp_path / "organizer", tmp_path / "volunteer"
    for home in (organizer, volunteer):
        home.mkdir()
    (volunteer / "cache").symlink_to(cache_dir)  # what the volunteer's set-up leaves
    (organizer / "run.toml").write_text(DEMO_SPEC)
    values = {"port": _free_port()}
    started: list[subprocess.Popen[bytes]] = []

    def run(line: str, home: Path, *, wait_for: str = "") -> str:
        """Run one printed line in ``home`` (its SWARMGRAD_HOME and working directory): to its
        end, or (``wait_for``) in the background until its output matches."""
        command = _literal(line, values)
        env = {**os.environ, "SWARMGRAD_HOME": str(home), "COLUMNS": "200"}
        log = home / f"{len(started)}-{Path(command[1] if len(command) > 1 else 'x').name}.log"
        if not wait_for:
            done = subprocess.run(command, cwd=home, env=env, capture_output=True, text=True,
                                  timeout=180)  # fmt: skip
            assert done.returncode == 0, (line, done.stdout, done.stderr[-3000:])
            return done.stdout
        with log.open("w") as output:
            started.append(subprocess.Popen(command, cwd=home, env=env, stdout=output,
                                            stderr=subprocess.STDOUT))  # fmt: skip
        return str(wait_for_pattern(log, wait_for, timeout_seconds=180)[0])

    try:
        key, boot, publish, runs = _block("Organizing a run")
        assert "fingerprint" in run(key, organizer)
        values["MADDR"] = run(boot, organizer, wait_for=r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+")
        ticket = re.search(r"sgrun1\.\S+", run(publish, organizer, wait_for=r"sgrun1\.\S+"))
        assert ticket is not None
        assert "shakespeare-demo" in run(runs, organizer)

        setup, doctor, join, dashboard = _block("Volunteering for a run")
        assert setup.startswith("scripts/setup.sh")  # the suite's own set-up ran it
        placeholder = re.search(r"sgrun1\.\S+", join)
        assert placeholder is not None
        values[placeholder[0]] = ticket[0]
        assert "all checks passed" in run(doctor, volunteer)
        run(join, volunteer, wait_for="joined run shakespeare-demo")
        node = volunteer / "node.json"  # the --status-file the README gives
        wait_until(node.exists, timeout_seconds=120, what="the volunteer's status file")
        me = json.loads(node.read_text())["peer_id"]
        url = re.search(r"http://\S+/", run(dashboard, volunteer, wait_for=r"run page at \S+"))
        assert url is not None

        def page() -> dict:
            with urllib.request.urlopen(url[0] + "api/run", timeout=10) as answer:
                return dict(json.load(answer))

        shown = wait_until(lambda: me in {p["peer_id"] for p in page()["peers"]} and page(),
                           timeout_seconds=120, what="the volunteer on the run page")  # fmt: skip
        assert shown["node"]["peer_id"] == me
        joined = started[2]
        joined.send_signal(signal.SIGINT)  # the README's Ctrl-C in the join's terminal
        assert joined.wait(timeout=120) == 0
    finally:
        stop_processes(started, signal.SIGTERM, timeout_seconds=20)
