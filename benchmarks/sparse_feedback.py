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
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import torch

from swarmgrad.compression import Codec, decode, get_codec
from swarmgrad.node import config as node_config
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import load_corpus
from swarmgrad.node.training.model import build_model
from swarmgrad.simulations.baseline import diloco_exact
from swarmgrad.simulations.swarm import DEMO_SPEC

#: name -> (the members' codec, its options, the owners' result codec (None: the same), owner
#: feedback)
SETTINGS: dict[str, tuple[str, dict[str, float], str | None, bool]] = {
    "fp32": ("none", {}, None, False),
    "int8": ("int8", {}, None, False),
    "sparse": ("sparse", {"bits": 2}, None, False),
    "sparse+owner": ("sparse", {"bits": 2}, None, True),
    "sparse4+owner": ("sparse", {"bits": 4}, None, True),
    "sparse/int8 down": ("sparse", {"bits": 2}, "int8", False),
}


class CodecRound:
    """A round of N members' vectors through ``codec`` (see the module's docstring)."""

    def __init__(
        self,
        codec: Codec,
        result: Codec,
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

    def _through(self, codec: Codec, values: torch.Tensor) -> tuple[torch.Tensor, int]:
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
                    sent, size = self._through(self.codec, compensated)
                    self.up += size
                self.members[member][start:end] = compensated - sent
                total += sent
            average = total / n
            if self.owner is not None:
                average += self.owner[start:end]
            result, size = self._through(self.result, average)
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
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--density", type=float, default=1 / 64)
    parser.add_argument(
        "--decay", type=float, default=1.0, help="members' residual kept a round (SparseLoCo: < 1)"
    )
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--data-seed", type=int, default=0, help="other streams for the replicas")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = RunSpec.from_toml(DEMO_SPEC)
    algorithm = spec.algorithm
    corpus = load_corpus(
        spec.data, vocab_size=spec.model.vocab_size, cache_dir=node_config.home() / "cache"
    )
    windows = corpus.validation(seq_len=spec.model.seq_len, num_windows=args.eval_windows)
    initial = build_model(spec.model, seed=spec.data.seed)
    numel = sum(p.numel() for p in initial.parameters())
    print(
        f"{args.replicas} replicas, {args.rounds} rounds of {algorithm.inner_steps} inner steps, "
        f"outer {algorithm.outer_lr:g}/{algorithm.outer_momentum:g}, {numel:,} parameters, "
        f"sparse density {args.density:g}, members' residual decay {args.decay:g}, "
        f"data seed {args.data_seed}"
    )
    rows = []
    began = time.monotonic()
    for name in args.settings:
        codec_name, options, result_name, owner_feedback = SETTINGS[name]
        if codec_name == "sparse":
            options = {**options, "density": args.density}
        codec = get_codec(codec_name, **options)
        result = get_codec(result_name) if result_name else codec
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
                batch_size=spec.data.batch_size,
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
            outer_lr=algorithm.outer_lr,
            outer_momentum=algorithm.outer_momentum,
            average=average,
        )
        per_peer = args.replicas * average.rounds
        rows.append((name, curve, average.up / per_peer, average.down / per_peer))
        print(f"{name}: {curve[-1]:.3f}", flush=True)
    reference = rows[0][1][-1]
    head = f"{'setting':<20}{'val loss':>9}{'vs first':>9}{'up B':>10}{'down B':>10}"
    print(f"{head}  curve (every 5th round)")
    for name, curve, up, down in rows:
        shape = " ".join(f"{v:.3f}" for v in curve[4::5])
        print(
            f"{name:<20}{curve[-1]:>9.3f}{(curve[-1] - reference) / reference:>+9.2%}"
            f"{up:>10,.0f}{down:>10,.0f}  {shape}"
        )
    print(f"({time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
