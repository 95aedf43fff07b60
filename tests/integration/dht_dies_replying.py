"""A DHT process killed while it replies, then a new DHT from the same fork server: run as a
script, in a process of its own (a failure here must not leave a test process's fork server
broken). Prints one JSON line: the victim's exit code, the new DHT's start time and its
answer to a store.

    python tests/integration/dht_dies_replying.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from hivemind.utils.mpfuture import MPFuture

from swarmgrad.node.discovery.hivemind_dht import _DHT, start_dht
from swarmgrad.protocol.server import grpc_started, start_server


class DiesReplying(_DHT):
    """A DHT process that dies as one killed mid-reply would: holding the lock its replies
    take (which hivemind's DHT processes share when they come from one parent)."""

    def run(self) -> None:
        self._prepare()
        MPFuture._update_lock.__enter__()
        os.kill(os.getpid(), signal.SIGKILL)


async def main() -> None:
    server, _ = await start_server(lambda server: None)  # so DHTs come from the fork server
    try:
        assert grpc_started()
        victim = DiesReplying(
            initial_peers=[],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            start=False,
            from_clean_process=True,
        )
        victim.start()
        victim.join(30)
        started = time.monotonic()
        dht = await start_dht([], host="127.0.0.1", port=0, start_timeout_seconds=30)
        try:
            # Any answer shows that its replies get through (a value not sealed is refused).
            stored = dht.store(
                "key", b"value", expiration_time=time.time() + 60, return_future=True
            ).result(timeout=10)
            print(
                json.dumps(
                    {
                        "victim_exitcode": victim.exitcode,
                        "from_clean_process": dht.from_clean_process,
                        "start_seconds": round(time.monotonic() - started, 2),
                        "stored": stored,
                    }
                )
            )
        finally:
            dht.shutdown()
    finally:
        await server.stop(None)


if __name__ == "__main__":  # the fork server imports this file again
    asyncio.run(main())
