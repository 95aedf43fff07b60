"""The run page's web server (aiohttp): the page, plotly.js from the installed ``plotly``
package, and ``api/run``, the run as last read.

One DHT reader (``status.peer_reader``, or a node's peers page: ``--node``) is joined at start
and read every ``refresh_seconds`` under a deadline; a read that fails keeps the last good one and
says why. A node's status file, when given, is read at each request (the node rewrites it after
every round); else, with ``--node``, that node's status page is read with its peers. The server only
reads and serves: nothing a browser sends reaches the DHT or the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from swarmgrad.node.dashboard.view import node_view, run_view, status_view
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.status import RunPeers, read_page

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
#: Pages, scripts and styles the server sends, by the name the page asks for.
ASSETS = {"": "page.html", "page.js": "page.js", "page.css": "page.css"}
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


class DashboardError(RuntimeError):
    """The page cannot be served (plotly missing, the port taken)."""


def plotly_js() -> Path:
    """plotly.js as the ``plotly`` package installs it (found without importing the package)."""
    found = importlib.util.find_spec("plotly")
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        path = Path(location) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path
    raise DashboardError("plotly is not installed (scripts/setup.sh installs it)")


@dataclass(slots=True)
class RunState:
    """The run as last read from the DHT."""

    run_id: str
    peers: RunPeers | None = None
    read_at: float = 0.0  # unix time of the last good read
    error: str = ""  # why the last read failed ("" if it did not)
    reads: int = 0
    status_file: Path | None = None
    #: A node's status page (``--node``): its curves, read with the peers, when no status file.
    status_url: str = ""
    node_status: dict[str, Any] | None = None
    started_at: float = field(default_factory=time.time)

    def document(self) -> dict[str, Any]:
        node = node_view(self.status_file) if self.status_file is not None else self.node_status
        return run_view(self, node)


async def keep_reading(
    state: RunState,
    peers: Callable[[], Awaitable[RunPeers]],
    *,
    refresh_seconds: float,
    timeout_seconds: float,
    stop: asyncio.Event,
) -> None:
    """Read the run's peers (and a node's status page) into ``state`` every ``refresh_seconds``
    until ``stop``."""
    while not stop.is_set():
        # The node's page first: a page that shows peers shows that node's curves too.
        if state.status_url and state.status_file is None:
            state.node_status = await _node_status(state.status_url, timeout_seconds)
        try:
            async with asyncio.timeout(timeout_seconds):
                found = await peers()
            state.peers, state.read_at, state.error = found, time.time(), ""
            state.reads += 1
        except (TimeoutError, DiscoveryError) as error:
            state.error = str(error) or f"the DHT gave no answer within {timeout_seconds:g} s"
            log.warning("run page: %s; trying again", state.error)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(refresh_seconds):
                await stop.wait()


async def _node_status(url: str, timeout_seconds: float) -> dict[str, Any]:
    try:
        page = await asyncio.to_thread(read_page, url, timeout_seconds)
    except DiscoveryError as error:
        return {"error": str(error)}
    return status_view(page, f"the node's status page {url}")


def application(state: RunState, *, refresh_seconds: float) -> web.Application:
    script = plotly_js()

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info.get("name", "")
        if name not in ASSETS:
            raise web.HTTPNotFound()
        path = HERE / ASSETS[name]
        body = path.read_text()
        if name == "":
            body = body.replace("{{refresh_ms}}", str(int(refresh_seconds * 1000)))
        return web.Response(
            text=body, content_type=TYPES[path.suffix], headers={"Cache-Control": "no-store"}
        )

    async def plotly(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(script, headers={"Content-Type": "text/javascript"})

    async def run(request: web.Request) -> web.StreamResponse:
        return web.Response(
            text=json.dumps(state.document(), allow_nan=False),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    app = web.Application(client_max_size=1024)  # it takes no uploads
    app.router.add_get("/api/run", run)
    app.router.add_get("/plotly.min.js", plotly)
    app.router.add_get("/{name:[a-z.]*}", asset)
    return app


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str, port: int) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0: a free port); yields the page's URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=False)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        raise DashboardError(f"cannot serve the run page on {host}:{port}: {error}") from None
    try:
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        yield f"http://{shown}:{bound}/"
    finally:
        await runner.cleanup()
