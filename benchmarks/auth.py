#!/usr/bin/env python3
"""What authentication costs: signing and checking each signed message, per round and per DHT
value, on this machine.

    python benchmarks/auth.py                 # ~20 s
    python benchmarks/auth.py --repeats 5000 --json out.json

Per message, timed one call at a time (median and [p10-p90] over ``--repeats`` calls):
  - the raw Ed25519 sign and verify of 200 bytes (cryptography's OpenSSL binding);
  - a round's stream header as a member sends it (``header_to_proto``: fields encoded, signed)
    and as the owner checks it (``Verifier.check``: key -> peer id, receiver, time window,
    signature, replay memory); the same for a state request;
  - a DHT value: sealing a peer record, and what a DHT node does with one it is asked to store
    (``records.validate``: parse, filing rules, signature, the record's body).
Per round: a member of a group of N signs one header per owner (N) and, as an owner, checks
one per other member (N - 1); the table gives that time, and its share of the round's
all-reduce time taken from ``benchmarks/allreduce.py``'s figures in docs/benchmarks.md (25M fp32
values per peer, int8) where N matches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from swarmgrad.node.discovery.envelope import Kind, seal
from swarmgrad.node.discovery.records import PeerRecord, validate
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.auth import Verifier, sign_request
from swarmgrad.protocol.averaging import AGGREGATE, StreamHeader, header_to_proto
from swarmgrad.protocol.state import request_fields
from swarmgrad.protocol.v1 import state_pb2

#: The all-reduce round times (s, docs/benchmarks.md) for 25M fp32 values per peer, int8, by N.
ALLREDUCE_SECONDS = {2: 0.14, 4: 0.27, 8: 0.77}


def timed(call: Callable[[int], object], repeats: int) -> dict[str, float]:
    """Microseconds per call of ``call(i)``, i < ``repeats`` (after 200 warm-up calls with
    i = ``repeats`` ...): median, p10, p90."""
    for i in range(200):
        call(repeats + i)
    samples = []
    for i in range(repeats):
        started = time.perf_counter_ns()
        call(i)
        samples.append((time.perf_counter_ns() - started) / 1000)
    deciles = statistics.quantiles(samples, n=10)
    return {"median_us": statistics.median(samples), "p10_us": deciles[0], "p90_us": deciles[-1]}


def measure(repeats: int) -> dict[str, dict[str, float]]:
    sender, owner = Identity.generate(), Identity.generate()
    message = os.urandom(200)
    signature = sender.sign(message)
    public = sender.private_key.public_key()
    results: dict[str, dict[str, float]] = {}
    results["ed25519 sign (200 B)"] = timed(lambda _: sender.sign(message), repeats)
    results["ed25519 verify (200 B)"] = timed(lambda _: public.verify(signature, message), repeats)

    def header(i: int) -> StreamHeader:
        return StreamHeader(
            run_id="bench",
            spec_hash=bytes(32),
            round=i,
            group_id=bytes(16),
            sender=sender.peer_id,
            receiver=owner.peer_id,
            part=1,
            weight=16.0,
        )

    results["round header: sign"] = timed(lambda i: header_to_proto(header(i), sender), repeats)
    # Checked as the owner's servicer does: each header once (a second would be a replay).
    signed = [header_to_proto(header(i), sender).header for i in range(repeats + 200)]
    verifier = Verifier(owner.peer_id)

    def check_header(i: int) -> None:  # what the owner's servicer does with a header
        h = signed[i]
        received = header(h.key.round)
        verifier.verify(
            AGGREGATE, h.auth, receiver=h.receiver, fields=received.fields(), sender=h.sender
        )

    results["round header: check"] = timed(check_header, repeats)

    def state_request(i: int) -> state_pb2.StateRequest:
        request = state_pb2.StateRequest(
            run_id="bench",
            spec_hash=bytes(32),
            root="ab" * 32,
            first_chunk=i,
            num_chunks=4,
            receiver=owner.peer_id,
        )
        method = "/swarmgrad.v1.State/Download"
        request.auth.CopyFrom(sign_request(sender, method, owner.peer_id, request_fields(request)))
        return request

    results["state request: sign"] = timed(state_request, repeats)
    requests = [state_request(i) for i in range(repeats + 200)]
    state_verifier = Verifier(owner.peer_id)

    def check_state(i: int) -> None:
        request = requests[i]
        state_verifier.verify(
            "/swarmgrad.v1.State/Download",
            request.auth,
            receiver=request.receiver,
            fields=request_fields(request),
        )

    results["state request: check"] = timed(check_state, repeats)

    now = time.time()
    record = PeerRecord.create(
        sender.peer_id,
        run_id="bench",
        spec_hash=bytes(32),
        endpoint="127.0.0.1:4000",
        now=now,
        ttl_seconds=120.0,
    )
    key = f"run/bench/{bytes(32).hex()}/peers"

    def sealed(_: int) -> bytes:
        return seal(
            sender,
            key=key,
            kind=Kind.PEER,
            body=record.body(),
            issued_at=record.issued_at,
            expires_at=record.expires_at,
        )

    results["DHT value: seal"] = timed(sealed, repeats)
    value = sealed(0)
    results["DHT value: validate"] = timed(
        lambda _: validate(key, sender.peer_id, value, record.expires_at, time.time()), repeats
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3000)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = measure(args.repeats)
    print(f"per message, {args.repeats} calls each: median [p10-p90] microseconds")
    for name, r in results.items():
        print(f"  {name:<26} {r['median_us']:7.1f} [{r['p10_us']:.1f}-{r['p90_us']:.1f}]")
    sign = results["round header: sign"]["median_us"]
    check = results["round header: check"]["median_us"]
    print("\nper round, one member of a group of N: N headers signed, N - 1 checked")
    print(f"  {'N':>3} {'auth ms':>8} {'share of a 25M-value int8 all-reduce':>38}")
    rounds: dict[int, dict[str, Any]] = {}
    for n in (2, 4, 8, 16):
        ms = (n * sign + (n - 1) * check) / 1000
        share = ALLREDUCE_SECONDS.get(n)
        shown = f"{100 * ms / 1000 / share:.2f}% of {share:.2f} s" if share else "-"
        print(f"  {n:>3} {ms:8.3f} {shown:>38}")
        rounds[n] = {"auth_ms": ms, "allreduce_s": share}
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"per_message": results, "per_round": rounds}, out, indent=1)


if __name__ == "__main__":
    main()
