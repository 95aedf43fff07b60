"""A node killed with SIGKILL in the middle of writing a checkpoint, twelve times over: every
restart resumes from the newest whole checkpoint, and no corrupt checkpoint is ever left where a
restart would look."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from swarmgrad.node.config import home
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.checkpoint import Checkpointer, CheckpointError, read
from swarmgrad.node.training.data import load_demo
from swarmgrad.simulations.launchers import LocalProcess
from swarmgrad.simulations.processes import Child
from tests.helpers import wait_for_pattern, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# A lone node in sync mode steps alone once it finds no group (0.2 s), a round a step, and
# checkpoints every round: many checkpoints a minute, each ~25 MB (parameters, Adam's moments,
# gradients, residual), so a write takes long enough to be caught in the act.
SPEC = """\
[run]
id = "restarts"

[model]
vocab_size = 2048
d_model = 192
n_layers = 3
n_heads = 4
seq_len = 64

[algorithm]
name = "sync"
inner_lr = 1e-3
target_batch_size = 16

[averaging]
codec = "none"
group_size = 2
matchmaking_timeout_seconds = 0.2

[node]
checkpoint_every_rounds = 1
keep_checkpoints = 3
metrics_address = "off"
"""
#: Kills, each aimed at a checkpoint being written: 9 starts of ~4 s each in CI (it was 12, 52 s
#: of the waiting lane; the assertions below hold for any count).
KILLS = 8


def _node_command(tmp_path: Path, spec_path: Path, folder: Path, *extra: str) -> list[str]:
    """``swarmgrad node`` on ``spec_path`` with its key in ``tmp_path`` and its checkpoints in
    ``folder``, logging plain lines, one torch thread."""
    return [
        sys.executable, "-m", "swarmgrad.node.cli", "node", str(spec_path),
        "--identity", str(tmp_path / "node.key"),
        "--cache-dir", str(home() / "cache"),
        "--checkpoint-dir", str(folder),
        "--display", "log",
        "--threads", "1",
        *extra,
    ]  # fmt: skip


def _newest_whole(folder: Path, spec: RunSpec) -> Path | None:
    """The checkpoint a restart must resume from; fails the test on any corrupt one."""
    candidates = Checkpointer(folder, spec, keep=3).candidates()  # not entered: leaves .tmp-*
    for path in candidates:
        try:
            read(path, spec=spec)
        except CheckpointError as error:
            pytest.fail(f"a corrupt checkpoint was left in place: {error}")
    return candidates[0] if candidates else None


def _writing(folder: Path) -> bool:
    return folder.is_dir() and any(p.name.startswith(".tmp-") for p in folder.iterdir())


def _alive(process: Child, log: Path) -> Callable[[], None]:
    def check() -> None:
        assert process.poll() is None, log.read_text()[-3000:]

    return check


def test_kill_9_mid_checkpoint_never_leaves_a_corrupt_one(tmp_path: Path) -> None:
    load_demo(home() / "cache", vocab_size=2048, prepare=False)  # prepared by set-up
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(SPEC)
    spec = RunSpec.load(spec_path)
    folder = tmp_path / "checkpoints"
    command = _node_command(tmp_path, spec_path, folder)
    mid_write, epochs = 0, []
    expected: Path | None = None
    for attempt in range(KILLS + 1):
        log = tmp_path / f"node-{attempt}.log"
        # Forked by the warm zygote: a process of its own that skips the imports (KILLS + 1 starts).
        node = LocalProcess("node", command, log, dict(os.environ), warm=True).popen
        try:
            if expected is None:
                wait_for_pattern(log, r"joined run", timeout_seconds=90, check=_alive(node, log))
            else:
                resumed = wait_for_pattern(
                    log,
                    r"resumed from (\S+) \(epoch (\d+)\)",
                    timeout_seconds=90,
                    check=_alive(node, log),
                )
                assert Path(resumed[1]) == expected
                epochs.append(int(resumed[2]))
            if attempt == KILLS:
                break
            # Let one checkpoint through (progress), then kill the node as soon as the next is
            # being written (its temp folder exists).
            for writing in (True, False, True):
                wait_until(
                    lambda w=writing: _writing(folder) == w,
                    timeout_seconds=90,
                    what="a checkpoint being written" if writing else "the write finished",
                    check=_alive(node, log),
                    interval_seconds=0.001,
                )
            os.kill(node.pid, signal.SIGKILL)
            node.wait(timeout=30)
            mid_write += _writing(folder)
            expected = _newest_whole(folder, spec)
            assert expected is not None
        finally:
            node.kill()
            node.wait()
        assert "skipping checkpoint" not in log.read_text()
    # Progress was kept across the kills (a resume never went back past a whole checkpoint)...
    assert epochs == sorted(epochs)
    assert epochs[-1] >= KILLS
    # ... and most kills really landed while a checkpoint was half-written.
    assert mid_write >= KILLS // 2, f"only {mid_write} of {KILLS} kills landed mid-write"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_fails_checkpoints_not_the_node(tmp_path: Path) -> None:
    """A disk that fills up while the node runs: every checkpoint (~25 MB) then overflows the
    4 MiB left, each save is logged as failed and leaves nothing half-written to fill it, and the
    node trains its epochs to the end. (A disk without room for one checkpoint at the start is
    refused before the network: test_preflight.)"""
    load_demo(home() / "cache", vocab_size=2048, prepare=False)  # prepared by set-up
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(SPEC)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], check=True)
    try:
        folder = small / "checkpoints"
        log = tmp_path / "node.log"
        command = _node_command(tmp_path, spec_path, folder, "--max-epochs", "3")
        node = LocalProcess("node", command, log, dict(os.environ), warm=True).popen
        try:
            # Past its start's checks (room for a checkpoint then), before its first round:
            # another program fills the disk but for 4 MiB.
            wait_for_pattern(log, r"joined run", timeout_seconds=90, check=_alive_popen(node, log))
            stats = os.statvfs(small)
            with (small / "filler").open("wb") as filler:
                for _ in range((stats.f_bavail * stats.f_frsize >> 20) - 4):
                    filler.write(bytes(1 << 20))
            returncode = node.wait(timeout=180)
        finally:
            node.kill()
            node.wait()
        text = log.read_text()
        assert returncode == 0, text[-3000:]
        assert text.count("checkpoint failed, training goes on") >= 3  # each round's, the last
        assert "No space left on device" in text
        assert re.search(r"stopped at epoch 3\b", text), text[-3000:]
        assert [p.name for p in folder.iterdir()] == [".lock"]  # no temp folder left behind
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)


@pytest.mark.parametrize("discovery", ["hivemind", "libp2p"])
def test_a_ctrl_c_in_the_nodes_terminal_stops_it_gracefully(tmp_path: Path, discovery: str) -> None:
    """A terminal's Ctrl-C reaches every process of the foreground group: the node, its DHT
    process or sidecar, and p2pd. The node must still leave the swarm through its DHT, write its
    checkpoint and exit 0, and leave no process behind."""
    load_demo(home() / "cache", vocab_size=2048, prepare=False)  # prepared by set-up
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(
        SPEC.replace("checkpoint_every_rounds = 1", "checkpoint_every_rounds = 1000")
    )
    log = tmp_path / "node.log"
    command = _node_command(tmp_path, spec_path, tmp_path / "checkpoints", "--discovery", discovery)
    with log.open("w") as out:
        # A session of its own: the test's process group is not the one the "terminal" signals.
        node = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_pattern(log, r"epoch 2\b", timeout_seconds=120, check=_alive_popen(node, log))
        family = psutil.Process(node.pid).children(recursive=True)
        assert family, "the node runs its DHT in processes of its own"
        os.killpg(node.pid, signal.SIGINT)
        returncode = node.wait(timeout=60)
        text = log.read_text()
        assert returncode == 0, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert "could not announce leave" not in text
        # Nor was the DHT's p2pd told too (it un-ignores SIGINT): hivemind's shutdown then
        # waited out its grace and killed the DHT process (the exit 3 s late, 1 run in 3).
        assert "did not shut down within the grace period" not in text, text[-3000:]
        assert re.search(r"checkpoint epoch-\d+-step-\d+ ", text), text[-3000:]
        assert re.search(r"stopped at epoch \d+", text)
        _, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, f"left behind: {[p.name() for p in alive]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def _alive_popen(process: subprocess.Popen[bytes], log: Path) -> Callable[[], None]:
    def check() -> None:
        assert process.poll() is None, log.read_text()[-3000:]

    return check


def test_a_ctrl_c_ends_a_status_read_at_once(tmp_path: Path) -> None:
    """`swarmgrad status` only reads: the first Ctrl-C ends it (it used to say it was stopping,
    then wait out its whole timeout against a bootstrap that never answers)."""
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWMoN3kBu4HcwWGjRoiFSbDvaxpCRWUJfaQphoC82cVQx8"
    command = [sys.executable, "-m", "swarmgrad.node.cli", "status", "--run", "r",
               "--timeout", "60", "--bootstrap", dead]  # fmt: skip
    log = tmp_path / "status.log"
    with log.open("w") as out:
        reader = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_pattern(log, r"could not join the DHT", timeout_seconds=60)  # it is waiting
        started = time.monotonic()
        os.killpg(reader.pid, signal.SIGINT)
        assert reader.wait(timeout=30) == 130, log.read_text()[-2000:]
        assert time.monotonic() - started < 20  # its DHT's teardown, not the 60 s timeout
        assert "Traceback" not in log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(reader.pid, signal.SIGKILL)
        reader.wait()
