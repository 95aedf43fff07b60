"""Where the sparse codec's loss goes, on the demo model, with no network: error feedback at the
members only, or at the part owners too.

An algorithm study in one process, like ``benchmarks/diloco_gap.py``: N replicas of the demo
model, each on its own data stream, DiLoCo with the demo spec's schedule, and each outer round's
average taken through a model of the node's all-reduce:

* the vector is cut into N equal parts, part ``j`` owned by replica ``j``;
* a member sends each other owner its values of the part plus its residual, encoded with the
  round's codec, and keeps as its residual what the owner will not decode (as
  ``node/training/replica.py`` does); an owner's own values of its part go in unencoded;
* the owner averages what it decoded and encodes the average once for every member (as
  ``node/averaging/reducer.py`` does); with owner feedback (``+ owner``) it first adds the
  residual of its part and keeps what its encoding dropped for the next round.

The rows share the initial weights and the samples. Bytes are one peer's per round (the mean over
peers), up (to the other owners) and down (their results).

    .venv/bin/python benchmarks/sparse_feedback.py                   # ~8 min on 2 cores
    .venv/bin/python benchmarks/sparse_feedback.py --rounds 40 --settings fp32 sparse+owner
    # communication.py's settings (H = 25, outer 0.8/0.7, warm start), and a setting with outer
    # lr/momentum of its own after '@':
    .venv/bin/python benchmarks/sparse_feedback.py --rounds 10 --inner-steps 25 --outer 0.8/0.7 \
        --lr 3e-3 --schedule 25/0 --warm-start-steps 250 --settings fp32 sparse+owner@1.0/0.0
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

from swarmgrad.compression import Codec, decode, get_codec
from swarmgrad.node import config as node_config
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import load_corpus
from swarmgrad.node.training.model import build_model
from swarmgrad.simulations.baseline import diloco_exact, warm_start
from swarmgrad.simulations.swarm import DEMO_SPEC

#: name -> (the members' codec, its options, the owners' result codec (None: the same, at
#: ``result_density`` times the members' density), owner feedback)
SETTINGS: dict[str, tuple[str, dict[str, float], str | None, bool]] = {
    "fp32": ("none", {}, None, False),
    "int8": ("int8", {}, None, False),
    "sparse": ("sparse", {"bits": 2}, None, False),
    "sparse+owner": ("sparse", {"bits": 2}, None, True),
    "sparse4+owner": ("sparse", {"bits": 4}, None, True),
    "sparse/int8 down": ("sparse", {"bits": 2}, "int8", False),
    # shared random positions (a model, SharedMask), at about the sparse 2-bit payload's bytes
    "mask2+owner": ("mask", {"bits": 2, "k": 304}, None, True),
    "mask1+owner": ("mask", {"bits": 1, "k": 608}, None, True),
}


class SharedMask:
    """A model of a codec that sends no positions: every member keeps the same ``k`` random
    positions of each chunk, drawn from the round and the chunk's place in the whole vector (a
    seed all members know), so owners merge exactly and return values at the same positions.
    Values: a sign and ``bits - 1`` bits of level between the chunk's least and largest kept
    magnitude (``bits = 1``: the sign and the mean magnitude), two fp32 scales a chunk."""

    def __init__(self, k: int, bits: int, chunk: int = 4096) -> None:
        self.k, self.bits, self.chunk = k, bits, chunk

    def through(self, values: torch.Tensor, start: int, round_: int) -> tuple[torch.Tensor, int]:
        out, size = torch.zeros_like(values), 0
        first = start // self.chunk  # chunks of the whole vector that this range touches
        for c in range(first, -(-(start + values.numel()) // self.chunk)):
            g = torch.Generator().manual_seed(round_ * 1_000_003 + c)
            positions = torch.randperm(self.chunk, generator=g)[: self.k] + c * self.chunk
            here = positions[(positions >= start) & (positions < start + values.numel())] - start
            if here.numel() == 0:
                continue
            kept = values[here]
            mags = kept.abs()
            if self.bits == 1:
                quant = mags.mean().expand_as(mags)
            else:
                lo, hi = mags.min(), mags.max()
                levels = (1 << (self.bits - 1)) - 1
                step = (hi - lo) / levels if hi > lo else torch.tensor(1.0)
                quant = lo + ((mags - lo) / step).round().clamp(0, levels) * step
            out[here] = torch.copysign(quant, kept)
            size += 8 + -(-here.numel() * self.bits // 8)
        return out, size


class CodecRound:
    """A round of N members' vectors through ``codec`` (see the module's docstring)."""

    def __init__(
        self,
        codec: Codec | SharedMask,
        result: Codec | SharedMask,
        *,
        members: int,
        numel: int,
        owner_feedback: bool,
        decay: float = 1.0,
    ) -> None:
        self.codec, self.result, self.decay = codec, result, decay
        cut = [numel * j // members for j in range(members + 1)]
        self.parts = list(itertools.pairwise(cut))
        self.members = [torch.zeros(numel) for _ in range(members)]
        self.owner = torch.zeros(numel) if owner_feedback else None
        self.up = self.down = 0
        self.rounds = 0

    def _through(
        self, codec: Codec | SharedMask, values: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, int]:
        if isinstance(codec, SharedMask):
            return codec.through(values, start, self.rounds)
        payload, meta = codec.encode(values)
        return decode(payload, meta).reshape(-1).float(), len(payload)

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        n = len(deltas)
        out = torch.empty_like(deltas[0])
        for owner, (start, end) in enumerate(self.parts):
            total = torch.zeros(end - start)
            for member, delta in enumerate(deltas):
                compensated = delta[start:end] + self.decay * self.members[member][start:end]
                if member == owner:
                    sent = compensated
                else:
                    sent, size = self._through(self.codec, compensated, start)
                    self.up += size
                self.members[member][start:end] = compensated - sent
                total += sent
            average = total / n
            if self.owner is not None:
                average += self.owner[start:end]
            result, size = self._through(self.result, average, start)
            self.down += size * (n - 1)
            if self.owner is not None:
                self.owner[start:end] = average - result
            out[start:end] = result
        self.rounds += 1
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--settings",
        nargs="+",
        default=list(SETTINGS),
        help=f"of {', '.join(SETTINGS)}; NAME@LR/MOMENTUM: with outer settings of its own",
    )
    parser.add_argument(
        "--result-density",
        type=float,
        default=1.0,
        help="the owners' sparse results' density, as a multiple of the members'",
    )
    parser.add_argument(
        "--batch-size", type=int, help="samples a replica's inner step (default: the demo spec's)"
    )
    parser.add_argument("--inner-steps", type=int, help="H (default: the demo spec's)")
    parser.add_argument("--outer", help="outer LR/MOMENTUM (default: the demo spec's)")
    parser.add_argument("--lr", type=float, help="inner AdamW lr (default: the demo spec's)")
    parser.add_argument("--schedule", help="inner lr WARMUP/DECAY steps (default: the spec's)")
    parser.add_argument(
        "--warm-start-steps", type=int, default=0, help="start from a model trained this long"
    )
    parser.add_argument("--density", type=float, default=1 / 64)
    parser.add_argument(
        "--decay", type=float, default=1.0, help="members' residual kept a round (SparseLoCo: < 1)"
    )
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--data-seed", type=int, default=0, help="other streams for the replicas")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.settings:
        if name.partition("@")[0] not in SETTINGS:
            parser.error(f"unknown setting {name!r}: choose from {', '.join(SETTINGS)}")
    spec = RunSpec.from_toml(DEMO_SPEC)
    algorithm = spec.algorithm
    changes: dict[str, float | int] = {}
    if args.inner_steps:
        changes["inner_steps"] = args.inner_steps
    if args.outer:
        changes["outer_lr"], changes["outer_momentum"] = _outer(args.outer)
    if args.lr:
        changes["inner_lr"] = args.lr
    if args.schedule:
        changes["warmup_steps"], changes["decay_steps"] = map(int, args.schedule.split("/"))
    algorithm = dataclasses.replace(algorithm, **changes)  # type: ignore[arg-type]
    corpus = load_corpus(
        spec.data, vocab_size=spec.model.vocab_size, cache_dir=node_config.home() / "cache"
    )
    windows = corpus.validation(seq_len=spec.model.seq_len, num_windows=args.eval_windows)
    initial = build_model(spec.model, seed=spec.data.seed)
    if args.warm_start_steps:
        with tempfile.TemporaryDirectory() as keep:
            path = Path(keep) / "warm.safetensors"
            _, loss = warm_start(
                spec,
                steps=args.warm_start_steps,
                batch_size=spec.data.batch_size * args.replicas,  # as communication.py
                cache_dir=node_config.home() / "cache",
                path=path,
            )
            initial.load_state_dict(safetensors.torch.load_file(path))
        print(f"warm start: {args.warm_start_steps} steps alone, val loss {loss:.3f}")
    numel = sum(p.numel() for p in initial.parameters())
    print(
        f"{args.replicas} replicas, {args.rounds} rounds of {algorithm.inner_steps} inner steps "
        f"of {args.batch_size or spec.data.batch_size} samples, "
        f"outer {algorithm.outer_lr:g}/{algorithm.outer_momentum:g}, {numel:,} parameters, "
        f"sparse density {args.density:g} (results x{args.result_density:g}), "
        f"members' residual decay {args.decay:g}, "
        f"data seed {args.data_seed}"
    )
    rows = []
    began = time.monotonic()
    for name in args.settings:
        base, _, outer = name.partition("@")
        outer_lr, outer_momentum = (
            _outer(outer) if outer else (algorithm.outer_lr, algorithm.outer_momentum)
        )
        codec_name, options, result_name, owner_feedback = SETTINGS[base]
        if codec_name == "sparse":
            options = {**options, "density": args.density}
        codec: Codec | SharedMask
        if codec_name == "mask":
            codec = SharedMask(k=int(options["k"]), bits=int(options["bits"]))
        else:
            codec = get_codec(codec_name, **options)
        if result_name:
            result = get_codec(result_name)
        elif codec_name == "sparse" and args.result_density != 1:
            result = get_codec(
                codec_name, **{**options, "density": args.density * args.result_density}
            )
        else:
            result = codec
        average = CodecRound(
            codec,
            result,
            members=args.replicas,
            numel=numel,
            owner_feedback=owner_feedback,
            decay=args.decay,
        )
        streams = [
            corpus.batches(
                seq_len=spec.model.seq_len,
                batch_size=args.batch_size or spec.data.batch_size,
                seed=spec.data.seed,
                peer_id=f"replica-{i}" if not args.data_seed else f"replica-{args.data_seed}-{i}",
            )
            for i in range(args.replicas)
        ]
        curve = diloco_exact(
            initial,
            streams,
            windows,
            rounds=args.rounds,
            schedule=dataclasses.replace(algorithm),
            inner_steps=algorithm.inner_steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            average=average,
        )
        per_peer = args.replicas * average.rounds
        rows.append((name, curve, average.up / per_peer, average.down / per_peer))
        print(f"{name}: {curve[-1]:.3f}", flush=True)
    reference = rows[0][1][-1]
    head = f"{'setting':<28}{'val loss':>9}{'vs first':>9}{'up B':>10}{'down B':>10}"
    print(f"{head}  curve (every 5th round)")
    for name, curve, up, down in rows:
        shape = " ".join(f"{v:.3f}" for v in curve[4::5])
        print(
            f"{name:<28}{curve[-1]:>9.3f}{(curve[-1] - reference) / reference:>+9.2%}"
            f"{up:>10,.0f}{down:>10,.0f}  {shape}"
        )
    print(f"({time.monotonic() - began:.0f} s)")


def _outer(text: str) -> tuple[float, float]:
    lr, momentum = (float(x) for x in text.split("/"))
    return lr, momentum


if __name__ == "__main__":
    main()
