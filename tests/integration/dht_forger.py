"""A writer without any swarm member's key, attacking a live swarm's DHT: run as a script (one
backend per process: hivemind and libp2p never share one).

    python tests/integration/dht_forger.py {hivemind,libp2p} --run ID --spec HEX [--epoch N] \
        MADDR...

Without ``--epoch`` it joins first, prints ``ready``, and attacks when a line with the swarm's
epoch arrives on stdin: a test starts it early, so its start-up (an interpreter, a DHT join)
is not what decides the epoch it strikes at.

hivemind: a plain ``hivemind.DHT`` client (no validator of its own) joins through MADDR and
stores through the DHT's own routing. libp2p: a plain libp2p host on swarmgrad's public network
sends each store straight to every MADDR (each node's sidecar: every replica is asked).

It reads the genuine records, then writes every forgery that used to erase, hide or block them:
an altered copy of each record with a later expiry, each genuine value again with a longer
life, an unsigned (empty) leave in each member's slot, a value sealed by its own key in a
member's slot, its own record with an expiry far away, plain values over each member's spec
slot and its own, and plain values over the next 40 round keys. It prints one JSON line:
how many writes each attack got accepted, and the members whose genuine record it reads
afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from swarmgrad.node.discovery.envelope import Kind, RecordError, seal
from swarmgrad.node.discovery.records import PeerRecord, validate
from swarmgrad.node.identity import Identity

Store = Callable[[str, str | None, bytes, float], Awaitable[int]]
Read = Callable[[str], Awaitable[dict[str, tuple[bytes, float]]]]


async def attack(
    args: argparse.Namespace,
    store: Store,
    read: Read,
    read_afresh: Read,
    pause: Callable[[float], Awaitable[None]],
) -> dict[str, Any]:
    prefix = f"run/{args.run}/{args.spec}"
    peers_key, specs_key = f"{prefix}/peers", f"run/{args.run}/specs"
    now = time.time()
    members = await read(peers_key)
    mallory = Identity.generate()
    own = PeerRecord.create(
        mallory.peer_id,
        run_id=args.run,
        spec_hash=bytes.fromhex(args.spec),
        endpoint="127.0.0.1:9",
        now=now,
        ttl_seconds=3000.0,
    )
    far = seal(
        mallory,
        key=peers_key,
        kind=Kind.PEER,
        body=own.body(),
        issued_at=now,
        expires_at=own.expires_at,
    )
    in_their_slot = seal(
        mallory, key=peers_key, kind=Kind.PEER, body=own.body(), issued_at=now, expires_at=now + 60
    )
    accepted: Counter[str] = Counter()
    for subkey, (value, expires) in members.items():
        accepted["altered copy"] += await store(
            peers_key, subkey, value[:-64] + bytes(64), now + 170
        )
        accepted["genuine, longer life"] += await store(peers_key, subkey, value, now + 170)
        accepted["unsigned leave"] += await store(peers_key, subkey, b"", expires + 60)
        accepted["another's seal"] += await store(peers_key, subkey, in_their_slot, now + 60)
    accepted["own record, 3000 s"] += await store(peers_key, mallory.peer_id, far, now + 3000)
    for subkey in [*(await read(specs_key)), mallory.peer_id]:
        accepted["spec overwrite"] += await store(specs_key, subkey, b'{"run":"forged"}', now + 170)
    for round_ in range(args.epoch, args.epoch + 40):
        key = f"{prefix}/round/{round_}"
        accepted["plain round value"] += await store(key, None, b"blocked", now + 170)
        accepted["round entry"] += await store(key, mallory.peer_id, b"blocked", now + 170)
    # The swarm's view afterwards; a lookup can come back empty on a busy machine, so it is
    # read again (for up to 30 s) until every member's genuine record is seen.
    deadline = time.monotonic() + 30
    while True:
        seen = []
        for subkey, (value, expires) in (await read_afresh(peers_key)).items():
            try:
                validate(peers_key, subkey, value, expires, time.time())
            except RecordError:
                continue
            seen.append(subkey)
        if set(members) <= set(seen) or time.monotonic() > deadline:
            break
        await pause(1.0)
    return {
        "members": sorted(members),
        "accepted": {name: accepted[name] for name in sorted(accepted)},
        "seen_after": sorted(seen),
    }


async def with_hivemind(args: argparse.Namespace) -> dict[str, Any]:
    import hivemind

    dht = hivemind.DHT(initial_peers=args.maddrs, client_mode=True, start=True)

    async def store(key: str, subkey: str | None, value: bytes, expires: float) -> int:
        # Never into its own storage: a client counts itself among the nearest nodes, keeps
        # whatever it is given (no validator), and its "stored" would be a swarm member's
        # refusal or its own acceptance, whichever came last.
        stored = dht.store(key, value, expiration_time=expires, subkey=subkey, exclude_self=True)
        return int(bool(stored))

    def reader(dht: hivemind.DHT) -> Read:
        async def read(key: str) -> dict[str, tuple[bytes, float]]:
            found = dht.get(key, latest=True)
            entries = found.value if found is not None else {}
            if not isinstance(entries, dict):
                return {}
            return {str(s): (v.value, float(v.expiration_time)) for s, v in entries.items()}

        return read

    try:
        # The client keeps what it stored in its own cache: the swarm's view is read afresh.
        fresh = hivemind.DHT(initial_peers=args.maddrs, client_mode=True, start=True)
        try:
            await _epoch_from_stdin(args, asyncio.to_thread)
            return await attack(args, store, reader(dht), reader(fresh), asyncio.sleep)
        finally:
            fresh.shutdown()
    finally:
        dht.shutdown()


def with_libp2p(args: argparse.Namespace) -> dict[str, Any]:
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_noise_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.noise.transport import PROTOCOL_ID, Transport

    from swarmgrad.node.discovery.libp2p_framing import read_message, write_message
    from swarmgrad.node.discovery.libp2p_sidecar import network_key

    directory = TProtocol("/swarmgrad/directory/1.0.0")

    async def main() -> dict[str, Any]:
        key_pair = create_new_key_pair()
        noise = Transport(key_pair, create_noise_key_pair().private_key)
        host = new_host(key_pair=key_pair, sec_opt={PROTOCOL_ID: noise}, psk=network_key())
        async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            peers = [info_from_p2p_addr(multiaddr.Multiaddr(m)) for m in args.maddrs]
            for info in peers:
                with trio.fail_after(10):
                    await host.connect(info)
            await _epoch_from_stdin(args, trio.to_thread.run_sync)

            async def ask(info: Any, request: dict[str, Any]) -> dict[str, Any]:
                with trio.fail_after(10):
                    stream = await host.new_stream(info.peer_id, [directory])
                    try:
                        await write_message(stream, request)
                        return await read_message(stream)
                    except Exception as error:  # a refusal resets the stream
                        return {"error": str(error)}

            async def store(key: str, subkey: str | None, value: bytes, expires: float) -> int:
                request = {
                    "op": "store",
                    "key": key,
                    "subkey": subkey,
                    "value": base64.b64encode(value).decode(),
                    "expires": expires,
                }
                answers = [await ask(info, request) for info in peers]
                return sum("error" not in a for a in answers)

            async def read(key: str) -> dict[str, tuple[bytes, float]]:
                found: dict[str, tuple[bytes, float]] = {}
                for info in peers:
                    answer = await ask(info, {"op": "get", "key": key})
                    for entry in answer.get("entries") or []:
                        expires = float(entry["expires"])
                        if entry["subkey"] not in found or found[entry["subkey"]][1] < expires:
                            value = base64.b64decode(entry["value"])
                            found[entry["subkey"]] = (value, expires)
                return found

            return await attack(args, store, read, read, trio.sleep)

    result: dict[str, Any] = trio.run(main)
    return result


async def _epoch_from_stdin(
    args: argparse.Namespace, in_thread: Callable[[Callable[[], str]], Awaitable[str]]
) -> None:
    """Without ``--epoch``: say ``ready`` and take the epoch from stdin's next line."""
    if args.epoch is None:
        print("ready", flush=True)
        args.epoch = int(await in_thread(sys.stdin.readline))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=("hivemind", "libp2p"))
    parser.add_argument("maddrs", nargs="+")
    parser.add_argument("--run", required=True)
    parser.add_argument("--spec", required=True, help="the run spec's hash, hex")
    parser.add_argument("--epoch", type=int, help="the swarm's epoch (default: from stdin)")
    args = parser.parse_args()
    if args.backend == "hivemind":
        result = asyncio.run(with_hivemind(args))
    else:
        import logging

        logging.getLogger("libp2p").handlers[:] = [logging.NullHandler()]
        result = with_libp2p(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
