"""Open runs under attack: the final loss with the open-mode defences vs the plain mean, per attack.

An algorithm study in one process, like ``diloco_gap.py``: N replicas of the demo model train
DiLoCo rounds on their own data streams; f of them are attackers (``simulations/attacks.py``).
Each round is averaged the way the swarm does it, with the node's own code: the vector is cut
into one part per member (``Group.partition``), members' values cross the run's codec (int8),
and each part's owner either takes the mean (a trusted run) or screens, aggregates with
CenteredClip and scores the members in its own :class:`TrustLedger` (an open run, results in
fp16, the owner's own values left out of its part, and the members' projection check of each
result: ``node/trust/checks.py``); a peer banned by the honest owners is left out of later
groups. A lying owner shifts its part's result (``lying_result``); in an open run the check
drops its part and convicts it. False check reports are not modelled here (their accusation
needs the wire: ``tests/integration/test_open_convictions.py``). Per seed and attack it reports
the final validation loss of

* ``honest``: the N - f honest peers alone, plain mean (the reference);
* ``open``: all N with the open-mode defences, and the round each attacker was banned in;
* ``mean``: all N with the plain mean;

and the ratios to the honest reference (target: open <= 1.05x; ALIE <= 1.03x of honest N).
Then the round time cost of open mode for the demo model at N nodes (target: open <= 1.25x
trusted), two ways (``open_cost.py``):

* the swarm: N real node processes on 127.0.0.1 (``simulate``), the demo spec in one group of N,
  trusted and open runs alternating (ABBA): the time between a node's rounds (inner steps, the
  averaging round and the outer step: what a run's progress costs), the averaging round alone
  (boundary to landed), the all-reduce within it, and the bytes each node sends a round;
* one all-reduce in one process: N members over gRPC, the CPU each spends and the bytes it
  uploads (all N on the same cores: the ratio is about the ratio of CPU).

    .venv/bin/python benchmarks/byzantine.py --seeds 1 --rounds 30        # ~15 min on 2 cores
    .venv/bin/python benchmarks/byzantine.py --round-cost-only            # ~15 min

With ``--swarm`` it runs the adversary suite instead (``adversaries.py``, whose options follow:
issue 42's attacks on a swarm of real node processes, before and after, one table):

    .venv/bin/python benchmarks/byzantine.py --swarm [--scenarios ...] [--before-tree PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from open_cost import round_cost, swarm_cost  # benchmarks/open_cost.py, beside this file

from swarmgrad.compression import decode, get_codec
from swarmgrad.node import config as node_config
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import load_corpus
from swarmgrad.node.training.model import GPT, build_model, flatten, unflatten
from swarmgrad.node.training.outer import OuterOptimizer
from swarmgrad.node.training.step import set_lr
from swarmgrad.node.trust.aggregate import Aggregate, Aggregator, aggregate
from swarmgrad.node.trust.checks import holds, part_seed, project, signs
from swarmgrad.node.trust.ledger import Flag, TrustLedger
from swarmgrad.node.trust.observations import Observation, observe_chunk
from swarmgrad.simulations.attacks import Attack, Attacker, lying_result
from swarmgrad.simulations.swarm import DEMO_SPEC


@dataclass(slots=True)
class Outcome:
    loss: float
    diverged: bool = False
    bans: dict[int, int] = field(default_factory=dict)  # peer -> round banned (by honest owners)


class Lab:
    def __init__(self, spec: RunSpec, *, seed: int, windows: int) -> None:
        self.spec, self.seed = spec, seed
        self.corpus = load_corpus(
            spec.data, vocab_size=spec.model.vocab_size, cache_dir=node_config.home() / "cache"
        )
        self.windows = self.corpus.validation(seq_len=spec.model.seq_len, num_windows=windows)
        self.initial = build_model(spec.model, seed=spec.data.seed + seed)

    def loss(self, model: GPT) -> float:
        with torch.no_grad():
            return float(model.loss(self.windows[:, :-1], self.windows[:, 1:]))

    def run(self, n: int, rounds: int, *, attackers: dict[int, Attack], mode: str) -> Outcome:
        """``n`` replicas (``attackers`` among them) for ``rounds`` rounds; mode "mean" or
        "open"."""
        algorithm = self.spec.algorithm
        models = [copy.deepcopy(self.initial) for _ in range(n)]
        optimizers = [
            torch.optim.AdamW(m.parameters(), lr=algorithm.inner_lr, weight_decay=0.0)
            for m in models
        ]
        streams = [
            self.corpus.batches(
                seq_len=self.spec.model.seq_len,
                batch_size=self.spec.data.batch_size,
                seed=self.spec.data.seed,
                peer_id=f"byzantine-{self.seed}-{i}",
            )
            for i in range(n)
        ]
        outer = OuterOptimizer(
            flatten(list(self.initial.parameters())),
            lr=algorithm.outer_lr,
            momentum=algorithm.outer_momentum,
        )
        evil = {i: Attacker(a, seed=self.seed * 100 + i) for i, a in attackers.items()}
        ledgers = {i: TrustLedger() for i in range(n) if i not in attackers}
        outcome = Outcome(loss=float("nan"))
        codec = get_codec(self.spec.averaging.codec)
        for round_ in range(rounds):
            live = [i for i in range(n) if i not in outcome.bans]
            deltas: dict[int, torch.Tensor] = {}
            for i in live:
                model, optimizer = models[i], optimizers[i]
                for step in range(algorithm.inner_steps):
                    inputs, targets = next(streams[i])
                    model.loss(inputs, targets).backward()  # type: ignore[no-untyped-call]
                    set_lr(optimizer, algorithm.lr_at(round_ * algorithm.inner_steps + step))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                deltas[i] = outer.pseudo_gradient(flatten(list(model.parameters())))
            honest = [deltas[i] for i in live if i not in evil]
            for i, attacker in evil.items():
                if i in deltas:
                    deltas[i] = attacker.update(deltas[i], honest)
            liars = {i for i, a in attackers.items() if a is Attack.LYING_OWNER}
            averaged, missing = self._average(
                round_, live, deltas, codec, ledgers if mode == "open" else None, liars
            )
            for peer_ledger in ledgers.values():
                for peer_id, ban in peer_ledger.bans.items():
                    outcome.bans.setdefault(int(peer_id), ban.round)
            if not torch.isfinite(averaged).all():
                return Outcome(loss=float("inf"), diverged=True, bans=outcome.bans)
            # Parts whose result members could not decode apply nothing (a node keeps its own
            # pseudo-gradient there as carry; one shared optimizer here keeps none).
            theta = outer.step(averaged, own=torch.zeros_like(averaged), missing=missing)
            for model in models:
                unflatten(theta, list(model.parameters()))
        outcome.loss = self.loss(models[next(i for i in range(n) if i not in evil)])
        outcome.diverged = not outcome.loss < 20
        return outcome

    def _average(
        self,
        round_: int,
        live: list[int],
        deltas: dict[int, torch.Tensor],
        codec: object,
        ledgers: dict[int, TrustLedger] | None,
        liars: set[int],
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """One round as the owners compute it (``ledgers``: open mode, else the plain mean);
        the result and the parts members could not decode (an owner's own NaN)."""
        group = Group(
            round=round_, members=tuple(Member(peer_id=str(i), endpoint="-") for i in live)
        )
        size = next(iter(deltas.values())).numel()
        out = torch.zeros(size)
        missing: list[tuple[int, int]] = []
        result_codec = get_codec("fp16" if ledgers is not None else self.spec.averaging.codec)
        for part, (start, end) in enumerate(group.partition(size)):
            owner = live[part]
            rows, members, observations = [], [], {}
            for i in live:
                if i == owner and ledgers is not None:
                    continue  # an open run's owner keeps its own values out of its part
                values = deltas[i][start:end]
                if i != owner:  # what crosses the wire (NaN never survives a decode)
                    if not torch.isfinite(values).all():
                        observations[str(i)] = Observation(flags={Flag.NON_FINITE})
                        continue
                    values = decode(*codec.encode(values))  # type: ignore[attr-defined]
                rows.append(values)
                members.append(i)
            stack = torch.stack(rows)
            outcome = None
            if ledgers is None:
                value = stack.mean(0)
            else:
                outcome = aggregate(stack, Aggregator.CENTERED_CLIP)
                value = outcome.value
                names = [str(i) for i in members]
                observe_chunk(observations, names, stack, outcome, (start, end - start))
                if owner in ledgers:
                    observations.pop(str(owner), None)
                    ledgers[owner].observe(round_, observations)
            if owner in liars:
                value = lying_result(0, value)
            if not torch.isfinite(value).all():  # refused on decode (NON_FINITE) by members
                missing.append((start, end))
                continue
            received = decode(*result_codec.encode(value))
            if (
                outcome is not None
                and ledgers is not None
                and not _passes(stack, outcome, received)
            ):
                missing.append((start, end))  # members drop the part, convict its owner
                for ledger in ledgers.values():
                    ledger.note(round_, {str(owner): Flag.LYING_OWNER})
                continue
            out[start:end] = received
        return out, sorted(missing)


def _passes(stack: torch.Tensor, outcome: Aggregate, received: torch.Tensor) -> bool:
    """The members' projection check of one part's result (their reports, summed)."""
    seed = part_seed(secrets.token_bytes(32), {0: secrets.token_bytes(32)})
    vectors = signs(seed, 0, received.numel())
    clips = [outcome.clip[k] for k in outcome.used]
    reports = [project(stack[k], outcome.clip[k], vectors) for k in outcome.used]
    return holds(received, clips, reports, vectors)[0]


def _save(rows: list[dict[str, object]], path: str | None) -> None:
    if path:  # after every row: a long study stopped early keeps what it measured
        with open(path, "w") as out:
            json.dump(rows, out, indent=1)


def study(args: argparse.Namespace) -> list[dict[str, object]]:
    torch.set_num_threads(args.threads)
    spec = RunSpec.from_toml(DEMO_SPEC)
    n, f = args.nodes, args.attackers
    rows: list[dict[str, object]] = []
    for seed in args.seeds:
        lab = Lab(spec, seed=seed, windows=args.eval_windows)
        began = time.monotonic()
        honest = lab.run(n - f, args.rounds, attackers={}, mode="mean").loss
        honest_all = lab.run(n, args.rounds, attackers={}, mode="mean").loss
        calm = lab.run(n, args.rounds, attackers={}, mode="open")
        print(
            f"seed {seed}: honest {n - f} {honest:.3f}, honest {n} {honest_all:.3f}, "
            f"open with no attacker {calm.loss:.3f} (false bans: {len(calm.bans)}) "
            f"[{time.monotonic() - began:.0f} s]",
            flush=True,
        )
        rows.append(
            {"seed": seed, "attack": "none", "honest": honest, "honest_all": honest_all,
             "open": calm.loss, "mean": honest_all, "bans": calm.bans, "false_bans": len(calm.bans)}
        )  # fmt: skip
        _save(rows, args.json)
        for attack in args.attacks:
            bad = {i: Attack(attack) for i in range(n - f, n)}
            opened = lab.run(n, args.rounds, attackers=bad, mode="open")
            plain = lab.run(n, args.rounds, attackers=bad, mode="mean")
            false_bans = sum(1 for peer in opened.bans if peer < n - f)
            rows.append(
                {"seed": seed, "attack": attack, "honest": honest, "honest_all": honest_all,
                 "open": opened.loss, "mean": plain.loss, "bans": opened.bans,
                 "false_bans": false_bans}
            )  # fmt: skip
            _save(rows, args.json)
            print(
                f"  {attack:<12} open {opened.loss:.3f} ({opened.loss / honest:.3f}x) "
                f"mean {'diverged' if plain.diverged else f'{plain.loss:.3f}'} "
                f"({plain.loss / honest:.2f}x) bans {opened.bans} "
                f"[{time.monotonic() - began:.0f} s]",
                flush=True,
            )
    return rows


def report(rows: list[dict[str, object]], n: int, f: int) -> None:
    print(f"\nN = {n}, f = {f}; final validation loss, median over seeds [min, max]; ratio to the "
          f"honest {n - f} peers' plain mean")  # fmt: skip
    print(f"{'attack':<12} {'seeds':>5} {'open':>22} {'mean':>24} {'banned in round':>16} "
          f"{'false bans':>10}")  # fmt: skip
    for attack in dict.fromkeys(str(r["attack"]) for r in rows):
        mine = [r for r in rows if r["attack"] == attack]
        reference = "honest_all" if attack in ("none", "alie") else "honest"
        ratios = {
            mode: [float(r[mode]) / float(r[reference]) for r in mine]  # type: ignore[arg-type]
            for mode in ("open", "mean")
        }
        bans = sorted({b for r in mine for b in r["bans"].values()})  # type: ignore[attr-defined]
        cells = []
        for mode in ("open", "mean"):
            values = ratios[mode]
            if any(v == float("inf") for v in values):
                cells.append(f"diverged in {sum(v == float('inf') for v in values)}")
            else:
                cells.append(
                    f"{statistics.median(values):.3f}x [{min(values):.3f}, {max(values):.3f}]"
                )
        false_bans = sum(int(r["false_bans"]) for r in mine)  # type: ignore[call-overload]
        shown = ",".join(map(str, bans)) if bans else "-"
        print(f"{attack:<12} {len(mine):>5} {cells[0]:>22} {cells[1]:>24} {shown:>16} "
              f"{false_bans:>10}")  # fmt: skip
    print("(none, alie: ratio to all N honest peers' plain mean)")


def main() -> None:
    if "--swarm" in sys.argv[1:]:  # the suite's own options (--nodes, --rounds) differ
        import adversaries  # a sibling script

        adversaries.main([a for a in sys.argv[1:] if a != "--swarm"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    # False reports and withholding need the wire (the swarm suite: --swarm).
    modelled = [a.value for a in Attack if a not in (Attack.FALSE_REPORT, Attack.WITHHOLD_LIE)]
    parser.add_argument("--attacks", nargs="+", default=modelled, choices=modelled)
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--round-cost-repeats", type=int, default=10)
    parser.add_argument("--round-cost-only", action="store_true")
    parser.add_argument("--swarm-rounds", type=int, default=10, help="the swarm's cost: rounds")
    parser.add_argument("--swarm-repeats", type=int, default=3, help="the swarm's cost: repeats")
    parser.add_argument(
        "--swarm-upload-mb",
        type=float,
        nargs="+",
        default=[0.0],
        help="the swarm's cost: every node's uplink in MB/s, one set of runs each (0: no cap)",
    )
    parser.add_argument("--skip-one-process", action="store_true", help="only the swarm's cost")

    parser.add_argument("--json", help="also save the rows here (after each one)")
    parser.add_argument(
        "--from-json",
        nargs="+",
        help="only report the rows saved in these files (e.g. one per seed)",
    )
    args = parser.parse_args()
    logging.getLogger("swarmgrad").setLevel(logging.ERROR)  # bans are in the table
    if args.from_json:
        rows = []
        for path in args.from_json:
            with open(path) as saved:
                rows += json.load(saved)
        report(rows, args.nodes, args.attackers)
        return
    if not args.round_cost_only:
        rows = study(args)
        report(rows, args.nodes, args.attackers)
    for upload in args.swarm_upload_mb:
        swarm_cost(args.nodes, args.swarm_rounds, args.swarm_repeats, upload * 1e6)
    if not args.skip_one_process:
        asyncio.run(round_cost(args.nodes, args.round_cost_repeats))


if __name__ == "__main__":
    main()
