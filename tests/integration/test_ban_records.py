"""Open runs: ban records in a real DHT. Evidence one node publishes bans the peer it convicts
in every node that reads and checks it; records that prove nothing ban nobody."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from swarmgrad.node import Swarm, SwarmConfig
from swarmgrad.node.averaging.open.evidence import equivocation, verify_bytes
from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.hivemind_dht import HivemindDiscovery
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.trust.board import REFRESH_SECONDS, BanBoard
from swarmgrad.node.trust.ledger import Flag, TrustLedger
from swarmgrad.protocol.averaging import ACCOUNT_STATEMENT, seal
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.simulations.swarm import DEMO_SPEC
from tests.helpers import until
from tests.integration.dht_nodes import hivemind_nodes

RUN, SPEC = "bans", b"\x07" * 32


def account(
    owner: Identity, clip: float, *, round_: int = 3, run: tuple[str, bytes] = (RUN, SPEC)
) -> averaging_pb2.Signed:
    """A signed account of part 1 of a round of ``run`` (id, spec hash), by ``owner``."""
    run_id, spec_hash = run
    body = averaging_pb2.PartAccount(
        key=averaging_pb2.RoundKey(
            run_id=run_id, spec_hash=spec_hash, round=round_, group_id=b"g" * 16
        ),
        owner=owner.peer_id,
        part=1,
        chunks=[
            averaging_pb2.ChunkAccount(
                result_sha256=bytes(32), contributors=[0], clip=[clip], payload_sha256=[bytes(32)]
            )
        ],
    )
    return seal(owner, ACCOUNT_STATEMENT, body)


def two_faced(owner: Identity, run: tuple[str, bytes] = (RUN, SPEC)) -> bytes:
    """Evidence that ``owner`` signed two accounts of one part of one round."""
    proof = equivocation(account(owner, 1.0, run=run), account(owner, 0.5, run=run))
    return proof.SerializeToString(deterministic=True)


def board_of(identity: Identity, dht: HivemindDiscovery, ledger: TrustLedger) -> BanBoard:
    board = BanBoard(
        ledger,
        me=identity.peer_id,
        verify=lambda data: verify_bytes(data, run_id=RUN, spec_hash=SPEC),
        channel=dht,
    )
    return board


async def read_until(board: BanBoard, done: Callable[[], bool], what: str) -> None:
    """Refresh ``board`` until ``done()`` holds (a DHT store takes a moment to spread)."""

    async def refreshed() -> bool:
        await board.refresh()
        return done()

    await until(refreshed, timeout_seconds=30, what=what, interval_seconds=0.2)


async def test_published_evidence_bans_the_peer_everywhere_and_lies_ban_nobody(
    tmp_path: Path,
) -> None:
    cheat, honest = Identity.generate(), Identity.generate()
    async with hivemind_nodes(4, run_id=RUN, spec_hash=SPEC) as nodes:
        (alice, alice_dht), (bob, bob_dht), (mallory, mallory_dht), (_, eve_dht) = nodes
        # Alice convicted the cheat in a round (and holds evidence against Bob too: Bob's key
        # signed two accounts; Bob must not ban himself on it).
        judge = TrustLedger()
        judge.note(3, {cheat.peer_id: Flag.EQUIVOCATION}, {cheat.peer_id: two_faced(cheat)})
        judge.note(4, {bob.peer_id: Flag.EQUIVOCATION}, {bob.peer_id: two_faced(bob)})
        await board_of(alice, alice_dht, judge).refresh()
        # Mallory publishes "evidence" against an honest peer: accounts it signed in the honest
        # peer's name, the same account twice, two accounts of different rounds; Eve garbage.
        swapped = averaging_pb2.Signed(
            body=account(mallory, 0.5).body, auth=account(honest, 0.5).auth
        )  # an honest signature over another body
        lies = averaging_pb2.EvidenceList(
            items=[
                equivocation(account(mallory, 1.0), account(mallory, 0.5)),  # real, but of Mallory
                averaging_pb2.Evidence(
                    reason="equivocation", accounts=[account(honest, 1.0), swapped]
                ),
                equivocation(account(honest, 1.0), account(honest, 1.0)),
                equivocation(account(honest, 1.0), account(honest, 0.5, round_=4)),
                averaging_pb2.Evidence(reason="gossip"),
            ]
        )
        await mallory_dht.publish_bans(lies.SerializeToString(), expires_at=dht_time() + 60)
        await eve_dht.publish_bans(b"\xff not evidence", expires_at=dht_time() + 60)

        reader = TrustLedger(store=tmp_path / "bans.json")
        board = board_of(bob, bob_dht, reader)
        await read_until(
            board,
            lambda: (
                reader.banned(cheat.peer_id)
                and board.counts["rejected"] >= 5
                and board.counts["against_me"] == 1
            ),
            "the cheat banned, the lies rejected",
        )
        # Mallory convicted herself (her own key signed two accounts): the only other ban.
        assert set(reader.bans) == {cheat.peer_id, mallory.peer_id}
        ban = reader.bans[cheat.peer_id]
        assert (ban.flags, ban.round, ban.source) == ((Flag.EQUIVOCATION,), 3, alice.peer_id)
        assert not reader.banned(honest.peer_id)
        assert not reader.banned(bob.peer_id)
        assert reader.table()[cheat.peer_id]["banned"] == {
            "round": 3, "reason": "equivocation", "evidence": True, "source": alice.peer_id
        }  # fmt: skip
        # A record already read is not checked again.
        before = dict(board.counts)
        await board.refresh()
        assert {k: v for k, v in board.counts.items() if k != "published"} == {
            k: v for k, v in before.items() if k != "published"
        }
        # Bob now publishes what he adopted: a node that joins later finds it at Bob's too.
        assert board.counts["published"] >= 1
        found = {e.signer: e for e in await alice_dht.find_bans()}
        assert bob.peer_id in found
        assert {
            verify_bytes(item.SerializeToString(), run_id=RUN, spec_hash=SPEC)[0]
            for item in averaging_pb2.EvidenceList.FromString(found[bob.peer_id].body).items
        } == {cheat.peer_id, mallory.peer_id}
        # The adopted bans, with their evidence, outlive a restart.
        again = TrustLedger(store=tmp_path / "bans.json")
        assert again.bans == reader.bans
        assert sorted(again.evidence()) == sorted(reader.evidence())


async def test_open_nodes_exchange_ban_records_and_stop_grouping_with_the_convicted() -> None:
    """Two open-run nodes (their DHT, their ban-record task): what one convicts, the other bans
    within a refresh, and neither groups with that peer any more."""
    spec = RunSpec.from_toml(DEMO_SPEC + '\n[trust]\nmode = "open"\n')
    cheat = Identity.generate()
    async with Swarm(spec, Identity.generate(), SwarmConfig()) as first:
        bootstrap = tuple(first.visible_maddrs())
        async with Swarm(spec, Identity.generate(), SwarmConfig(bootstrap=bootstrap)) as second:
            assert first.board is not None
            assert second.board is not None
            proof = two_faced(cheat, (spec.run.id, spec.hash))
            first.ledger.note(5, {cheat.peer_id: Flag.EQUIVOCATION}, {cheat.peer_id: proof})
            await first.board.refresh()

            async def adopted() -> bool:  # its own task reads the records
                return second.excludes(cheat.peer_id)

            await until(adopted, timeout_seconds=3 * REFRESH_SECONDS, what="the ban adopted",
                        interval_seconds=0.2)  # fmt: skip
            assert second.ledger.bans[cheat.peer_id].source == first.peer_id
            assert second.board.counts["adopted"] == 1
            assert not second.excludes(first.peer_id)
