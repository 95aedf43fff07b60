"""Published runs: an organizer signs a run's spec with a run key and keeps it in the DHT; anyone
lists the runs there, and a volunteer joins one by its id, with no file.

The organizer's ``swarmgrad publish`` seals the spec's TOML text (with its run id and hash) by
the run key into the key's own slot under ``runs`` and renews it while it runs (a DHT value
lives at most 180 s, so a run nobody publishes any more drops out of the list). The run key's
*fingerprint* is its peer id (``sg...``): a volunteer is given it once, the way one is given an
SSH host key, and ``swarmgrad join RUN_ID --run-key-id sg...`` accepts only the spec that key
sealed, checks that it parses and hashes to what it claims, and remembers the fingerprint for
the run id (a later join of that run under another key is refused). A node of that run then heeds
only the specs its run key published (``node/discovery/directory.py``), and ``swarmgrad runs``
shows every spec that claims a run id, with the full fingerprint of the key that published it,
or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from swarmgrad.node.discovery.base import Discovery, dht_time
from swarmgrad.node.discovery.envelope import Envelope
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.node.trust.allowlist import Allowlist, AllowlistError
from swarmgrad.protocol.errors import SetupError

log = logging.getLogger(__name__)

#: How long a published run lives in the DHT, and how often its publisher renews it.
PUBLISHED_TTL_SECONDS = 150.0
RENEW_SECONDS = 50.0
#: How often ``publish`` reads a private run's allowlist file for changes.
ALLOWLIST_CHECK_SECONDS = 2.0
#: Specs no run key published that ``runs`` lists per run id (with a DHT read each); anyone can
#: announce thousands, the rest are only counted.
MAX_UNSIGNED_ROWS = 8


class RunNotFound(SetupError):
    """No run of that id is published under that run key (or what is published does not hold)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishedRun:
    run_id: str
    spec_hash: str  # hex
    spec_toml: str
    published_at: float

    def body(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, body: bytes) -> tuple[PublishedRun, RunSpec]:
        """The run in ``body`` and its spec; RunSpecError unless the spec parses and is the
        run and hash the body claims."""
        try:
            raw = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RunSpecError("a published run that is not JSON") from None
        except RecursionError:  # anyone may file a value under "runs": "[[[[..." included
            raise RunSpecError("a published run nested too deeply") from None
        names = {"run_id": str, "spec_hash": str, "spec_toml": str, "published_at": float}
        if not isinstance(raw, dict) or set(raw) != set(names):
            raise RunSpecError("a published run with other fields than a run's")
        if not all(isinstance(raw[k], t) for k, t in names.items()):
            raise RunSpecError("a published run with a field of the wrong type")
        run = cls(**raw)
        spec = RunSpec.from_toml(run.spec_toml)
        if spec.run.id != run.run_id or spec.hash.hex() != run.spec_hash:
            raise RunSpecError("a published run whose spec is not the run or hash it claims")
        return run, spec


@dataclass(frozen=True, slots=True)
class Listing:
    """One published run as read from the DHT, its seal and spec checked."""

    run_key_id: str  # the fingerprint of the key that sealed it
    run: PublishedRun
    spec: RunSpec


def listings(envelopes: Sequence[Envelope]) -> list[Listing]:
    """The published runs among ``envelopes`` that hold; the rest are logged and dropped."""
    found = []
    for envelope in envelopes:
        try:
            run, spec = PublishedRun.parse(envelope.body)
        except RunSpecError as error:
            log.info("a published run sealed by %s does not hold: %s", envelope.signer, error)
            continue
        found.append(Listing(run_key_id=envelope.signer, run=run, spec=spec))
    return sorted(found, key=lambda listing: (listing.run.run_id, listing.run_key_id))


async def publish(
    dht: Discovery,
    run_key: Identity,
    spec_toml: str,
    *,
    stop: asyncio.Event,
    allowlist: Callable[[], list[str]] | None = None,
) -> None:
    """Keep the run in ``spec_toml`` published under ``run_key`` until ``stop`` is set, and,
    for a private run, the allowlist ``allowlist()`` reads (a new version as soon as it
    changes: it is read again every :data:`ALLOWLIST_CHECK_SECONDS`)."""
    spec = RunSpec.from_toml(spec_toml)
    run = PublishedRun(
        run_id=spec.run.id,
        spec_hash=spec.hash.hex(),
        spec_toml=spec_toml,
        published_at=dht_time(),
    )
    listed: Allowlist | None = None
    renewed = -math.inf
    while not stop.is_set():
        loop_time = asyncio.get_running_loop().time()
        expires_at = dht_time() + PUBLISHED_TTL_SECONDS
        if allowlist is not None:
            try:
                peers = frozenset(allowlist())
            except SetupError as error:  # a file being edited: keep the last version
                log.warning("%s (keeping allowlist version %s)", error,
                            listed.version if listed else "none")  # fmt: skip
                peers = listed.peers if listed is not None else frozenset()
            if listed is None or peers != listed.peers:
                # A version every reader orders after the last, even across restarts.
                version = max(int(time.time() * 1000), listed.version + 1 if listed else 0)
                listed = Allowlist(version=version, peers=peers)
                renewed = -math.inf
                log.info("allowlist version %d: %d peer(s)", version, len(peers))
        if loop_time - renewed >= RENEW_SECONDS:
            await dht.publish_run(run_key, run.body(), expires_at=expires_at)
            if listed is not None:
                view = dht.for_run(spec.run.id, spec.hash)
                await view.publish_allowlist(run_key, listed.body(), expires_at=expires_at)
            # The first publication (and a new allowlist's) is news; each renewal is not.
            level = logging.INFO if renewed == -math.inf else logging.DEBUG
            renewed = loop_time
            log.log(level, "published run %s (spec %s) as %s",
                    spec.run.id, spec.short_hash, run_key.peer_id)  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), ALLOWLIST_CHECK_SECONDS)


