#!/usr/bin/env python3
"""Codec throughput and error: swarmgrad's codecs side by side with hivemind's, in one run.

    python benchmarks/codecs.py                      # 64 MiB fp32, 7 repeats, threads 1 and default
    python benchmarks/codecs.py --size-mib 16 --repeats 3 --json out.json

For each codec and torch thread setting: median encode and decode time over ``--repeats`` timed
runs after one warm-up (with min-max spread), payload bytes, compression ratio and relative L2
error on the same standard-normal tensor (seeded). Each measurement set runs in its own process,
one at a time, so thread settings and allocator state do not leak between them; hivemind's codecs
(Float16Compression, Uniform8BitQuantization, Quantile8BitQuantization, and BlockwiseQuantization
when bitsandbytes is installed) run in their own process too. Timings are wall clock on a shared
machine: compare ratios within one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

OURS = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {}),
    ("int4", {}),
    ("topk", {"fraction": 0.01}),
    ("sparse", {"bits": 2}),
    ("sparse", {"bits": 4}),
    ("powersgd", {"rank": 4}),
]
HIVEMIND = ["Float16Compression", "Uniform8BitQuantization", "Quantile8BitQuantization"]
#: Which hivemind codec each of ours is compared with, and the speedup the issue asks for.
PAIRS = [("fp16", "Float16Compression", 2.0), ("int8", "Uniform8BitQuantization", 5.0)]


def make_tensor(size_mib: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(size_mib * 1024 * 1024 // 4, generator=generator)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, list[float]]:
    result = fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, times


def measure(
    name: str,
    encode: Callable[[], Any],
    decode: Callable[[Any], Any],
    nbytes: Callable[[Any], int],
    original: Any,
    repeats: int,
) -> dict[str, Any]:
    encoded, enc_times = timed(encode, repeats)
    decoded, dec_times = timed(lambda: decode(encoded), repeats)
    err = float((decoded.double() - original.double()).norm() / original.double().norm())
    size = nbytes(encoded)
    return {
        "codec": name,
        "encode_ms": 1e3 * statistics.median(enc_times),
        "encode_spread_ms": [1e3 * min(enc_times), 1e3 * max(enc_times)],
        "decode_ms": 1e3 * statistics.median(dec_times),
        "decode_spread_ms": [1e3 * min(dec_times), 1e3 * max(dec_times)],
        "bytes": size,
        "ratio": original.numel() * 4 / size,
        "rel_error": err,
    }


def worker_ours(size_mib: int, repeats: int) -> list[dict[str, Any]]:
    from swarmgrad.compression import decode, get_codec

    x = make_tensor(size_mib)
    rows = []
    for name, options in OURS:
        codec = get_codec(name, **options)
        label = f"{name}-{options['bits']}b" if name == "sparse" else name
        rows.append(
            measure(
                label,
                lambda codec=codec: codec.encode(x),  # type: ignore[misc]
                lambda enc: decode(*enc),
                lambda enc: len(enc[0]),
                x,
                repeats,
            )
        )
    return rows


def worker_hivemind(size_mib: int, repeats: int) -> list[dict[str, Any]]:
    import hivemind.compression as hc

    x = make_tensor(size_mib)
    info = hc.CompressionInfo.from_tensor(x)
    names = list(HIVEMIND)
    try:
        import bitsandbytes  # noqa: F401

        names.append("BlockwiseQuantization")
    except ImportError:
        pass
    rows = []
    for name in names:
        codec = getattr(hc, name)()
        rows.append(
            measure(
                "hivemind." + name,
                lambda codec=codec: codec.compress(x, info),  # type: ignore[misc]
                lambda enc, codec=codec: codec.extract(enc),  # type: ignore[misc]
                lambda enc: enc.ByteSize(),
                x,
                repeats,
            )
        )
    return rows


def run_worker(kind: str, args: argparse.Namespace, threads: int | None) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--worker", kind, "--size-mib", str(args.size_mib)]
    cmd += ["--repeats", str(args.repeats)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{result.stderr[-4000:]}")
    rows: list[dict[str, Any]] = json.loads(result.stdout.strip().splitlines()[-1])
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'threads':>7} {'codec':<34} {'encode ms':>20} {'decode ms':>20} "
        f"{'enc+dec':>8} {'MiB':>8} {'ratio':>7} {'rel err':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        enc = (
            f"{r['encode_ms']:.1f} [{r['encode_spread_ms'][0]:.0f}-{r['encode_spread_ms'][1]:.0f}]"
        )
        dec = (
            f"{r['decode_ms']:.1f} [{r['decode_spread_ms'][0]:.0f}-{r['decode_spread_ms'][1]:.0f}]"
        )
        print(
            f"{r['threads']:>7} {r['codec']:<34} {enc:>20} {dec:>20} "
            f"{r['encode_ms'] + r['decode_ms']:>8.1f} {r['bytes'] / 2**20:>8.2f} "
            f"{r['ratio']:>7.1f} {r['rel_error']:>9.2e}"
        )


def print_ratios(rows: list[dict[str, Any]]) -> None:
    print("\nspeedup over hivemind (encode+decode, medians, same run):")
    for threads in dict.fromkeys(r["threads"] for r in rows):
        by_name = {r["codec"]: r for r in rows if r["threads"] == threads}
        for ours, theirs, target in PAIRS:
            a, b = by_name.get(ours), by_name.get("hivemind." + theirs)
            if a is None or b is None:
                continue
            speedup = (b["encode_ms"] + b["decode_ms"]) / (a["encode_ms"] + a["decode_ms"])
            verdict = "meets" if speedup >= target else "MISSES"
            print(
                f"  threads={threads:<7} {ours} vs {theirs}: {speedup:.1f}x "
                f"({verdict} the {target:g}x target); error {a['rel_error']:.2e} vs "
                f"{b['rel_error']:.2e}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size in MiB of fp32")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baseline")
    parser.add_argument("--worker", choices=["ours", "hivemind"], help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be at least 1")

    if args.worker:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        worker = worker_ours if args.worker == "ours" else worker_hivemind
        print(json.dumps(worker(args.size_mib, args.repeats)))
        return 0

    default_threads = os.cpu_count() or 1
    print(
        f"codec benchmark: {args.size_mib} MiB fp32 (standard normal), median of {args.repeats} "
        f"after a warm-up [min-max]; torch threads 1 and default ({default_threads})\n"
    )
    rows = []
    for threads in (1, None):
        label = str(threads) if threads else f"{default_threads}*"
        kinds = ["ours"] if args.no_hivemind else ["ours", "hivemind"]
        for kind in kinds:
            for row in run_worker(kind, args, threads):
                rows.append({**row, "threads": label})
    print_table(rows)
    print_ratios(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
