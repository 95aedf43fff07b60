#!/usr/bin/env python3
"""A joiner downloading a run's state on loopback: swarmgrad vs hivemind's load_state_from_peers.

    python benchmarks/state_sync.py                       # 100 MB, 1/2/4 donors, capped at 20 MB/s
    python benchmarks/state_sync.py --mb 20 --repeats 1 --json out.json

Every donor and joiner is its own process. Each side is timed the same way, in two parts:
  ready:    from the joiner's process start (the parent's clock at spawn) until it has joined the
            DHT and can ask for state (imports, DHT, gRPC server or averager up);
  transfer: the state download itself, from asking until the tensors are in the joiner's memory.
swarmgrad's joiner finds its donors through the DHT (peer records), fetches the manifest and
downloads chunk ranges from all of them at once; hivemind's downloads from one donor.
Then swarmgrad with each donor's upload capped (a token bucket in the donor's send path, like a
home uplink), for k = 1, 2, 4 donors: the join time should fall close to 1/k.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUN_SPEC = '[run]\nid = "state-bench"\n'
EPOCH = 5


# -- processes (each prints JSON lines; never imports the other library) -------------------------


def swarmgrad_donor(args: argparse.Namespace) -> None:
    import torch

    from swarmgrad.node import Swarm, SwarmConfig
    from swarmgrad.node.identity import Identity
    from swarmgrad.node.runspec import RunSpec
    from swarmgrad.protocol import state

    async def serve() -> None:
        spec = RunSpec.from_toml(RUN_SPEC)
        config = SwarmConfig(
            bootstrap=tuple(json.loads(args.initial_peers)),
            upload_bytes_per_second=args.cap_bytes_per_second or None,
        )
        async with Swarm(spec, Identity.generate(), config) as swarm:
            values = torch.randn(args.values, generator=torch.Generator().manual_seed(0))
            swarm.publish(state.Snapshot.of(EPOCH, values), throughput=1.0)
            await asyncio.sleep(1.0)  # let the record with the checksum go out
            await swarm.refresh_peers()
            print(json.dumps({"event": "ready", "maddrs": swarm.visible_maddrs()}), flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # until the parent says so

    asyncio.run(serve())


def swarmgrad_joiner(args: argparse.Namespace) -> None:
    from swarmgrad.node import Swarm, SwarmConfig
    from swarmgrad.node.identity import Identity
    from swarmgrad.node.runspec import RunSpec

    async def join() -> dict[str, Any]:
        spec = RunSpec.from_toml(RUN_SPEC)
        config = SwarmConfig(bootstrap=tuple(json.loads(args.initial_peers)))
        async with Swarm(spec, Identity.generate(), config) as swarm:
            ready = time.time() - args.spawned_at
            started = time.perf_counter()
            deadline = time.monotonic() + 30
            while len(donors := await swarm.find_donors(0, "")) < args.donors:
                assert time.monotonic() < deadline, f"found {len(donors)} donors"
                await asyncio.sleep(0.2)
            snapshot = await swarm.download_state(donors, args.values)
            transfer = time.perf_counter() - started
            assert snapshot is not None
            assert snapshot.epoch == EPOCH
            return {"event": "done", "ready": ready, "transfer": transfer, "donors": len(donors)}

    print(json.dumps(asyncio.run(join())), flush=True)


def hivemind_donor(args: argparse.Namespace) -> None:
    import hivemind
    import torch

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    values = torch.randn(args.values, generator=torch.Generator().manual_seed(0))
    averager = hivemind.averaging.DecentralizedAverager(
        [values], dht, prefix="state-bench", allow_state_sharing=True, start=True
    )
    averager.state_sharing_priority = 1.0
    time.sleep(1.0)
    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    print(json.dumps({"event": "ready", "maddrs": maddrs}), flush=True)
    sys.stdin.readline()
    averager.shutdown()
    dht.shutdown()


def hivemind_joiner(args: argparse.Namespace) -> None:
    import hivemind
    import torch

    dht = hivemind.DHT(
        start=True,
        initial_peers=json.loads(args.initial_peers),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    )
    averager = hivemind.averaging.DecentralizedAverager(
        [torch.zeros(args.values)], dht, prefix="state-bench", start=True
    )
    ready = time.time() - args.spawned_at
    started = time.perf_counter()
    loaded = averager.load_state_from_peers(timeout=120)
    transfer = time.perf_counter() - started
    assert loaded is not None
    assert loaded[1][0].numel() == args.values
    print(json.dumps({"event": "done", "ready": ready, "transfer": transfer, "donors": 1}))
    averager.shutdown()
    dht.shutdown()


# -- the parent ---------------------------------------------------------------------------------


def _spawn(role: str, args: argparse.Namespace, **extra: Any) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--role", role, "--values", str(args.values)]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def _event(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    for line in process.stdout:  # bounded: the child exits or answers within its own deadlines
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"process exited with {process.wait()}")


def trial(side: str, donors: int, cap: float, args: argparse.Namespace) -> dict[str, Any]:
    started: list[subprocess.Popen[str]] = []
    try:
        first = _spawn(f"{side}-donor", args, initial_peers="[]", cap_bytes_per_second=cap)
        started.append(first)
        maddrs = _event(first)["maddrs"]
        for _ in range(donors - 1):
            started.append(
                _spawn(
                    f"{side}-donor",
                    args,
                    initial_peers=json.dumps(maddrs),
                    cap_bytes_per_second=cap,
                )
            )
        for donor in started[1:]:
            _event(donor)
        joiner = _spawn(
            f"{side}-joiner",
            args,
            initial_peers=json.dumps(maddrs),
            spawned_at=time.time(),
            donors=donors,
        )
        started.append(joiner)
        return _event(joiner)
    finally:
        for process in started:
            if process.poll() is None and process.stdin is not None:
                try:
                    process.stdin.write("exit\n")
                    process.stdin.flush()
                except BrokenPipeError:
                    pass
        for process in started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def summarize(times: list[float]) -> str:
    if len(times) == 1:
        return f"{times[0]:.2f}"
    return f"{statistics.median(times):.2f} [{min(times):.2f}-{max(times):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", default="parent")
    parser.add_argument("--values", type=int, default=0)
    parser.add_argument("--initial-peers", default="[]")
    parser.add_argument("--cap-bytes-per-second", type=float, default=0.0)
    parser.add_argument("--spawned-at", type=float, default=0.0)
    parser.add_argument("--donors", type=int, default=1)
    parser.add_argument("--mb", type=float, default=100.0, help="state size, MB (10^6 bytes)")
    parser.add_argument("--donor-counts", default="1,2,4")
    parser.add_argument("--cap-mb-per-second", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    roles = {
        "swarmgrad-donor": swarmgrad_donor,
        "swarmgrad-joiner": swarmgrad_joiner,
        "hivemind-donor": hivemind_donor,
        "hivemind-joiner": hivemind_joiner,
    }
    if args.role in roles:
        roles[args.role](args)
        return
    args.values = int(args.mb * 1e6 / 4)
    cap = args.cap_mb_per_second * 1e6
    settings = [("hivemind", 1, 0.0), ("swarmgrad", 1, 0.0)]
    settings += [("swarmgrad", int(k), cap) for k in args.donor_counts.split(",")]
    results = []
    print(f"{args.mb:g} MB of state ({args.values:,} fp32), {args.repeats} trial(s) each")
    print(f"{'side':<10} {'donors':>6} {'upload cap':>11} {'ready s':>18} {'transfer s':>18}")
    for side, donors, donor_cap in settings:
        trials = [trial(side, donors, donor_cap, args) for _ in range(args.repeats)]
        ready = [t["ready"] for t in trials]
        transfer = [t["transfer"] for t in trials]
        capped = f"{donor_cap / 1e6:g} MB/s" if donor_cap else "none"
        print(
            f"{side:<10} {donors:>6} {capped:>11} {summarize(ready):>18} {summarize(transfer):>18}",
            flush=True,
        )
        results.append(
            {"side": side, "donors": donors, "cap": donor_cap, "ready": ready, "transfer": transfer}
        )
    hivemind = statistics.median(results[0]["transfer"])
    ours = statistics.median(results[1]["transfer"])
    print(f"one donor, uncapped: swarmgrad / hivemind transfer time = {ours / hivemind:.2f}")
    capped_runs = results[2:]
    if capped_runs:
        base = statistics.median(capped_runs[0]["transfer"])
        for run in capped_runs:
            k, t = run["donors"], statistics.median(run["transfer"])
            print(
                f"capped, {k} donor(s): {t:.2f} s = {t / base:.2f} x one donor (ideal {1 / k:.2f})"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
