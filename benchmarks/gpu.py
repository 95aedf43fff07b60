#!/usr/bin/env python3
"""The GPU node's report: codecs on the GPU, the outer step's bits, the trainer's step against a
plain PyTorch loop (tokens/s and MFU), and a swarm of nodes sharing one GPU.

    python benchmarks/gpu.py                                # everything, on the GPU at hand
    python benchmarks/gpu.py --sections codecs,train --sizes 125m --out gpu.json
    python benchmarks/gpu.py --device cpu --sizes tiny      # a smoke run of the script itself

Sections (each one's results are written to ``--out`` as soon as it ends, so a run cut short
keeps what it measured):

* ``codecs``: each dense codec on a 64 MiB fp32 tensor that lives on the GPU. "device" is
  today's path (``encode_view`` on the GPU, as a round's sender calls it: only the payload
  crosses PCIe, into page-locked memory the wire reads, each part while the next is computed;
  ``decode`` onto the GPU from the payload as a receiver holds it, pageable bytes, staged in
  parts); "host" is the path before it (the tensor copied to the host and encoded there, the
  decoding copied back). Medians of ``--repeats`` encodes and decodes, in GB/s of fp32 input;
  whether the GPU's payload is the CPU's, byte for byte, and decodes to the same bits on both.
* ``outer``: DiLoCo's outer step (Nesterov) on the GPU and on the CPU from the same inputs, three
  rounds: are the parameters bit-identical? (Replicas of one run may train on either.)
* ``train`` (``gpu_train.py``): per model size, the trainer's inner step (``InnerStep``, batches
  from the trainer's own sampler through ``Prefetched``, the loss read every 16 steps) against a
  plain loop on the same model (data already on the GPU, fused AdamW, bf16 autocast, no host
  syncs), each eager and compiled: tokens/s and MFU = 6 x parameters x tokens/s / the device's
  bf16 peak.
* ``swarm``: ``swarmgrad simulate`` with ``--nodes`` processes on the one GPU (a ~20M-parameter
  GPT, int8 rounds): loss, replicas' checksums, tokens/s and MFU per node.

Timings are medians on one machine, side by side in one run; compare ratios, not numbers
across runs or cards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_train import SIZES, bench_train, sync  # benchmarks/gpu_train.py, beside this file

from swarmgrad.compression import decode, get_codec
from swarmgrad.node.training.device import peak_flops
from swarmgrad.node.training.outer import OuterOptimizer

CODECS = ("none", "fp16", "bf16", "int8", "int4")
PEER_KEYS = ("device", "epoch", "tokens_per_second", "mfu", "utilization")


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def spread(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


# -- codecs -------------------------------------------------------------------------------------


def bench_codecs(device: torch.device, size_mib: int, repeats: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    host = torch.randn(size_mib * 1024 * 1024 // 4, generator=generator)
    tensor = host.to(device)
    results: dict[str, Any] = {"size_mib": size_mib, "codecs": {}}
    for name in CODECS:
        codec = get_codec(name)
        payload, meta = codec.encode_view(tensor)  # what a round's sender hands the wire

        def encode(codec: Any = codec) -> Any:
            return codec.encode_view(tensor)

        received = bytes(payload)  # what a receiver holds: pageable bytes off the wire

        def decode_here(payload: Any = received, meta: Any = meta) -> torch.Tensor:
            return decode(payload, meta, device=device)

        def decode_pinned(payload: Any = payload, meta: Any = meta) -> torch.Tensor:
            return decode(payload, meta, device=device)

        def via_host(codec: Any = codec) -> tuple[bytes, torch.Tensor]:
            payload, meta = codec.encode(tensor.cpu())
            return payload, decode(payload, meta).to(device)

        encode_times = median_seconds(encode, repeats, device)
        decode_times = median_seconds(decode_here, repeats, device)
        pinned_times = median_seconds(decode_pinned, repeats, device)
        device_times = [e + d for e, d in zip(encode_times, decode_times, strict=True)]
        host_times = median_seconds(via_host, repeats, device)
        host_payload, host_values = via_host()
        gb = tensor.numel() * 4 / 1e9
        results["codecs"][name] = {
            "encode_seconds": spread(encode_times),
            "decode_seconds": spread(decode_times),
            "decode_from_pinned_seconds": spread(pinned_times),
            "host_seconds": spread(host_times),
            "device_gb_per_s": gb / statistics.median(device_times),
            "host_gb_per_s": gb / statistics.median(host_times),
            "speedup": statistics.median(host_times) / statistics.median(device_times),
            # The same payload whichever device encoded it, and the same bits whichever decodes.
            "same_payload": bytes(payload) == host_payload,
            "same_decoded_bits": bool(
                torch.equal(decode(payload, meta, device=device).cpu(), decode(payload, meta))
            ),
            "same_values_both_paths": bool(torch.equal(decode_here(), host_values)),
            "payload_bytes": len(payload),
        }
        print(f"codec {name}: {results['codecs'][name]}", flush=True)
    return results


# -- the outer step -----------------------------------------------------------------------------


def bench_outer(device: torch.device, numel: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    theta = torch.randn(numel, generator=generator)
    rounds = [torch.randn(numel, generator=generator) * 1e-3 for _ in range(3)]
    cpu = OuterOptimizer(theta, lr=0.7, momentum=0.9)
    gpu = OuterOptimizer(theta.to(device), lr=0.7, momentum=0.9)
    seconds = []
    for averaged in rounds:
        cpu.step(averaged, own=averaged, missing=[(10, 20)])
        on_device = averaged.to(device)
        sync(device)
        start = time.perf_counter()
        gpu.step(on_device, own=on_device, missing=[(10, 20)])
        sync(device)
        seconds.append(time.perf_counter() - start)
    identical = torch.equal(cpu.theta, gpu.theta.cpu()) and torch.equal(
        cpu.momentum_buffer, gpu.momentum_buffer.cpu()
    )
    result = {
        "numel": numel,
        "bit_identical": bool(identical),
        "checksums": [cpu.checksum(), gpu.checksum()],
        "device_step_seconds": spread(seconds),
    }
    print(f"outer: {result}", flush=True)
    return result


# -- a swarm on one GPU -------------------------------------------------------------------------

SWARM_SPEC = """
[run]
id = "gpu-swarm"

