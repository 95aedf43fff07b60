"""Waiting in tests: on a condition, with a deadline, never a fixed sleep (and ``light``, the
demo spec made cheaper for tests of the swarm rather than of the model).

``wait_until`` polls a condition from a test's thread; ``until`` is its twin for coroutines;
``wait_for_pattern`` waits for a regular expression in a file (a node's log). Each fails with
what it waited for, and ``check`` (called at every poll) lets a test fail at once when what it
waits on has died instead of waiting out the deadline.

``averagers`` starts the members of a round in this process (on the in-memory transport, or
on real gRPC servers), and ``group_of`` puts them in one round's group: the launcher every round
test shares.

``linked_docs`` reads the docs as a user follows their links: README.md, then every page under
``docs/`` that it (or a page it reached) links; ``doc_blocks`` gives their fenced code blocks of
one language, for tests that check an example in the docs is valid.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from swarmgrad.node.averaging.averager import Averager
    from swarmgrad.node.averaging.group import Group
    from swarmgrad.node.averaging.plan import AllReduceConfig

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
FENCED = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def wait_until(
    condition: Callable[[], T],
    *,
    timeout_seconds: float,
    what: str,
    check: Callable[[], None] | None = None,
    interval_seconds: float = 0.05,
) -> T:
    """The first truthy value of ``condition()``, polled until ``timeout_seconds`` pass."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = condition()
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_seconds:g} s")
        time.sleep(interval_seconds)


async def until(
    condition: Callable[[], Awaitable[T] | T],
    *,
    timeout_seconds: float,
    what: str,
    interval_seconds: float = 0.1,
) -> T:
    """The first truthy value of ``condition()`` (awaited when it is a coroutine's: remote
    state; else read at once: this loop's own), within ``timeout_seconds``."""

    async def read() -> T:
        value = condition()
        return await value if inspect.isawaitable(value) else value

    try:
        async with asyncio.timeout(timeout_seconds):
            while not (value := await read()):  # noqa: ASYNC110 - state others change
                await asyncio.sleep(interval_seconds)
            return value
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout_seconds:g} s") from None


def wait_for_pattern(
    path: Path,
    pattern: str,
    *,
    timeout_seconds: float,
    check: Callable[[], None] | None = None,
) -> re.Match[str]:
    """The first match of ``pattern`` in the file at ``path`` (which may not exist yet)."""

    def search() -> re.Match[str] | None:
        return re.search(pattern, path.read_text(errors="replace")) if path.exists() else None

    return wait_until(
        search, timeout_seconds=timeout_seconds, what=f"{pattern!r} in {path}", check=check
    )


def light(spec: str) -> str:
    """The demo spec (or one built on it) training an eighth of its tokens a step (4 sequences of
    32: a step takes 11 ms of one core, against 69 ms for the demo's 16 of 64 and 19 ms for 8 of
    32): for tests of the swarm (reachability, recovery, metrics), where the model's size is not
    what is tested."""
    for full, small in (("seq_len = 64", "seq_len = 32"), ("batch_size = 16", "batch_size = 4")):
        if full not in spec:
            raise ValueError(f"not the demo spec's {full!r}")
        spec = spec.replace(full, small)
    return spec


def markdown_links(text: str) -> list[str]:
    """The targets of the ``[text](target)`` links in a markdown text, outside code blocks."""
    return LINK.findall(FENCED.sub("", text))


def linked_docs() -> dict[Path, str]:
    """README.md and every markdown page under ``docs/`` reached from it by relative links, in
    the order a reader meets them, by path relative to the repository."""
    pages: dict[Path, str] = {}
    queue = [ROOT / "README.md"]
    while queue:
        page = queue.pop(0).resolve()
        if page in pages or not page.is_file():
            continue
        pages[page] = page.read_text()
        for target in markdown_links(pages[page]):
            path = target.split("#", 1)[0]
            if path.endswith(".md") and "://" not in path:
                linked = (page.parent / path).resolve()
                if linked == ROOT / "README.md" or linked.is_relative_to(ROOT / "docs"):
                    queue.append(linked)
    return {page.relative_to(ROOT): text for page, text in pages.items()}


def doc_blocks(language: str) -> list[tuple[Path, str]]:
    """Every ```language block of ``linked_docs()``, with the page it is on."""
    fence = re.compile(rf"^```{re.escape(language)}\n(.*?)^```", re.M | re.S)
    return [(page, block) for page, text in linked_docs().items() for block in fence.findall(text)]


def libp2p_peer_id(public_key: bytes) -> str:
    """libp2p's peer id of an Ed25519 key: the identity multihash (0x00, length) of the key's
    ``crypto.pb.PublicKey`` (type 1, Ed25519), in base58."""
    message = bytes([0x08, 0x01, 0x12, len(public_key)]) + public_key
    number = int.from_bytes(bytes([0x00, len(message)]) + message, "big")
    digits = ""
    while number:
        number, digit = divmod(number, 58)
        digits = BASE58[digit] + digits
    return "1" + digits  # the multihash's leading zero byte


BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def stop_processes(
    started: Sequence[Any], sig: int = signal.SIGINT, timeout_seconds: float = 60
) -> None:
    """Ask each of ``started`` (``Popen``s, or launchers' children) still running to stop with
    ``sig``, then wait for all of them, killing any that outlive ``timeout_seconds`` (a test
    fixture's teardown; their output goes to files, not pipes)."""
    for process in started:
        if process.poll() is None:
            process.send_signal(sig)
    for process in started:
        try:
            process.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.asynccontextmanager
async def averagers(
    n: int, config: AllReduceConfig, *, name: str, sockets: bool = False
) -> AsyncIterator[list[Averager]]:
    """``n`` averagers of one run, keyed ``{name}/0``.. (the same peers every run): on the
    in-memory transport (the round's logic, every message serialized and parsed as on the
    wire, in seconds), or with ``sockets`` on real gRPC servers on 127.0.0.1 (what only the
    wire shows)."""
    from swarmgrad.node.averaging.averager import standalone
    from swarmgrad.node.identity import Identity
    from swarmgrad.node.transport.memory import MemoryNetwork

    network = None if sockets else MemoryNetwork()
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                standalone(Identity.from_seed(f"{name}/{i}"), config, network=network)
            )
            for i in range(n)
        ]


def group_of(members: Sequence[Averager], round_: int) -> Group:
    """The group of one round: ``members``, in that order."""
    from swarmgrad.node.averaging.group import Group, Member

    return Group(
        round=round_, members=tuple(Member(peer_id=a.peer_id, endpoint=a.endpoint) for a in members)
    )
