#!/usr/bin/env python3
"""The baseline for ``benchmarks/pipeline.py``: the same model split served as a chain of
hivemind ``RemoteExpert`` s (``hivemind.moe``, the substrate under SWARM and Petals).

Each stage is a ``ModuleBackend`` on a hivemind ``Server`` in a process of its own (this file run
with ``serve``); the client calls the four experts in turn for every microbatch, and autograd
calls their backwards in reverse (each backward a separate call that recomputes the forward, as
ours do). The last expert takes the labels too and returns each sample's mean cross-entropy, so
no logits cross the wire: what our ForwardLoss does, in two calls instead of one. Tensors travel
uncompressed (fp32); each expert steps its own AdamW after every backward (hivemind's rule).

    python benchmarks/hivemind_chain.py serve --stage K --spec run.toml --peer MADDR --ready F
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarmgrad.node.pipeline.model import Stage, build_stage
from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.processes import stop_gracefully

READY_SECONDS = 120.0


class _LossHead(nn.Module):
    """The last stage as an expert: hidden states and labels in, each sample's loss out."""

    def __init__(self, stage: Stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.stage(hidden).float()
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return per_token.view(labels.shape).mean(dim=1)


def serve(stage_index: int, spec_path: Path, peers: list[str], ready: Path) -> None:
    """Serve one stage as a hivemind expert until SIGTERM; write the DHT's addresses to
    ``ready`` once the server takes requests."""
    from hivemind import DHT
    from hivemind.moe.server import ModuleBackend, Server
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    torch.set_num_threads(1)
    spec = RunSpec.load(spec_path)
    model, seq = spec.model, spec.model.seq_len
    stage = build_stage(model, spec.pipeline, stage_index, seed=spec.data.seed)
    hidden = BatchTensorDescriptor(seq, model.d_model)
    tokens = BatchTensorDescriptor(seq, dtype=torch.int64)
    module: nn.Module = _LossHead(stage) if stage.last else stage
    args = (hidden, tokens) if stage.last else ((tokens,) if stage.first else (hidden,))
    backend = ModuleBackend(
        f"stage.{stage_index}",
        module,
        optimizer=torch.optim.AdamW(module.parameters(), lr=spec.algorithm.inner_lr),
        args_schema=args,
        max_batch_size=spec.data.batch_size,
    )
    dht = DHT(initial_peers=peers, start=True)
    server = Server(dht, {backend.name: backend}, num_connection_handlers=1, start=True)
    server.ready.wait(READY_SECONDS)
    ready.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    dht.shutdown()


def chain_arm(
    work: Path, spec_text: str, steps: int, batches: Any, warmup_steps: int
) -> dict[str, Any]:
    """Train ``steps`` steps through four expert processes; the step times and losses (the
    batch's microbatches in flight at once, one thread each)."""
    from hivemind import DHT
    from hivemind.moe.server import get_experts

    spec_path = work / "hivemind.toml"
    spec_path.write_text(spec_text)
    spec = RunSpec.load(spec_path)
    stages, parts = spec.pipeline.stages, spec.pipeline.microbatches
    dht = DHT(start=True)
    peers = [str(a) for a in dht.get_visible_maddrs()]
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for k in range(stages):
            ready = work / f"hivemind-stage{k}.json"
            command = [sys.executable, __file__, "serve", "--stage", str(k)]
            command += ["--spec", str(spec_path), "--ready", str(ready)]
            command += [a for p in peers for a in ("--peer", p)]
            # In a session of its own: its connection handlers and p2p daemon stop with it.
            servers.append(
                subprocess.Popen(command, stderr=subprocess.DEVNULL, start_new_session=True)
            )
        uids = [f"stage.{k}" for k in range(stages)]
        deadline = time.monotonic() + READY_SECONDS
        experts = get_experts(dht, uids)
        while any(e is None for e in experts):
            if time.monotonic() > deadline or any(s.poll() is not None for s in servers):
                raise RuntimeError("the hivemind expert servers did not come up")
            time.sleep(0.5)
            experts = get_experts(dht, uids)

        def microbatch(x: torch.Tensor, y: torch.Tensor) -> float:
            h = x
            for expert in experts[:-1]:
                assert expert is not None
                h = expert(h)
            last = experts[-1]
            assert last is not None
            losses = last(h, y)
            losses.mean().backward()
            return float(losses.detach().mean())

        seconds, losses = [], []
        with concurrent.futures.ThreadPoolExecutor(parts) as pool:
            for _ in range(steps):
                inputs, targets = next(batches)
                started = time.monotonic()
                pairs = zip(inputs.chunk(parts), targets.chunk(parts), strict=True)
                results = list(pool.map(lambda pair: microbatch(*pair), pairs))
                seconds.append(time.monotonic() - started)
                losses.append(sum(results) / parts)
        median = sorted(seconds[warmup_steps:])[len(seconds[warmup_steps:]) // 2]
        return {
            "samples_per_second": spec.data.batch_size / median,
            "step_seconds_median": median,
            "step_seconds_spread": [min(seconds[warmup_steps:]), max(seconds[warmup_steps:])],
            "last_losses": losses[-5:],
            "boundaries": [],
        }
    finally:
        for server in servers:
            stop_gracefully(server, timeout_seconds=30.0)
        dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serving = commands.add_parser("serve", help="serve one stage as a hivemind expert")
    serving.add_argument("--stage", type=int, required=True)
    serving.add_argument("--spec", type=Path, required=True)
    serving.add_argument("--peer", action="append", default=[])
    serving.add_argument("--ready", type=Path, required=True)
    args = parser.parse_args()
    serve(args.stage, args.spec, args.peer, args.ready)


if __name__ == "__main__":
    main()
