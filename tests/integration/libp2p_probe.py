"""A stranger's libp2p host, for the sidecar's tests: run as a script (the test process imports
hivemind, which cannot share a process with libp2p).

    python tests/integration/libp2p_probe.py MADDR [--security noise|plaintext] [--network-key HEX]
        [--garbage] [--protocol ID]

Connects to MADDR offering only the given security protocol under the given pre-shared key
(none: a public libp2p host), optionally sends garbage on a protocol (default: the swarmgrad
directory), and prints one JSON line: ``{"connected": bool, "error": str, "garbage": str}``.
"""

from __future__ import annotations

import argparse
import json
import logging

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_noise_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

DIRECTORY = TProtocol("/swarmgrad/directory/1.0.0")


async def probe(args: argparse.Namespace) -> dict[str, object]:
    key_pair = create_new_key_pair()
    security = (
        {NOISE_PROTOCOL_ID: NoiseTransport(key_pair, create_noise_key_pair().private_key)}
        if args.security == "noise"
        else {PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)}
    )
    host = new_host(key_pair=key_pair, sec_opt=security, psk=args.network_key or None)
    result: dict[str, object] = {"connected": False, "error": "", "garbage": ""}
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = info_from_p2p_addr(multiaddr.Multiaddr(args.maddr))
        try:
            with trio.fail_after(5):
                await host.connect(info)
                # A connection is only real once a protocol runs over it.
                stream = await host.new_stream(info.peer_id, [TProtocol(args.protocol)])
            result["connected"] = True
        except BaseException as error:
            result["error"] = f"{type(error).__name__}: {error}"[:300]
            return result
        if args.garbage:
            try:
                with trio.move_on_after(5):
                    await stream.write((1 << 31).to_bytes(4, "big") + b"\xff" * 64)
                    answer = await stream.read(4096)
                    result["garbage"] = answer.decode(errors="replace")
            except Exception as error:  # the peer reset the stream: an answer too
                result["garbage"] = f"{type(error).__name__}: {error}"[:300]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("maddr")
    parser.add_argument("--security", choices=("noise", "plaintext"), default="noise")
    parser.add_argument("--network-key", default="")
    parser.add_argument("--garbage", action="store_true")
    parser.add_argument("--protocol", default=DIRECTORY, help="the protocol to open a stream on")
    args = parser.parse_args()
    logging.getLogger("libp2p").handlers[:] = [logging.NullHandler()]
    print(json.dumps(trio.run(probe, args)), flush=True)


if __name__ == "__main__":
    main()
