"""Bounds of the open-run trust machinery, without sockets: what an owner's account may hold,
how many judgements a round is, and the memory and metrics series the ledger keeps as peer ids
come and go."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import generate_latest

from swarmgrad.node.averaging.group import Group, Member, chunk_sizes
from swarmgrad.node.averaging.open import evidence
from swarmgrad.node.averaging.open.checks import verify_account
from swarmgrad.node.averaging.plan import AllReduceConfig, round_key
from swarmgrad.node.identity import Identity
from swarmgrad.node.metrics import NodeMetrics
from swarmgrad.node.scraped import PEER_SERIES_ROUNDS
from swarmgrad.node.trust.aggregate import Aggregator, aggregate
from swarmgrad.node.trust.ledger import Flag, Observation, TrustLedger, TrustPolicy
from swarmgrad.protocol.averaging import ACCOUNT_STATEMENT, seal
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.auth_pb2 import Auth

IDS = [Identity.from_seed(f"trust-audit/{i}") for i in range(4)]
GROUP = Group(round=3, members=tuple(Member(peer_id=i.peer_id, endpoint="h:1") for i in IDS))
KEY = round_key(
    AllReduceConfig(run_id="r", spec_hash=bytes(32), observe=True, aggregator="centered_clip"),
    GROUP,
)


def account(result: bytes = b"\1" * 32) -> averaging_pb2.PartAccount:
    """Owner 3's account of its one-chunk part, shaped as an honest owner's is."""
    chunk = averaging_pb2.ChunkAccount(
        result_sha256=result, contributors=[0, 1, 2], clip=[1, 1, 1], payload_sha256=[b"p" * 32] * 3
    )
    auths = [
        Auth(public_key=IDS[m].public_key, issued_at=1.0, nonce=b"n" * 16, signature=b"s" * 64)
        for m in range(3)
    ]
    return averaging_pb2.PartAccount(
        key=KEY,
        owner=IDS[3].peer_id,
        part=3,
        chunks=[chunk],
        members=[0, 1, 2],
        commitments=[b"c" * 32] * 3,
        header_auths=auths,
    )


def verified(part_account: averaging_pb2.PartAccount) -> averaging_pb2.PartAccount:
    signed = seal(IDS[3], ACCOUNT_STATEMENT, part_account)
    return verify_account(signed, group=GROUP, key=KEY, part=3, numels=[1024])


def test_an_account_is_refused_unless_every_field_has_its_exact_shape() -> None:
    """An account is shown again as evidence and read by audits: a malformed key would break
    every audit of the part, a padded one would make its equivocation evidence too large to
    publish."""
    verified(account())
    one_byte_key = account()
    one_byte_key.header_auths[0].public_key = b"\x00"
    padded = account()
    padded.header_auths[0].nonce = bytes(16 * 1024)
    anothers_key = account()
    anothers_key.header_auths[0].public_key = IDS[1].public_key
    long_signature = account()
    long_signature.header_auths[2].signature = b"s" * 65
    for malformed in (one_byte_key, padded, anothers_key, long_signature):
        with pytest.raises(ProtocolViolation, match="malformed header signature"):
            verified(malformed)
    unknown = averaging_pb2.PartAccount.FromString(
        account().SerializeToString() + b"\xc0\x3e" + b"\x01"  # field 1000, a varint
    )
    with pytest.raises(ProtocolViolation, match="fields this protocol does not have"):
        verified(unknown)
    # An account that passes is small enough to be published as equivocation evidence.
    a, b = (seal(IDS[3], ACCOUNT_STATEMENT, account(bytes([i]) * 32)) for i in (1, 2))
    proof = evidence.equivocation(a, b).SerializeToString(deterministic=True)
    assert len(proof) <= evidence.MAX_EVIDENCE_BYTES


def observed(clip: float = 1.0, cosine: float = 0.9) -> Observation:
    seen = Observation()
    seen.add_chunk(1000, clip, cosine)
    return seen


def test_a_round_is_one_judgement_however_many_checks_flag_it() -> None:
    """The averager notes the checks' flags, then the owner's statistics, of one round: two
    flagged rounds are two, not three in a row."""
    ledger = TrustLedger()
    ok = {"other": observed()}  # a peer it knows besides: banning one of two isolates nobody
    assert ledger.note(1, {"peer": Flag.SILENT}) == []
    assert ledger.observe(1, {"peer": observed(clip=0.1)} | ok) == []
    assert ledger.observe(2, {"peer": observed(clip=0.1)} | ok) == []
    assert not ledger.banned("peer")
    assert ledger.scores["peer"].rounds == 2
    assert ledger.table()["peer"]["flags"] == {"clipped": 2, "silent": 1}
    (ban,) = ledger.observe(3, {"peer": observed(clip=0.1)} | ok)
    assert (ban.round, ban.flags) == (3, (Flag.CLIPPED,))


def test_a_peer_silent_every_round_is_banned_though_its_values_look_fine() -> None:
    ledger = TrustLedger()
    bans = []
    for round_ in range(3):
        bans += ledger.note(round_, {"mute": Flag.SILENT})
        bans += ledger.observe(round_, {"mute": observed()})
    assert [(b.peer_id, b.round, b.flags) for b in bans] == [("mute", 2, (Flag.SILENT,))]


def test_a_late_audit_of_an_earlier_round_bans_without_moving_the_streak() -> None:
    ledger = TrustLedger()
    ledger.observe(5, {"owner": observed()})
    (ban,) = ledger.note(4, {"owner": Flag.FAILED_AUDIT})
    assert ban.flags == (Flag.FAILED_AUDIT,)
    assert ledger.scores["owner"].rounds == 1


def test_replay_fingerprints_stay_bounded_as_bandwidths_move_the_parts() -> None:
    """A member declaring a new bandwidth each round moves every chunk's place; the ledger
    keeps fingerprints of at most ``sketch_positions`` places, and still finds a replay at a
    place it keeps seeing."""
    ledger = TrustLedger(TrustPolicy(sketch_positions=32))
    ids = [f"sg{i}" for i in range(4)]
    rng = random.Random(0)
    total = 4 * 10 * 4096
    fingerprint = torch.randn(256, dtype=torch.float64)
    for round_ in range(200):
        bandwidths = [rng.uniform(0.01, 4.0), 1.0, 1.0, 1.0]
        group = Group(
            round=round_,
            members=tuple(
                Member(peer_id=p, endpoint="h:1", bandwidth=b)
                for p, b in zip(ids, bandwidths, strict=True)
            ),
        )
        start, end = group.partition(total)[1]
        observations = {}
        for member in (ids[0], ids[2], ids[3]):
            seen, at = observed(), start
            for numel in chunk_sizes(end - start, 4096):
                seen.sketches[(at, numel)] = torch.randn(256, dtype=torch.float64)
                at += numel
            observations[member] = seen
        ledger.observe(round_, observations)
        assert len(ledger._sketches) <= 32
        assert not ledger._stacked
    replayed = observed()
    replayed.sketches[(0, 4096)] = fingerprint
    ledger.observe(200, {"a": replayed})
    again = observed()
    again.sketches[(0, 4096)] = fingerprint.clone()
    ledger.observe(201, {"b": again})
    assert ledger.scores["b"].flags == {Flag.REPLAY: 1}


def test_the_ledger_forgets_churned_peers_and_metrics_show_only_recent_ones() -> None:
    ledger = TrustLedger(TrustPolicy(forget_after_rounds=PEER_SERIES_ROUNDS + 50))
    metrics = NodeMetrics(peer_id="sgme", run_id="r", spec_hash="00", algorithm="a", codec="c")
    metrics.read_trust(lambda: (ledger.table(), (*ledger.counts(), {}, {})))
    ledger.note(0, {"sgcheat": Flag.LYING_OWNER})
    rounds = 3 * PEER_SERIES_ROUNDS
    for round_ in range(rounds):  # four new peer ids a round, each seen once
        ledger.observe(round_, {f"sg{round_}x{k}": observed() for k in range(4)})
        ledger.dispute(round_, [f"sgowner{round_}"])
    assert len(ledger.scores) <= 5 * (PEER_SERIES_ROUNDS + 51) + 1
    assert ledger.banned("sgcheat")  # a ban stays
    text = generate_latest(metrics.registry).decode()
    series = [line for line in text.splitlines() if line.startswith("swarmgrad_peer_")]
    assert len(series) <= 2 * 5 * PEER_SERIES_ROUNDS  # clip and cosine of the recent ones
    assert f'swarmgrad_peer_cosine_ema{{peer="sg{rounds - 1}x0"}}' in text
    assert 'swarmgrad_peer_cosine_ema{peer="sg0x0"}' not in text


@pytest.mark.parametrize("scale", [1.0, 1e2, 1e3, 1e4])
def test_cosines_hold_when_one_row_is_far_larger_than_the_others(scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    common = torch.randn(4096, generator=g)
    small, large = common + torch.randn(4096, generator=g), common * scale
    out = aggregate(torch.stack([small, large]), Aggregator.CENTERED_CLIP)
    true = float(torch.nn.functional.cosine_similarity(small.double(), large.double(), dim=0))
    assert out.cosine == pytest.approx([true, true], abs=1e-3)
