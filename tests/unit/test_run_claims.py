"""Hostile claims on a run (issue 42): a look-alike spec announced under a run's id does not keep
a node tied to the run key out; ``runs`` names every claimant in full; a private run's peers are
those on its allowlist; ``status`` warns about a pipeline that is not a private run. No sockets:
the DHT here is a dict of sealed values."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, cast

import pytest
from typer.testing import CliRunner

from swarmgrad.node import config as node_config
from swarmgrad.node import run_commands, status
from swarmgrad.node.cli import app
from swarmgrad.node.discovery.base import Discovery, dht_time
from swarmgrad.node.discovery.directory import DirectoryConfig, PeerDirectory, SpecMismatch
from swarmgrad.node.discovery.envelope import Envelope, Kind
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.published import MAX_UNSIGNED_ROWS, PublishedRun, run_rows
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.scraped import Tallies
from swarmgrad.node.ticket import Ticket
from swarmgrad.node.trust.allowlist import Allowlist

RUN = "claimed"
SPEC = f'[run]\nid = "{RUN}"\n[model]\nd_model = 64\n'
LOOK_ALIKE = SPEC.replace("d_model = 64", "d_model = 32")
ORGANIZER, MALLORY = Identity.from_seed("claims/organizer"), Identity.from_seed("claims/mallory")
MALLORYS_NODE = Identity.from_seed("claims/mallory-node")


def sealed(signer: Identity, kind: Kind, body: bytes) -> Envelope:
    now = dht_time()
    return Envelope(key="k", kind=kind, public_key=signer.public_key, issued_at=now,
                    expires_at=now + 60, body=body)  # fmt: skip


def published_by(key: Identity, toml: str) -> Envelope:
    spec = RunSpec.from_toml(toml)
    run = PublishedRun(run_id=spec.run.id, spec_hash=spec.hash.hex(), spec_toml=toml,
                       published_at=dht_time())  # fmt: skip
    return sealed(key, Kind.RUN, run.body())


class FakeDHT:
    """The few reads the spec check, ``runs`` and ``status`` make, over values set by the test."""

    def __init__(self, run_id: str = RUN, spec_hash: bytes = bytes(32)) -> None:
        self.run_id, self.spec_hash = run_id, spec_hash
        self.specs: list[Envelope] = []  # announced under the run id, each by its node
        self.runs: list[Envelope] = []  # published under "runs"
        self.peers: dict[tuple[str, str], list[PeerRecord]] = {}  # (run id, spec hex) ->
        self.allowlists: list[Envelope] = []

    def for_run(self, run_id: str, spec_hash: bytes) -> FakeDHT:
        view = FakeDHT(run_id, spec_hash)
        view.specs, view.runs, view.peers = self.specs, self.runs, self.peers
        view.allowlists = self.allowlists
        return view

    def announce_by(self, node: Identity, spec: RunSpec) -> None:
        self.specs.append(sealed(node, Kind.SPEC, spec.canonical()))

    async def find_spec_announcements(self) -> list[Envelope]:
        return list(self.specs)

    async def find_specs(self) -> dict[str, bytes]:
        return {hashlib.sha256(e.body).hexdigest(): e.body for e in self.specs}

    async def announce_spec(self, canonical: bytes, *, expires_at: float) -> None:
        self.specs.append(sealed(Identity.from_seed("claims/me"), Kind.SPEC, canonical))

    async def find_runs(self) -> list[Envelope]:
        return list(self.runs)

    async def find(self) -> list[PeerRecord]:
        return list(self.peers.get((self.run_id, self.spec_hash.hex()), []))

    async def find_allowlists(self) -> list[Envelope]:
        return list(self.allowlists)

    def for_spec(self, spec_hash: bytes) -> FakeDHT:
        return self.for_run(self.run_id, spec_hash)

    async def close(self) -> None:
        pass


def directory(dht: FakeDHT, spec: RunSpec, run_key_id: str = "") -> PeerDirectory:
    def no_record(now: float, ttl: float) -> PeerRecord:
        raise AssertionError("check_spec announces the spec, not a record")

    return PeerDirectory(cast(Discovery, dht), spec, DirectoryConfig(run_key_id=run_key_id),
                         own_record=no_record, tallies=Tallies())  # fmt: skip


# -- the spec check ------------------------------------------------------------------------------


async def test_a_joined_node_ignores_a_look_alike_its_run_key_did_not_publish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec, look_alike = RunSpec.from_toml(SPEC), RunSpec.from_toml(LOOK_ALIKE)
    dht = FakeDHT()
    dht.runs += [published_by(ORGANIZER, SPEC), published_by(MALLORY, LOOK_ALIKE)]
    dht.announce_by(MALLORYS_NODE, look_alike)
    with caplog.at_level(logging.INFO):
        await directory(dht, spec, run_key_id=ORGANIZER.peer_id).check_spec()
    assert spec.hash.hex() in await dht.find_specs()  # it joined: its spec is announced
    ignored = [r.getMessage() for r in caplog.records if "ignoring run spec" in r.getMessage()]
    assert len(ignored) == 1, ignored
    assert MALLORYS_NODE.peer_id in ignored[0]
    assert ORGANIZER.peer_id in ignored[0]


async def test_a_private_specs_run_key_ties_it_without_a_join() -> None:
    private = SPEC + f'[trust]\nmode = "private"\nrun_key = "{ORGANIZER.peer_id}"\n'
    spec = RunSpec.from_toml(private)
    dht = FakeDHT()
    # The look-alike names the same run key; the key never published it.
    look_alike = RunSpec.from_toml(private.replace("d_model = 64", "d_model = 32"))
    dht.announce_by(MALLORYS_NODE, look_alike)
    await directory(dht, spec).check_spec()


async def test_a_node_with_no_run_key_still_refuses_another_spec() -> None:
    spec = RunSpec.from_toml(SPEC)
    dht = FakeDHT()
    dht.runs.append(published_by(ORGANIZER, SPEC))
    dht.announce_by(MALLORYS_NODE, RunSpec.from_toml(LOOK_ALIKE))
    with pytest.raises(SpecMismatch, match=r"different run spec .*model.d_model"):
        await directory(dht, spec).check_spec()


async def test_another_spec_the_run_key_published_is_still_refused() -> None:
    newer = SPEC.replace("d_model = 64", "d_model = 96")
    dht = FakeDHT()
    dht.runs.append(published_by(ORGANIZER, newer))
    dht.announce_by(MALLORYS_NODE, RunSpec.from_toml(newer))  # whoever announces it
    with pytest.raises(SpecMismatch, match=f"published by its run key {ORGANIZER.peer_id}"):
        await directory(dht, RunSpec.from_toml(SPEC), ORGANIZER.peer_id).check_spec()


PIPELINE = f"""\
[run]
id = "{RUN}"
[model]
n_layers = 2
[data]
batch_size = 8
[pipeline]
stages = 2
"""


async def test_a_stage_server_heeds_the_stage_specs_of_its_run_keys_pipeline() -> None:
    mine = RunSpec.from_toml(PIPELINE).stage_spec(0)
    newer = PIPELINE.replace("batch_size = 8", "batch_size = 16")
    dht = FakeDHT(mine.run.id)
    dht.runs.append(published_by(ORGANIZER, newer))
    look_alike = RunSpec.from_toml(newer.replace("n_layers = 2", "n_layers = 3"))
    dht.announce_by(MALLORYS_NODE, look_alike.stage_spec(0))
    await directory(dht, mine, ORGANIZER.peer_id).check_spec()  # not the key's: ignored
    dht.specs.clear()
    dht.announce_by(MALLORYS_NODE, RunSpec.from_toml(newer).stage_spec(0))
    with pytest.raises(SpecMismatch, match="published by its run key"):
        await directory(dht, mine, ORGANIZER.peer_id).check_spec()


# -- runs: every claim, in full; a private run's peers -----------------------------------------


def peer(identity: Identity, spec: RunSpec, epoch: int) -> PeerRecord:
    return PeerRecord.create(identity.peer_id, run_id=spec.run.id, spec_hash=spec.hash,
                             endpoint="127.0.0.1:1", now=dht_time(), ttl_seconds=60,
                             epoch=epoch)  # fmt: skip


async def test_runs_names_every_claim_on_a_run_id_with_its_full_run_key() -> None:
    dht = FakeDHT()
    dht.runs += [published_by(ORGANIZER, SPEC), published_by(MALLORY, LOOK_ALIKE)]
    unsigned = RunSpec.from_toml(SPEC.replace("d_model = 64", "d_model = 16"))
    dht.announce_by(MALLORYS_NODE, unsigned)
    rows = await run_rows(cast(Discovery, dht))
    signed = sorted([ORGANIZER.peer_id, MALLORY.peer_id])
    assert [(r["run_key_id"], r["claims"]) for r in rows] == [(k, 3) for k in [*signed, ""]]
    text = "\n".join(run_commands._claims(rows))
    assert f"3 claims on run id '{RUN}'" in text
    for key in (ORGANIZER, MALLORY):
        spec_hash = RunSpec.from_toml(SPEC if key is ORGANIZER else LOOK_ALIKE).hash.hex()
        assert f"spec {spec_hash}  signed by run key {key.peer_id}" in text
    assert f"spec {unsigned.hash.hex()}  signed by no run key" in text
    assert rows[-1]["model"] == f"d16 x {unsigned.model.n_layers} layers"  # read back


async def test_a_private_runs_peers_are_those_on_its_allowlist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    private = SPEC + f'[trust]\nmode = "private"\nrun_key = "{ORGANIZER.peer_id}"\n'
    spec = RunSpec.from_toml(private)
    member, stranger = Identity.from_seed("claims/member"), Identity.from_seed("claims/stranger")
    dht = FakeDHT()
    dht.runs.append(published_by(ORGANIZER, private))
    dht.peers[(RUN, spec.hash.hex())] = [peer(member, spec, 3), peer(stranger, spec, 999)]
    allowed = Allowlist(version=1, peers=frozenset({member.peer_id}))
    dht.allowlists += [
        sealed(ORGANIZER, Kind.ALLOWLIST, allowed.body()),
        # Anyone may file an allowlist there; only the run key's counts.
        sealed(MALLORY, Kind.ALLOWLIST, Allowlist(2, frozenset({stranger.peer_id})).body()),
    ]
    (row,) = await run_rows(cast(Discovery, dht))
    assert (row["peers"], row["not_on_allowlist"], row["epoch"]) == (1, 1, 3)

    async def reader(*args: Any, **kwargs: Any) -> FakeDHT:
        return dht.for_run(kwargs["run_id"], kwargs["spec_hash"])

    monkeypatch.setattr(status, "start_reader", reader)
    found = await status.run_peers(bootstrap=[], run_id=RUN, spec=spec, timeout_seconds=5)
    assert [r["peer_id"] for r in found.rows] == [member.peer_id]
    assert found.not_on_allowlist == 1
    # Without a spec (--run), the private spec is read back from its announcement.
    dht.announce_by(member, spec)
    found = await status.run_peers(bootstrap=[], run_id=RUN, spec=None, timeout_seconds=5)
    assert ([r["peer_id"] for r in found.rows], found.not_on_allowlist) == ([member.peer_id], 1)


# -- status: a private run's peers, and the pipeline warning ------------------------------------


MULTIADDR = "/ip4/127.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def status_of(spec: Path, dht: FakeDHT, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """``swarmgrad status SPEC``'s output, its DHT reader reading ``dht``."""

    async def reader(*args: Any, **kwargs: Any) -> FakeDHT:
        return dht.for_run(kwargs["run_id"], kwargs["spec_hash"])

    monkeypatch.setattr(status, "start_reader", reader)
    result = CliRunner().invoke(app, ["status", str(spec), "--bootstrap", MULTIADDR, *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_status_warns_when_a_pipeline_is_not_a_private_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pipeline cannot be a private run yet (the spec refuses it): every one is warned about.
    (tmp_path / "pipe.toml").write_text(PIPELINE)
    shown = status_of(tmp_path / "pipe.toml", FakeDHT(), monkeypatch)
    assert "warning: run 'claimed' uses pipeline stages and is not a private run" in shown
    assert "wrong activations or gradients from one go unnoticed" in shown
    (tmp_path / "run.toml").write_text(SPEC)
    assert "warning" not in status_of(tmp_path / "run.toml", FakeDHT(), monkeypatch)


def test_status_shows_a_private_runs_peers_and_counts_the_others_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = SPEC + f'[trust]\nmode = "private"\nrun_key = "{ORGANIZER.peer_id}"\n'
    spec = RunSpec.from_toml(private)
    member, stranger = Identity.from_seed("claims/member"), Identity.from_seed("claims/stranger")
    dht = FakeDHT()
    dht.peers[(RUN, spec.hash.hex())] = [peer(member, spec, 3), peer(stranger, spec, 999)]
    allowed = Allowlist(version=1, peers=frozenset({member.peer_id}))
    dht.allowlists.append(sealed(ORGANIZER, Kind.ALLOWLIST, allowed.body()))
    (tmp_path / "run.toml").write_text(private)
    shown = status_of(tmp_path / "run.toml", dht, monkeypatch)
    assert "run claimed: 1 peer(s)" in shown
    assert "not on the allowlist: 1" in shown
    assert "999" not in shown  # the stranger's epoch
    shown = json.loads(status_of(tmp_path / "run.toml", dht, monkeypatch, "--json"))
    assert [row["peer_id"] for row in shown["peers"]] == [member.peer_id]
    assert shown["not_on_allowlist"] == 1


def test_status_reads_a_run_from_its_ticket_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ticket names the run, its bootstraps and its DHT backend: nothing else is needed, and
    # every spec in use is shown. An altered ticket is refused before the DHT is asked.
    spec = RunSpec.from_toml(SPEC)
    member = Identity.from_seed("claims/member")
    dht = FakeDHT()
    dht.announce_by(member, spec)
    dht.peers[(RUN, spec.hash.hex())] = [peer(member, spec, 7)]
    ticket = Ticket(run_id=RUN, run_key=ORGANIZER.public_key, spec_hash=spec.hash.hex(),
                    bootstrap=(MULTIADDR,), discovery="libp2p").encode(ORGANIZER)  # fmt: skip
    asked: list[tuple[Any, ...]] = []

    async def reader(bootstrap: Any, **kwargs: Any) -> FakeDHT:
        asked.append((tuple(bootstrap), kwargs["backend"]))
        return dht.for_run(kwargs["run_id"], kwargs["spec_hash"])

    monkeypatch.setattr(status, "start_reader", reader)
    (tmp_path / "ticket.txt").write_text(ticket + "\n")
    for argument in (ticket, str(tmp_path / "ticket.txt")):
        result = CliRunner().invoke(app, ["status", argument, "--json"])
        assert result.exit_code == 0, result.output
        shown = json.loads(result.output)
        assert (shown["run"], [row["epoch"] for row in shown["peers"]]) == (RUN, [7])
    assert asked == [((MULTIADDR,), "libp2p")] * 2
    altered = ticket[:-6] + ("AAAAAA" if not ticket.endswith("AAAAAA") else "BBBBBB")
    result = CliRunner().invoke(app, ["status", altered])
    assert result.exit_code == 2
    assert "ticket" in result.output
    assert len(asked) == 2
    result = CliRunner().invoke(app, ["status", ticket, "--watch", "0.1"])
    assert result.exit_code == 2
    assert "--watch" in result.output


def test_a_run_joined_under_a_run_key_ties_this_machines_nodes_to_it(tmp_path: Path) -> None:
    environ = {"SWARMGRAD_HOME": str(tmp_path)}
    spec = node_config.remember_joined_run(RUN, ORGANIZER.peer_id, SPEC, environ)
    config = node_config.node_config(spec_path=spec, environ=environ)
    assert config.swarm.directory().run_key_id == ORGANIZER.peer_id
    (tmp_path / "other.toml").write_text(SPEC.replace(RUN, "another-run"))
    config = node_config.node_config(spec_path=tmp_path / "other.toml", environ=environ)
    assert config.swarm.directory().run_key_id == ""


async def test_runs_shows_each_run_key_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    dht = FakeDHT()
    dht.runs += [published_by(ORGANIZER, SPEC), published_by(MALLORY, LOOK_ALIKE)]
    rows = await run_rows(cast(Discovery, dht))
    monkeypatch.setattr(run_commands, "_read_dht", lambda *args, **kwargs: rows)
    result = CliRunner().invoke(app, ["runs", "--bootstrap", MULTIADDR])
    assert result.exit_code == 0, result.output
    for key in (ORGANIZER, MALLORY):  # in the table's rows, and in the claims below it
        assert result.output.count(key.peer_id) == 2, result.output
    assert f"2 claims on run id '{RUN}'" in result.output


async def test_runs_lists_a_few_specs_no_run_key_published_and_counts_the_rest() -> None:
    dht = FakeDHT()
    dht.runs.append(published_by(ORGANIZER, SPEC))
    for i in range(MAX_UNSIGNED_ROWS + 3):  # a flood, each under its own node's slot
        flood = RunSpec.from_toml(SPEC.replace("d_model = 64", f"d_model = {96 + 32 * i}"))
        dht.announce_by(Identity.from_seed(f"claims/flood-{i}"), flood)
    rows = await run_rows(cast(Discovery, dht))
    assert len(rows) == 1 + MAX_UNSIGNED_ROWS
    assert {row["claims"] for row in rows} == {1 + MAX_UNSIGNED_ROWS + 3}
    text = "\n".join(run_commands._claims(rows))
    assert f"{MAX_UNSIGNED_ROWS + 4} claims on run id '{RUN}'" in text
    assert "and 3 more signed by no run key" in text