def allowlist_of(envelopes: Sequence[Envelope], run_key_id: str) -> Allowlist | None:
    """The newest allowlist among ``envelopes`` that ``run_key_id`` sealed (None: none holds)."""
    best: Allowlist | None = None
    for envelope in envelopes:
        if envelope.signer != run_key_id:
            continue  # anyone may file a value there; only the run key's counts
        try:
            candidate = Allowlist.parse(envelope.body)
        except AllowlistError:
            continue
        if best is None or candidate.version > best.version:
            best = candidate
    return best


def on_allowlist(
    peers: Sequence[PeerRecord], spec: RunSpec, allowlists: Sequence[Envelope]
) -> tuple[list[PeerRecord], int]:
    """The run's peers among ``peers``, and how many others there were: in a private run, the
    peers not on the allowlist its run key sealed are none of its peers (with no allowlist
    read, no one is: its nodes admit nobody until they read one)."""
    if not spec.trust.private:
        return list(peers), 0
    allowed = allowlist_of(allowlists, spec.trust.run_key)
    kept = [peer for peer in peers if allowed is not None and peer.peer_id in allowed.peers]
    return kept, len(peers) - len(kept)


def announced_spec(body: bytes, spec_hash: str) -> RunSpec | None:
    """The spec a node announced (its canonical JSON), if it parses back to ``spec_hash``."""
    try:
        raw = json.loads(body)
        spec = RunSpec.from_dict(raw) if isinstance(raw, dict) else None
    except (UnicodeDecodeError, ValueError, RecursionError):  # RunSpecError is a ValueError
        return None
    return spec if spec is not None and spec.hash.hex() == spec_hash else None


async def run_rows(dht: Discovery) -> list[dict[str, Any]]:
    """One row per claim on a published run's id: each spec a run key published under it (by
    key), then each spec nodes announce under it that no run key published; each with its
    peers as the DHT shows them (a private run's: those on its allowlist) and how many claims
    its run id has (more than one: all but one are not the organizer's; past
    :data:`MAX_UNSIGNED_ROWS` specs no run key published, the rest have no row)."""
    found = listings(await dht.find_runs())
    rows = []
    for run_id in sorted({listing.run.run_id for listing in found}):
        claims: list[tuple[str, str, RunSpec | None]] = [
            (listing.run_key_id, listing.run.spec_hash, listing.spec)
            for listing in found
            if listing.run.run_id == run_id
        ]
        announced = await dht.for_run(run_id, bytes(32)).find_specs()
        unsigned = sorted(set(announced) - {claim[1] for claim in claims})
        total = len(claims) + len(unsigned)
        for spec_hash in unsigned[:MAX_UNSIGNED_ROWS]:
            claims.append(("", spec_hash, announced_spec(announced[spec_hash], spec_hash)))
        for run_key_id, spec_hash, spec in claims:
            row = await _run_row(dht, run_id, spec_hash, spec)
            rows.append(row | {"run_key_id": run_key_id, "claims": total})
    return rows


async def _run_row(
    dht: Discovery, run_id: str, spec_hash: str, spec: RunSpec | None
) -> dict[str, Any]:
    view = dht.for_run(run_id, bytes.fromhex(spec_hash))
    peers = await view.find()
    strangers = 0
    if spec is not None and spec.trust.private:
        peers, strangers = on_allowlist(peers, spec, await view.find_allowlists())
    summary: dict[str, Any] = {"model": "?", "algorithm": "?", "codec": "?", "trust": "?"}
    if spec is not None:
        summary = {
            "model": f"d{spec.model.d_model} x {spec.model.n_layers} layers",
            "algorithm": spec.algorithm.name,
            "codec": spec.averaging.codec,
            "trust": spec.trust.mode,
        }
    return {
        "run_id": run_id,
        "spec_hash": spec_hash[:12],
        "spec_sha256": spec_hash,
        **summary,
        "peers": len(peers),
        "not_on_allowlist": strangers,
        "epoch": max((p.epoch for p in peers), default=0),
    }


async def fetch(dht: Discovery, run_id: str, run_key_id: str) -> Listing:
    """The run ``run_id`` as sealed by the key ``run_key_id``; RunNotFound otherwise."""
    mine = [
        listing
        for listing in listings(await dht.find_runs())
        if listing.run.run_id == run_id and listing.run_key_id == run_key_id
    ]
    if not mine:
        raise RunNotFound(
            f"no run {run_id!r} published under run key {run_key_id} (is its publisher "
            f"running, and is this the fingerprint its organizer gave?)"
        )
    return max(mine, key=lambda listing: listing.run.published_at)
