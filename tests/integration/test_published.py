"""Publishing a run and joining it by its id, with real processes and a real DHT: the organizer's
run key signs the spec, ``runs`` lists it, ``join`` accepts only the spec that key signed (not a
look-alike another key publishes under the same run id) and starts a node that trains in it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.node.discovery.base import Discovery, dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import DiscoveryConfig, start_discovery
from swarmgrad.node.identity import Identity
from swarmgrad.node.published import PublishedRun
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.trust.allowlist import Allowlist
from swarmgrad.simulations.launchers import LocalProcess
from swarmgrad.simulations.processes import Child
from tests.helpers import stop_processes, wait_for_pattern, wait_until

SMALL = """\
[model]
vocab_size = 2048
d_model = 64
n_layers = 1
n_heads = 2
seq_len = 32
[algorithm]
inner_steps = 5
"""
SPEC = f"""\
[run]
id = "published-demo"
{SMALL}[averaging]
group_size = 2
matchmaking_timeout_seconds = 10.0
[trust]
mode = "open"
"""


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
    env["SWARMGRAD_HOME"] = str(home)
    return env


def swarmgrad(*args: str, home: Path) -> subprocess.Popen[bytes]:
    """A command whose output the test reads (``finish``)."""
    command = [sys.executable, "-m", "swarmgrad.node.cli", *args]
    return subprocess.Popen(command, env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def start(*args: str, home: Path, log: Path) -> Child:
    """A long-running command (a node, a publisher), forked by the warm zygote, its output in
    ``log``."""
    command = [sys.executable, "-m", "swarmgrad.node.cli", *args]
    return LocalProcess(args[0], command, log, _env(home), warm=True).popen


@pytest.fixture
def processes() -> Iterator[list[Child]]:
    """The test's processes, stopped (then killed) at its end."""
    started: list[Child] = []
    yield started
    stop_processes(started, signal.SIGTERM, timeout_seconds=20)


def bootstrap(tmp_path: Path, processes: list[Child]) -> list[str]:
    """Start a bootstrap node; the options that point a command at it."""
    maddrs = tmp_path / "boot.json"
    processes.append(
        start("bootstrap", "--maddrs-file", str(maddrs), home=tmp_path / "boot",
                  log=tmp_path / "boot.log")
    )  # fmt: skip
    wait_until(maddrs.exists, timeout_seconds=60, what="the bootstrap node")
    return ["--bootstrap-file", str(maddrs)]


#: A reader's deadline for commands that read the DHT: the default 30 s is a user's wait on an
#: idle machine; beside a swarm test a reader's start alone took most of it (CI: exit 4).
PATIENT = ("--timeout", "90")


def finish(process: subprocess.Popen[bytes], seconds: float) -> tuple[int, str]:
    out, err = process.communicate(timeout=seconds)
    return process.returncode, (out or b"").decode() + (err or b"").decode()


