"""A node's local checks come before the network: a taken port (gRPC or metrics, for a pipeline
stage too), a missing data shard, a checkpoint folder it cannot write or with no room for a
checkpoint, and a CUDA device it does not have are exit 2 before the node joins anything, and
two nodes on one machine run with the defaults (the second's metrics on a free port)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmgrad.simulations.launchers import LocalProcess
from swarmgrad.simulations.pipeline import PIPELINE_DEMO_SPEC
from swarmgrad.simulations.swarm import DEMO_SPEC
from tests.helpers import light, stop_processes, wait_until

pytestmark = pytest.mark.slow

#: A bootstrap nobody answers at: a node that got as far as the network would fail there, with
#: exit 4, after its join deadline; one stopped by a local check never tries it.
NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def _node(tmp_path: Path, cache_dir: Path, name: str, *args: str) -> list[str]:
    spec = tmp_path / "run.toml"
    if not spec.exists():  # a lone node's first round (and status file) comes within seconds
        fast = light(DEMO_SPEC).replace(
            "matchmaking_timeout_seconds = 20.0", "matchmaking_timeout_seconds = 3.0"
        )
        assert fast != light(DEMO_SPEC)
        spec.write_text(fast)
    return [
        sys.executable, "-m", "swarmgrad.node.cli", "node", str(spec),
        "--identity", str(tmp_path / f"{name}.key"), "--cache-dir", str(cache_dir),
        "--checkpoint-dir", str(tmp_path / f"{name}-checkpoints"), "--display", "log",
        "--threads", "1", "--status-file", str(tmp_path / f"{name}.json"), *args,
    ]  # fmt: skip


def _refused(command: list[str]) -> str:
    """What ``command`` (a node) wrote before it stopped with exit 2. Forked by the warm zygote
    (the node's modules imported once, not seven times: the checks under test run after the
    imports either way)."""
    identity = Path(command[command.index("--identity") + 1])
    log = identity.with_suffix(".log")
    process = LocalProcess(identity.stem, command, log, dict(os.environ), warm=True).popen
    try:
        code = process.wait(timeout=120)
    finally:
        process.kill()
    text = log.read_text()
    assert (code, "Traceback" in text) == (2, False), text[-2000:]
    assert "peer id" not in text, text[-2000:]  # nothing started: no DHT, no key
    return text


def test_a_taken_port_or_a_missing_shard_stops_the_node_before_the_network(
    tmp_path: Path, cache_dir: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        grpc_taken = _refused(
            _node(tmp_path, cache_dir, "a", "--port", port, "--bootstrap", NOBODY)
        )
        metrics_taken = _refused(
            _node(tmp_path, cache_dir, "b", "--metrics-address", f"127.0.0.1:{port}",
                  "--bootstrap", NOBODY)
        )  # fmt: skip
        # A pipeline stage server checks the same, before its stage's DHT.
        pipeline = tmp_path / "pipe.toml"
        pipeline.write_text(PIPELINE_DEMO_SPEC.format(stages=2))
        stage = _node(tmp_path, cache_dir, "s", "--stage", "0", "--port", port,
                      "--bootstrap", NOBODY)  # fmt: skip
        stage[stage.index(str(tmp_path / "run.toml"))] = str(pipeline)
        stage_taken = _refused(stage)
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in stage_taken
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in grpc_taken
    assert f"cannot serve metrics on 127.0.0.1:{port}: the port is in use" in metrics_taken
    assert "--metrics-address" in metrics_taken  # what to do about it

    shards = tmp_path / "files.toml"
    shards.write_text(
        light(DEMO_SPEC).replace('source = "demo"', 'source = "files"\npaths = ["missing.txt"]')
    )
    command = _node(tmp_path, cache_dir, "c", "--bootstrap", NOBODY)
    command[command.index(str(tmp_path / "run.toml"))] = str(shards)
    missing = _refused(command)
    assert "data.paths: missing.txt does not exist" in missing

    (tmp_path / "a file").write_text("not a folder")
    unwritable = _refused(_node(tmp_path, cache_dir, "d", "--checkpoint-dir",
                                str(tmp_path / "a file"), "--bootstrap", NOBODY))  # fmt: skip
    assert f"cannot write checkpoints to {tmp_path / 'a file'}" in unwritable
    import torch

    if not torch.cuda.is_available():
        no_cuda = _refused(_node(tmp_path, cache_dir, "e", "--device", "cuda",
                                 "--bootstrap", NOBODY))  # fmt: skip
        assert "--device cuda: torch" in no_cuda
        assert "sees no CUDA device" in no_cuda
    with _small_disk(tmp_path / "small") as small:  # 1 MiB: the demo's checkpoint is ~13 MiB
        full = _refused(_node(tmp_path, cache_dir, "f", "--checkpoint-dir", str(small),
                              "--bootstrap", NOBODY))  # fmt: skip
    assert f"no room for a checkpoint in {small}: one takes ~" in full


@contextlib.contextmanager
def _small_disk(folder: Path) -> Iterator[Path]:
    """A 1 MiB file system at ``folder`` (a tmpfs; skips where this machine cannot mount)."""
    folder.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], capture_output=True, timeout=30)


@pytest.fixture
def nodes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    stop_processes(started)


def test_two_nodes_on_one_machine_run_with_the_default_metrics_address(
    tmp_path: Path, cache_dir: Path, nodes: list[subprocess.Popen[str]]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
    names = ("first", "second")
    for name in names:
        with (tmp_path / f"{name}.log").open("w") as log:
            command = _node(tmp_path, cache_dir, name)
            nodes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log, text=True))

    def urls() -> list[str]:
        for name, process in zip(names, nodes, strict=True):
            if process.poll() is not None:
                raise AssertionError((tmp_path / f"{name}.log").read_text()[-2000:])
        paths = [tmp_path / f"{name}.json" for name in names]
        found = [
            json.loads(path.read_text()).get("metrics_url", "") if path.exists() else ""
            for path in paths
        ]
        return found if all(found) else []

    served = wait_until(urls, timeout_seconds=120, what="both nodes' metrics URLs")
    assert served[0] != served[1]
    for url in served:  # each answers with its own node's series
        with urllib.request.urlopen(url, timeout=10) as response:
            assert b"swarmgrad_" in response.read()
