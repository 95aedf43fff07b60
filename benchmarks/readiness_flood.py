#!/usr/bin/env python3
"""The epoch rate of a small swarm under a flood of throwaway readiness records, against calm.

    .venv/bin/python benchmarks/readiness_flood.py                  # 3 nodes, 2 trials per arm
    .venv/bin/python benchmarks/readiness_flood.py --nodes 4 --rounds 14 --trials 3 --json out.json

Each trial runs the demo spec on ``--nodes`` real node processes (``swarmgrad simulate``'s
``simulate``), calm and then flooded (the arms alternate, so the machine's load hits both alike).
Once every node has landed its first round, the flooded arm starts the attacker of issue 42's
finding 4 in a process of its own (``--flood``): a plain hivemind DHT client (no validator of
its own) through which ``--keys`` fresh keys each seal one readiness record (its own peer id, an
endpoint where nothing listens) under each of the swarm's next ``--ahead`` round keys, renewed
before they expire, half of them padded to ~4 KB; ``--with-records`` of those keys also announce
peer records at the swarm's epoch. The window is measured from that moment (the same moment in
the calm arm) to the last node's last epoch: epochs per minute of the slowest node.

The attacker's own process (signing ~200 records a second, its DHT client and daemon: ~0.3 of a
core here) shares the machine's cores with the nodes, where a real attacker brings its own. So a
third arm, **placebo**, runs the same attacker beside a calm swarm, storing into a DHT node of its
own (no validator: what it stores costs that node nothing) instead of the swarm's: flooded /
placebo is what the flood costs the swarm itself, flooded / calm what it cost on this machine.
Printed: each trial's rates, their median and spread per arm, and both ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from swarmgrad.simulations.profiles import SimulationError
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate

DEAD = "127.0.0.1:9"  # nothing listens there (the discard port)
IGNORED = re.compile(r"round \d+: (\d+) readiness records from peers it does not count")
PAD_TO_BYTES = 4096  # the finding's records: a body padded to the old record limit
#: Each trial's swarms, in this order: the placebo's attacker floods a DHT node of its own.
ARMS = ("calm", "placebo", "flooded")


def _statuses(folder: Path, nodes: int) -> list[dict[str, Any]]:
    found = []
    for i in range(nodes):
        try:
            found.append(json.loads((folder / f"node-{i}.json").read_text()))
        except (OSError, ValueError):  # not written yet, or being written
            found.append({})
    return found


def run_arm(args: argparse.Namespace, arm: str, out: Path) -> dict[str, Any]:
    """One swarm to ``--rounds`` epochs, flooded from its first landed round if ``arm`` is
    "flooded"; its rate over the window."""
    load_before = os.getloadavg()[0]  # the machine's load: other work skews the rates
    sim = out / "sim"
    spec = out / "run.toml"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(DEMO_SPEC)
    config = SimulationConfig(
        nodes=args.nodes,
        rounds=args.rounds,
        out_dir=sim,
        spec_path=spec,
        seed=1,
        timeout_seconds=args.timeout,
    )
    failed: list[str] = []
    done = threading.Event()
    attacker: list[subprocess.Popen[str]] = []
    samples: list[tuple[float, int]] = []  # (when, the slowest node's epoch), from the start

    def watch() -> None:
        started = False
        while not done.wait(0.25):
            if arm != "calm" and not attacker and (sim / "bootstrap.json").exists():
                attacker.append(_start_attacker(args, sim, spec, out))  # joins the DHT, waits
            epochs = [s.get("epoch", 0) for s in _statuses(sim, args.nodes)]
            if not started and all(e >= 1 for e in epochs):
                started = True
                if attacker:  # flood, and count from when the flood is in the DHT
                    process = attacker[0]
                    assert process.stdin is not None
                    assert process.stdout is not None
                    process.stdin.write("go\n")
                    process.stdin.flush()
                    if process.stdout.readline().strip() != "flooding":
                        failed.append(f"the attacker failed: see {out / 'attacker.log'}")
                    epochs = [s.get("epoch", 0) for s in _statuses(sim, args.nodes)]
            if started:
                samples.append((time.monotonic(), min(epochs)))

    watcher = threading.Thread(target=watch, name=f"watch-{arm}", daemon=True)
    watcher.start()
    try:
        simulate(config)
    except SimulationError as error:  # stuck: the rate says how far it got
        failed.append(str(error)[-500:])
    finally:
        done.set()
        watcher.join()
    report: dict[str, Any] = {"arm": arm, "load_before": load_before}
    for process in attacker:
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
            lines = process.communicate(input="", timeout=60)[0].strip().splitlines()
            report["attacker"] = json.loads(lines[-1]) if lines else {}
        if process.poll() is None:
            process.kill()
    if not samples:
        return report | {"error": failed or "no round landed"}
    start, first = samples[0]
    last_epoch = samples[-1][1]
    end = next(t for t, e in samples if e == last_epoch)
    statuses = _statuses(sim, args.nodes)
    # What the nodes' matchmaking saw of the flood (and left out): its log line per round.
    ignored = [
        [int(m) for m in IGNORED.findall((sim / f"node-{i}.log").read_text(errors="replace"))]
        for i in range(args.nodes)
    ]
    report |= {
        "rounds_seeing_the_flood": [len(counts) for counts in ignored],
        "records_left_out": max((max(c) for c in ignored if c), default=0),
        "epochs": last_epoch - first,
        "seconds": end - start,
        "epochs_per_minute": 60.0 * (last_epoch - first) / max(end - start, 1e-9),
        "outcomes": [s.get("outcomes", {}) for s in statuses],
        # Whole run, per node: where its time went (training, or rounds: matchmaking included).
        "compute_seconds": [round(s.get("compute_seconds", 0.0), 1) for s in statuses],
        "communication_seconds": [round(s.get("communication_seconds", 0.0), 1) for s in statuses],
        "stuck": failed,
        "load_after": os.getloadavg()[0],
    }
    return report


def _start_attacker(
    args: argparse.Namespace, sim: Path, spec: Path, out: Path
) -> subprocess.Popen[str]:
    command = [
        sys.executable, __file__, "--flood",
        "--bootstrap-file", str(sim / "bootstrap.json"), "--status-dir", str(sim),
        "--spec", str(spec), "--nodes", str(args.nodes), "--keys", str(args.keys),
        "--ahead", str(args.ahead), "--with-records", str(args.with_records),
        *(["--placebo"] if out.name.startswith("placebo") else []),
    ]  # fmt: skip
    log = open(out / "attacker.log", "w")  # noqa: SIM115 - the attacker's, for its lifetime
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
    )


# -- the attacker -------------------------------------------------------------------------------


async def flood(args: argparse.Namespace) -> dict[str, Any]:
    """Flood until stdin closes; what was stored."""
    from hivemind.dht.node import DHTNode

    from swarmgrad.node.discovery.base import dht_time
    from swarmgrad.node.discovery.envelope import Kind, seal
    from swarmgrad.node.discovery.records import PeerRecord, ReadyRecord
    from swarmgrad.node.identity import Identity
    from swarmgrad.node.runspec import RunSpec

    spec = RunSpec.load(Path(args.spec))
    prefix = f"run/{spec.run.id}/{spec.hash.hex()}"
    maddrs = json.loads(await asyncio.to_thread(Path(args.bootstrap_file).read_text))["maddrs"]
    sink = None
    if args.placebo:  # a DHT node of its own, checking nothing: the swarm is not touched
        sink = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(a) for a in await sink.get_visible_maddrs()]
    # A slow machine answers slowly: hivemind's 3 s per request lost whole batches at load 20.
    client = await DHTNode.create(initial_peers=maddrs, client_mode=True, wait_timeout=15)
    keys = [Identity.generate() for _ in range(args.keys)]
    padded = set(range(0, args.keys, 2))  # every other key pads its records to ~4 KB
    sealed_until: dict[int | str, float] = {}
    stored = {"stored": 0, "refused": 0, "padded stored": 0}
    ttl_seconds = 60.0

    def ready(i: int, round_: int, now: float) -> tuple[str, bytes]:
        record = ReadyRecord(
            peer_id=keys[i].peer_id, run_id=spec.run.id, spec_hash=spec.hash.hex(),
            endpoint=DEAD, round=round_, bandwidth=1.0, weight=160.0, issued_at=now,
            expires_at=now + ttl_seconds,
        )  # fmt: skip
        body = record.body()
        if i in padded:
            body += b" " * (PAD_TO_BYTES - len(body))  # JSON takes the padding
        key = f"{prefix}/round/{round_}"
        return key, seal(keys[i], key=key, kind=Kind.READY, body=body, issued_at=now,
                         expires_at=record.expires_at)  # fmt: skip

    def peer(i: int, epoch: int, now: float) -> tuple[str, bytes]:
        record = PeerRecord.create(
            keys[i].peer_id, run_id=spec.run.id, spec_hash=spec.hash, endpoint=DEAD, now=now,
            ttl_seconds=ttl_seconds, epoch=epoch, reachability="direct",
        )  # fmt: skip
        key = f"{prefix}/peers"
        return key, seal(keys[i], key=key, kind=Kind.PEER, body=record.body(), issued_at=now,
                         expires_at=record.expires_at)  # fmt: skip

    async def store(batch: list[tuple[int, str, bytes]], expires: float, *, kind: str) -> None:
        async with asyncio.timeout(60):
            answers = await client.store_many(
                keys=[key for _, key, _ in batch],
                values=[value for *_, value in batch],
                expiration_time=expires,
                subkeys=[keys[i].peer_id for i, _, _ in batch],
                exclude_self=True,
            )
        for i, key, _ in batch:
            ok = bool(answers.get((key, keys[i].peer_id)))
            stored["stored" if ok else "refused"] += 1
            stored["padded stored"] += ok and kind == "readiness" and i in padded

    peers_epoch = -1

    async def flood_once(most_rounds: int | None = None) -> None:
        """Seal and store what is due (the nearest rounds first, at most ``most_rounds``)."""
        nonlocal peers_epoch
        epochs = [s.get("epoch", 0) for s in _statuses(Path(args.status_dir), args.nodes)]
        epoch = max(epochs) if epochs else 0
        now = dht_time()
        due = [
            r for r in range(max(0, epoch - 1), epoch + args.ahead)
            if sealed_until.get(r, 0.0) < now + ttl_seconds / 2
        ]  # fmt: skip
        for round_ in due[:most_rounds]:
            batch = [(i, *ready(i, round_, now)) for i in range(args.keys)]
            await store(batch, now + ttl_seconds, kind="readiness")
            sealed_until[round_] = now + ttl_seconds
        if args.with_records and (
            peers_epoch != epoch
            or "peers" not in sealed_until
            or sealed_until["peers"] < now + ttl_seconds / 2
        ):
            batch = [(i, *peer(i, epoch, now)) for i in range(args.with_records)]
            await store(batch, now + ttl_seconds, kind="peer records")
            sealed_until["peers"], peers_epoch = now + ttl_seconds, epoch

    async def keep_flooding() -> None:
        while True:
            await flood_once()
            await asyncio.sleep(1.0)

    await asyncio.to_thread(sys.stdin.readline)  # "go": the swarm has landed a round
    for _ in range(5):  # the coming rounds first, until the DHT holds them: the window starts
        await flood_once(most_rounds=3)
        epochs = [s.get("epoch", 0) for s in _statuses(Path(args.status_dir), args.nodes)]
        found = await client.get(f"{prefix}/round/{max(epochs) + 1}", latest=True)
        if found is not None and len(getattr(found.value, "data", {})) >= args.keys // 2:
            break
        sealed_until.clear()  # not there: seal and store again
    print("flooding", flush=True)
    cpu_began, began = time.process_time(), time.monotonic()
    task = asyncio.create_task(keep_flooding())
    await asyncio.to_thread(sys.stdin.read)  # until the benchmark closes it
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if task.done() and not task.cancelled() and task.exception() is not None:
        stored["error"] = repr(task.exception())  # type: ignore[assignment]
    # Its own CPU while flooding: on a small machine it is taken from the nodes it floods.
    cpu = {"cpu_seconds": round(time.process_time() - cpu_began, 1),
           "flood_seconds": round(time.monotonic() - began, 1)}  # fmt: skip
    await client.shutdown()
    if sink is not None:
        await sink.shutdown()
    return {"keys": args.keys, "ahead": args.ahead, "round_keys": len(sealed_until), **stored,
            **cpu}  # fmt: skip


# -----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=12, help="epochs each swarm trains to")
    parser.add_argument("--trials", type=int, default=2, help="calm and flooded swarms each")
    parser.add_argument("--keys", type=int, default=310, help="the flood's throwaway keys")
    parser.add_argument("--ahead", type=int, default=20, help="round keys flooded ahead")
    parser.add_argument(
        "--with-records", type=int, default=100, help="keys that also announce peer records"
    )
    parser.add_argument(
        "--arms", default=",".join(ARMS), help="the arms to run, in order (default: all three)"
    )
    parser.add_argument("--timeout", type=float, default=420.0, help="one swarm, at most")
    parser.add_argument("--json", type=Path, help="write the reports here")
    parser.add_argument("--work", type=Path, help="keep the swarms' files here (default: none)")
    parser.add_argument("--flood", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap-file", help=argparse.SUPPRESS)
    parser.add_argument("--status-dir", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--placebo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood:
        print(json.dumps(asyncio.run(flood(args))), flush=True)
        return
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        parser.error(f"--arms: {', '.join(sorted(unknown))} is none of {', '.join(ARMS)}")
    reports = []
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for trial in range(args.trials):
            for arm in arms:
                report = run_arm(args, arm, work / f"{arm}-{trial}")
                report["trial"] = trial
                reports.append(report)
                print(json.dumps(report), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(reports, indent=1))
    rates = {
        arm: [r["epochs_per_minute"] for r in reports if r["arm"] == arm and "seconds" in r]
        for arm in ARMS
    }
    for arm, values in rates.items():
        if values:
            middle, low, high = statistics.median(values), min(values), max(values)
            print(f"{arm:8s} epochs/min: median {middle:.2f} (min {low:.2f}, max {high:.2f}) "
                  f"over {len(values)} swarms")  # fmt: skip
    for base in ("calm", "placebo"):
        if rates[base] and rates["flooded"]:
            ratio = statistics.median(rates["flooded"]) / statistics.median(rates[base])
            print(f"flooded / {base}: {ratio:.0%}")


if __name__ == "__main__":
    main()
