"""A pipeline swarm's processes on this machine (``pipeline.py``): a bootstrap, stage servers and
trainers as real node processes on 127.0.0.1, each (re)started with its own key, status, log and
checkpoints, and watched with deadlines."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmgrad.node import config as node_config
from swarmgrad.node.identity import Identity
from swarmgrad.simulations.launchers import LocalProcess
from swarmgrad.simulations.processes import crashing_stage_command, node_command
from swarmgrad.simulations.profiles import SimulationError


def trainer_identity(seed: int, index: int) -> Identity:
    """Trainer ``index``'s key in a pipeline simulation seeded ``seed``."""
    return Identity.from_seed(f"swarmgrad-pipeline:{seed}:trainer-{index}")


def stage_identity(seed: int, stage: int, replica: int) -> Identity:
    return Identity.from_seed(f"swarmgrad-pipeline:{seed}:stage-{stage}-{replica}")


@dataclass(slots=True)
class Member:
    """One process of the swarm: a stage replica or a trainer."""

    name: str
    args: list[str]
    status: Path
    log: Path
    process: LocalProcess | None = None

    def read(self) -> dict[str, Any]:
        """Its status file ({} before it wrote one)."""
        try:
            return dict(json.loads(self.status.read_text()))
        except (OSError, ValueError):
            return {}

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass(slots=True)
class PipelineSwarm:
    """``with PipelineSwarm(spec_path, out_dir) as swarm``: the processes started by its
    methods, all stopped (killed if they linger) when the block ends."""

    spec_path: Path
    out_dir: Path
    seed: int = 0
    timeout_seconds: float = 300.0
    discovery: str = "hivemind"
    #: Processes forked from the warm zygote (``zygote.py``), or each a fresh interpreter.
    fork_nodes: bool = True
    members: dict[str, Member] = field(default_factory=dict)
    _bootstrap: LocalProcess | None = None
    _maddrs: list[str] = field(default_factory=list)
    _env: dict[str, str] = field(default_factory=dict)

    def __enter__(self) -> PipelineSwarm:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
        maddrs_file = self.out_dir / "bootstrap.json"
        maddrs_file.unlink(missing_ok=True)
        self._bootstrap = LocalProcess(
            "bootstrap",
            node_command(
                "bootstrap",
                "--maddrs-file",
                str(maddrs_file),
                "--discovery",
                self.discovery,
                "--identity",
                str(self.out_dir / "bootstrap.key"),
            ),
            self.out_dir / "bootstrap.log",
            self._env,
            warm=self.fork_nodes,
        )
        deadline = time.monotonic() + 60
        while not maddrs_file.exists():
            if self._bootstrap.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SimulationError(f"the bootstrap did not start:\n{self._bootstrap.tail()}")
            time.sleep(0.1)
        self._maddrs = list(json.loads(maddrs_file.read_text())["maddrs"])
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for member in self.members.values():
            if member.process is not None:
                member.process.stop(10.0)
        if self._bootstrap is not None:
            self._bootstrap.stop(10.0)

    def _member(
        self,
        name: str,
        key: Identity,
        role_args: list[str],
        extra: list[str],
        crash_after_forwards: int | None = None,
    ) -> Member:
        """Start (or restart: the same key, status and log files) the member ``name``
        (``crash_after_forwards``: a stage server that dies then, ``faults.py``)."""
        status, log = self.out_dir / f"{name}.json", self.out_dir / f"{name}.log"
        key_path = self.out_dir / f"{name}.key"
        checkpoints = self.out_dir / "checkpoints" / name
        old = self.members.get(name)
        if old is not None and old.process is not None:
            old.process.kill()  # gone already (or killed now); its log file closed
        if old is None:  # a new member starts with nothing
            status.unlink(missing_ok=True)
            log.unlink(missing_ok=True)
            shutil.rmtree(checkpoints, ignore_errors=True)
            key.save(key_path)
        args = [
            "node",
            str(self.spec_path),
            *(a for m in self._maddrs for a in ("--bootstrap", m)),
            "--identity", str(key_path),
            "--cache-dir", str(node_config.home() / "cache"),
            "--status-file", str(status),
            "--display", "log",
            "--threads", "1",
            "--checkpoint-dir", str(checkpoints),
            "--metrics-address", "off",
            "--discovery", self.discovery,
            *role_args,
            *extra,
        ]  # fmt: skip
        member = self.members[name] = Member(name, args, status, log)
        command = (
            node_command(*args)
            if crash_after_forwards is None
            else crashing_stage_command(crash_after_forwards, *args)
        )
        member.process = LocalProcess(name, command, log, self._env, warm=self.fork_nodes)
        return member

    def start_stage(
        self, stage: int, replica: int = 0, *extra: str, crash_after_forwards: int | None = None
    ) -> Member:
        """(Re)start replica ``replica`` of ``stage``; ``extra``: more node options;
        ``crash_after_forwards``: it dies (SIGKILL) after answering that many forwards."""
        name = f"stage{stage}-{replica}"
        key = stage_identity(self.seed, stage, replica)
        return self._member(name, key, ["--stage", str(stage)], list(extra), crash_after_forwards)

    def start_trainer(self, index: int = 0, *extra: str) -> Member:
        name = f"trainer{index}"
        key = trainer_identity(self.seed, index)
        return self._member(name, key, ["--role", "trainer"], list(extra))

    def stages(self) -> Iterator[Member]:
        return (m for m in self.members.values() if m.name.startswith("stage"))

    def wait_serving(self, names: list[str] | None = None) -> None:
        """Until every (named) stage replica says it serves."""
        wanted = [self.members[n] for n in names] if names else list(self.stages())
        self.wait(lambda: all(m.read().get("state") == "serving" for m in wanted), "serving")

    def wait(self, condition: Any, what: str, timeout_seconds: float | None = None) -> None:
        """Until ``condition()``; fails (with the logs of any process that died) otherwise."""
        deadline = time.monotonic() + (timeout_seconds or self.timeout_seconds)
        while not condition():
            for member in self.members.values():
                if member.process is not None and member.process.poll() not in (None, 0, -9):
                    raise SimulationError(f"{member.name} exited:\n{member.process.tail(30)}")
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {m.name}\n{m.process.tail(8)}"
                    for m in self.members.values()
                    if m.process is not None
                )
                raise SimulationError(f"timed out waiting for {what}\n{tails}")
            time.sleep(0.1)

    def wait_finished(self, name: str) -> dict[str, Any]:
        """Until the member's process has exited; its final status."""
        member = self.members[name]
        self.wait(lambda: not member.alive, f"{name} to finish")
        assert member.process is not None
        if member.process.poll() != 0:
            raise SimulationError(f"{name} failed:\n{member.process.tail(30)}")
        return member.read()

    def kill(self, name: str) -> None:
        member = self.members[name]
        if member.process is not None:
            member.process.kill()