def test_a_volunteer_joins_a_published_run_by_its_id(
    tmp_path: Path, cache_dir: Path, processes: list[Child]
) -> None:
    boot = bootstrap(tmp_path, processes)
    organizer = tmp_path / "organizer"
    code, out = finish(swarmgrad("run-key", str(organizer / "run.key"), home=organizer), 60)
    assert code == 0, out
    fingerprint = out.split("fingerprint")[1].split(":")[1].split()[0]
    (organizer / "run.toml").write_text(SPEC)
    spec = RunSpec.from_toml(SPEC)
    processes.append(
        start("publish", str(organizer / "run.toml"), "--run-key",
                  str(organizer / "run.key"), *boot, home=organizer,
                  log=tmp_path / "publish.log")
    )  # fmt: skip
    # Someone else publishes a look-alike under the same run id, with their own key.
    mallory = tmp_path / "mallory"
    assert finish(swarmgrad("run-key", str(mallory / "run.key"), home=mallory), 60)[0] == 0
    (mallory / "run.toml").write_text(SPEC.replace("d_model = 64", "d_model = 32"))
    processes.append(
        start("publish", str(mallory / "run.toml"), "--run-key", str(mallory / "run.key"),
                  *boot, home=mallory, log=tmp_path / "mallory.log")
    )  # fmt: skip
    for log in ("publish.log", "mallory.log"):
        wait_for_pattern(tmp_path / log, "published run", timeout_seconds=60)

    code, out = finish(swarmgrad("runs", *boot, *PATIENT, "--json", home=tmp_path / "reader"), 120)
    assert code == 0, out
    listed = {(r["run_id"], r["run_key_id"]): r for r in json.loads(out)}
    assert listed[("published-demo", fingerprint)]["spec_hash"] == spec.short_hash
    assert listed[("published-demo", fingerprint)]["trust"] == "open"
    assert len(listed) == 2  # both are listed; the fingerprint says which is the organizer's

    volunteer = tmp_path / "volunteer-0"
    code, out = finish(swarmgrad("join", "published-demo", *boot, home=volunteer), 60)
    assert code == 2, out
    assert "give --run-key-id" in out
    code, out = finish(
        swarmgrad("join", "published-demo", "--run-key-id", "sg" + "a" * 34, *boot,
                  home=volunteer), 60,
    )  # fmt: skip
    assert code == 2, out
    assert "no run 'published-demo' published under run key" in out

    joiners = []
    for i in range(2):
        home = tmp_path / f"volunteer-{i}"
        joiners.append(
            start("join", "published-demo", "--run-key-id", fingerprint, *boot,
                      "--cache-dir", str(cache_dir), "--max-epochs", "2",
                      "--metrics-address", "off", "--display", "log",
                      "--status-file", str(home / "status.json"),
                      home=home, log=tmp_path / f"join-{i}.log")
        )  # fmt: skip
    processes += joiners
    for i, joiner in enumerate(joiners):
        code = joiner.wait(240)
        log = (tmp_path / f"join-{i}.log").read_text()
        assert code == 0, log[-3000:]
        home = tmp_path / f"volunteer-{i}"
        assert RunSpec.load(home / "runs" / "published-demo.toml").hash == spec.hash
        assert json.loads((home / "runs" / "known.json").read_text()) == {
            "published-demo": fingerprint
        }
        status = json.loads((home / "status.json").read_text())
        assert status["epoch"] == 2
        assert status["outcomes"].get("averaged", 0) >= 1, status["outcomes"]
    # A later join of that run under another key is refused: the fingerprint is remembered.
    code, out = finish(
        swarmgrad("join", "published-demo", "--run-key-id", "sg" + "b" * 34, *boot,
                  home=tmp_path / "volunteer-0"), 60,
    )  # fmt: skip
    assert code == 2, out
    assert f"was joined under run key {fingerprint}" in out


PRIVATE = f"""\
[run]
id = "private-demo"
{SMALL}[averaging]
group_size = 3
matchmaking_timeout_seconds = 4.0
[trust]
mode = "private"
run_key = "{{run_key}}"
"""