[model]
vocab_size = 2048  # the demo corpus's tokenizer
d_model = {d_model}
n_layers = {n_layers}
n_heads = {n_heads}
seq_len = {seq_len}

[data]
batch_size = {batch}

[algorithm]
inner_steps = 50
overlap = {overlap}
fragments = {fragments}

[averaging]
codec = "int8"
group_size = {nodes}

[node]
device = "{device}"
"""


def bench_swarm(
    device: torch.device,
    size: str,
    nodes: int,
    rounds: int,
    timeout: float,
    *,
    overlap: bool = False,
    fragments: int = 1,
) -> dict[str, Any]:
    d_model, n_layers, n_heads, seq_len, batch, _ = SIZES[size]
    with tempfile.TemporaryDirectory() as folder:
        spec = Path(folder) / "run.toml"
        spec.write_text(
            SWARM_SPEC.format(
                d_model=d_model,
                n_layers=n_layers,
                n_heads=n_heads,
                seq_len=seq_len,
                batch=batch,
                nodes=nodes,
                device=device.type,
                overlap=str(overlap).lower(),
                fragments=fragments,
            )
        )
        out = Path(folder) / "out"
        command = [
            sys.executable,
            "-m",
            "swarmgrad.node.cli",
            "simulate",
            "--spec",
            str(spec),
            "--nodes",
            str(nodes),
            "--rounds",
            str(rounds),
            "--out",
            str(out),
            "--timeout",
            str(timeout),
        ]
        started = time.perf_counter()
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout + 60, check=False
        )
        summary_path = out / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        peers = (summary or {}).get("peers", [])
        return {
            "nodes": nodes,
            "rounds": rounds,
            "returncode": completed.returncode,
            "wall_seconds": time.perf_counter() - started,
            "ok": (summary or {}).get("ok"),
            "replicas_identical": (summary or {}).get("replicas_identical"),
            "initial_val_loss": (summary or {}).get("initial_val_loss"),
            "final_val_loss": (summary or {}).get("final_val_loss"),
            "peers": [
                {
                    k: p.get(k)
                    for k in ("device", "epoch", "tokens_per_second", "mfu", "utilization")
                }
                for p in peers
            ],
            "summary": summary,
            "stdout_tail": completed.stdout[-3000:],
            "stderr_tail": completed.stderr[-3000:],
        }


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sections", default="codecs,outer,swarm,train")
    parser.add_argument("--sizes", default="125m,1b")
    parser.add_argument(
        "--variants",
        default="trainer-compiled,plain-compiled,trainer-eager,plain-eager",
        help="which of trainer|plain x eager|compiled to time, in this order",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per variant")
    parser.add_argument("--size-mib", type=int, default=64, help="codec tensor size")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=3, help="swarm: processes on the one GPU")
    parser.add_argument("--swarm-size", default="20m", help="swarm: the model (vocab 2048)")
    parser.add_argument("--overlap", action="store_true", help="swarm: overlapped rounds")
    parser.add_argument("--fragments", type=int, default=1, help="swarm: fragments per sync")
    parser.add_argument("--rounds", type=int, default=4, help="swarm: outer rounds")
    parser.add_argument("--swarm-timeout", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=Path("gpu-results.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu --sizes tiny for a smoke run")
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_bf16_tflops": peak_flops(device) / 1e12,
        "argv": sys.argv[1:],
    }

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=1, default=str))

    sections = args.sections.split(",")
    variants = args.variants.split(",")
    for section in sections:
        started = time.perf_counter()
        try:
            if section == "codecs":
                results["codecs"] = bench_codecs(device, args.size_mib, args.repeats)
            elif section == "outer":
                results["outer"] = bench_outer(device, args.size_mib * 2**18)
            elif section == "swarm":
                results["swarm"] = bench_swarm(
                    device,
                    args.swarm_size,
                    args.nodes,
                    args.rounds,
                    args.swarm_timeout,
                    overlap=args.overlap,
                    fragments=args.fragments,
                )
                swarm = results["swarm"]
                print(json.dumps({k: v for k, v in swarm.items() if k != "summary"}, indent=1))
            elif section == "train":
                results.setdefault("train", {})
                for size in args.sizes.split(","):
                    results["train"][size] = bench_train(size, device, args.steps, variants)
                    save()
            else:
                raise SystemExit(f"unknown section {section!r}")
        except Exception as error:  # keep what the other sections measure
            results.setdefault("errors", {})[section] = repr(error)
            print(f"section {section} failed: {error!r}", file=sys.stderr, flush=True)
        results.setdefault("section_seconds", {})[section] = time.perf_counter() - started
        save()
    print(json.dumps({k: v for k, v in results.items() if k != "swarm"}, indent=1, default=str))


if __name__ == "__main__":
    main()