def _status(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def test_a_private_run_refuses_strangers_until_the_allowlist_takes_them_in(
    tmp_path: Path, cache_dir: Path, processes: list[Child]
) -> None:
    boot = bootstrap(tmp_path, processes)
    organizer = Identity.from_seed("private-run/organizer")
    organizer.save(tmp_path / "org.key")
    keys = [Identity.from_seed(f"private-run/node-{i}") for i in range(3)]
    spec = tmp_path / "run.toml"
    spec.write_text(PRIVATE.format(run_key=organizer.peer_id))
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text(f"# the founders\n{keys[0].peer_id}\n{keys[1].peer_id}\n")
    processes.append(
        start("publish", str(spec), "--run-key", str(tmp_path / "org.key"),
                  "--allowlist", str(allowlist), *boot, home=tmp_path / "org",
                  log=tmp_path / "publish.log")
    )  # fmt: skip
    wait_for_pattern(tmp_path / "publish.log", "published run", timeout_seconds=60)
    for i, key in enumerate(keys):
        home = tmp_path / f"node-{i}"
        key.save(tmp_path / f"node-{i}.key")
        processes.append(
            start("node", str(spec), *boot, "--identity", str(tmp_path / f"node-{i}.key"),
                      "--cache-dir", str(cache_dir), "--max-epochs", "300",
                      "--metrics-address", "off", "--display", "log", "--threads", "1",
                      "--status-file", str(home / "status.json"),
                      home=home, log=tmp_path / f"node-{i}.log")
        )  # fmt: skip
    statuses = [tmp_path / f"node-{i}" / "status.json" for i in range(3)]

    def alive() -> None:
        for process in processes:
            assert process.poll() is None, "a process exited"

    # The founders average together; the stranger is refused before matchmaking.
    wait_until(lambda: _status(statuses[0]).get("epoch", 0) >= 3, timeout_seconds=120,
               what="the founders at epoch 3", check=alive)  # fmt: skip
    stranger_log = tmp_path / "node-2.log"
    wait_for_pattern(stranger_log, r"this node \(sg\w+\) is NOT on it", timeout_seconds=30)
    for path in statuses[:2]:
        history = _status(path)["history"]
        assert all(h["group_size"] <= 2 for h in history), history
        assert any(h["outcome"] == "averaged" for h in history), history
    assert not any(h["outcome"] == "averaged" for h in _status(statuses[2]).get("history", []))
    # NOT_ALLOWED: the stranger's signed state requests were refused by the founders.
    wait_for_pattern(stranger_log, "NOT_ALLOWED", timeout_seconds=60, check=alive)

    # The organizer adds it; without a restart, it is let in and averages with them.
    allowlist.write_text(allowlist.read_text() + f"{keys[2].peer_id}  # joined later\n")
    wait_for_pattern(stranger_log, r"allowlist version \d+: 3 peer", timeout_seconds=60)

    def averaged_in_three() -> bool:
        history = _status(statuses[2]).get("history", [])
        return any(h["outcome"] == "averaged" and h["group_size"] == 3 for h in history)

    wait_until(averaged_in_three, timeout_seconds=120, what="the newcomer averaging",
               check=alive)  # fmt: skip


# -- hostile claims on a run id (issue 42) ------------------------------------------------------


def maddrs_of(boot: list[str]) -> tuple[str, ...]:
    return tuple(json.loads(Path(boot[1]).read_text())["maddrs"])


async def announcer(boot: list[str], identity: Identity, spec: RunSpec) -> Discovery:
    """A DHT node of this process in ``spec``'s run, as ``identity`` (a stranger's node)."""
    return await start_discovery(DiscoveryConfig(initial_peers=maddrs_of(boot)), identity,
                                 run_id=spec.run.id, spec_hash=spec.hash)  # fmt: skip


async def test_a_look_alike_announced_under_the_run_id_keeps_no_volunteer_out(
    tmp_path: Path, cache_dir: Path, processes: list[Child]
) -> None:
    boot = bootstrap(tmp_path, processes)
    organizer, mallory = Identity.from_seed("look-alike/org"), Identity.from_seed("look-alike/m")
    look_alike = SPEC.replace("d_model = 64", "d_model = 32")
    for name, key, text in (("org", organizer, SPEC), ("mallory", mallory, look_alike)):
        key.save(tmp_path / f"{name}.key")
        (tmp_path / f"{name}.toml").write_text(text)
        processes.append(
            start("publish", str(tmp_path / f"{name}.toml"), "--run-key",
                  str(tmp_path / f"{name}.key"), *boot, home=tmp_path / name,
                  log=tmp_path / f"publish-{name}.log")
        )  # fmt: skip
    # Mallory's nodes announce the look-alike under the run id, and another spec no run key
    # published (a node announces one spec, in its own slot).
    specs = [
        RunSpec.from_toml(look_alike),
        RunSpec.from_toml(SPEC.replace("d_model = 64", "d_model = 16")),
    ]
    strangers = [Identity.from_seed(f"look-alike/mallory-node-{i}") for i in range(2)]
    nodes = [await announcer(boot, node, spec) for node, spec in zip(strangers, specs, strict=True)]
    try:
        for node, spec in zip(nodes, specs, strict=True):
            await node.announce_spec(spec.canonical(), expires_at=dht_time() + 150)
        for name in ("org", "mallory"):
            await asyncio.to_thread(wait_for_pattern, tmp_path / f"publish-{name}.log",
                                    "published run", timeout_seconds=60)  # fmt: skip

        # runs names every claim, each run key in full (the table folds; these lines do not).
        code, out = await asyncio.to_thread(
            finish, swarmgrad("runs", *boot, *PATIENT, home=tmp_path), 120
        )
        assert code == 0, out
        assert "3 claims on run id 'published-demo'" in out, out
        for key, text in ((organizer, SPEC), (mallory, look_alike)):
            spec_hash = RunSpec.from_toml(text).hash.hex()
            assert f"spec {spec_hash}  signed by run key {key.peer_id}\n" in out, out
        assert f"spec {specs[1].hash.hex()}  signed by no run key" in out, out

        # A node tied to no run key refuses to join, as before: another spec is in use.
        code, out = await asyncio.to_thread(
            finish,
            swarmgrad("node", str(tmp_path / "org.toml"), *boot, "--cache-dir", str(cache_dir),
                      "--metrics-address", "off", "--display", "log",
                      home=tmp_path / "unkeyed"),
            120,
        )  # fmt: skip
        assert code == 3, out
        assert "different run spec" in out

        # The volunteer given the run key joins: the look-alikes are ignored, and named.
        home, log = tmp_path / "volunteer", tmp_path / "join.log"
        joiner = start("join", "published-demo", "--run-key-id", organizer.peer_id, *boot,
                       "--cache-dir", str(cache_dir), "--metrics-address", "off",
                       "--display", "log", home=home, log=log)  # fmt: skip
        processes.append(joiner)

        def running() -> None:
            assert joiner.poll() is None, log.read_text()[-3000:]

        await asyncio.to_thread(wait_for_pattern, log, "joined run published-demo",
                                timeout_seconds=120, check=running)  # fmt: skip
        ignored = re.findall(r"ignoring run spec (\w+) announced under run 'published-demo' "
                             r"by (\w+)", log.read_text())  # fmt: skip
        assert sorted(ignored) == sorted(
            (spec.short_hash, node.peer_id) for spec, node in zip(specs, strangers, strict=True)
        )
    finally:
        for node in nodes:
            await node.close()


async def test_runs_and_status_count_a_private_runs_peers_on_its_allowlist_only(
    tmp_path: Path, processes: list[Child]
) -> None:
    boot = bootstrap(tmp_path, processes)
    organizer = Identity.from_seed("private-peers/org")
    member, stranger = Identity.from_seed("private-peers/a"), Identity.from_seed("private-peers/b")
    text = PRIVATE.format(run_key=organizer.peer_id)
    spec = RunSpec.from_toml(text)
    (tmp_path / "run.toml").write_text(text)
    nodes = [await announcer(boot, each, spec) for each in (member, stranger)]
    try:
        expires_at = dht_time() + 150
        run = PublishedRun(run_id=spec.run.id, spec_hash=spec.hash.hex(), spec_toml=text,
                           published_at=dht_time())  # fmt: skip
        await nodes[0].publish_run(organizer, run.body(), expires_at=expires_at)
        allowlist = Allowlist(version=1, peers=frozenset({member.peer_id}))
        await nodes[0].publish_allowlist(organizer, allowlist.body(), expires_at=expires_at)
        for node, identity, epoch in ((nodes[0], member, 3), (nodes[1], stranger, 999)):
            record = PeerRecord.create(identity.peer_id, run_id=spec.run.id, spec_hash=spec.hash,
                                       endpoint="127.0.0.1:1", now=dht_time(), ttl_seconds=60,
                                       epoch=epoch)  # fmt: skip
            await node.announce(record)

        code, out = await asyncio.to_thread(
            finish, swarmgrad("runs", *boot, *PATIENT, "--json", home=tmp_path), 120
        )
        assert code == 0, out
        (row,) = json.loads(out)
        assert (row["peers"], row["not_on_allowlist"], row["epoch"]) == (1, 1, 3)
        code, out = await asyncio.to_thread(
            finish, swarmgrad("status", str(tmp_path / "run.toml"), *boot, *PATIENT, "--json",
                              home=tmp_path), 120,
        )  # fmt: skip
        assert code == 0, out
        shown = json.loads(out)
        assert [peer["peer_id"] for peer in shown["peers"]] == [member.peer_id]
        assert shown["not_on_allowlist"] == 1
    finally:
        for node in nodes:
            await node.close()
