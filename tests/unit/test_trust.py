"""Robust aggregation and the trust ledger, without sockets: CenteredClip's fixed point, what
screening leaves out, how flags become bans, and the [trust] section of the run spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.envelope import Envelope, Kind, open_envelope, seal
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.node.status import scores_table
from swarmgrad.node.trust.aggregate import (
    Aggregator,
    Screen,
    aggregate,
    centered_clip,
    coordinate_median,
)
from swarmgrad.node.trust.allowlist import Allowlist, AllowlistError, AllowlistWatcher
from swarmgrad.node.trust.board import MAX_RECORDS, BanBoard
from swarmgrad.node.trust.ledger import Flag, TrustLedger, TrustPolicy
from swarmgrad.node.trust.observations import (
    MIN_JUDGED_MEMBERS,
    Observation,
    observe_chunk,
    sketch,
)
from swarmgrad.protocol.v1 import averaging_pb2


def honest(n: int, d: int = 4096, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g) + torch.randn(n, d, generator=g)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_coordinate_median_matches_sorting(n: int) -> None:
    x = honest(n, d=1000, seed=n)
    ordered = torch.msort(x)
    expected = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    assert torch.allclose(coordinate_median(x), expected)


@pytest.mark.parametrize("n", [4, 5, 8])
def test_centered_clip_reaches_its_self_consistent_fixed_point(n: int) -> None:
    x = honest(n)
    x[-1] *= -30  # one far outlier, so some clipping happens
    weights = torch.full((n,), 1.0 / n, dtype=torch.float64)
    value, clip, tau, iterations = centered_clip(x, weights)
    distance = (x.double() - value.double()).norm(dim=1)
    assert tau == pytest.approx(float(distance.median()) if n % 2 else
                                float(distance.sort().values[n // 2 - 1 : n // 2 + 1].mean()),
                                rel=1e-4)  # fmt: skip
    c = torch.clamp(tau / distance, max=1.0)
    assert clip == pytest.approx(c.tolist(), rel=1e-4)
    # sum_i c_i (x_i - v) = 0: the estimate no longer moves.
    residual = (c[:, None] * (x.double() - value.double())).sum(0).norm()
    assert float(residual) < 1e-4 * float(value.norm()) * n
    assert 0 < iterations < 1000
    assert clip[-1] < 0.1  # the outlier is pulled in hard


def test_centered_clip_is_the_mean_for_alike_members_and_bounded_under_attack() -> None:
    x = honest(6)
    mean = x.mean(0)
    calm = aggregate(x, Aggregator.CENTERED_CLIP)
    assert float((calm.value - mean).norm() / mean.norm()) < 0.05
    attacked = torch.cat([x, -100 * x[:1]])
    plain = aggregate(attacked, Aggregator.MEAN).value
    robust = aggregate(attacked, Aggregator.CENTERED_CLIP).value
    assert float((plain - mean).norm() / mean.norm()) > 5  # the mean goes anywhere
    assert float((robust - mean).norm() / mean.norm()) < 0.6  # CC moves by about tau / n


def test_screening_leaves_out_zeros_and_absurd_scales() -> None:
    x = honest(5)
    x[1] = 0
    x[3] *= 1e4
    out = aggregate(x, Aggregator.CENTERED_CLIP)
    assert out.screened == {1: Screen.ZERO, 3: Screen.SCALE}
    assert out.used == (0, 2, 4)
    assert out.clip[1] == out.clip[3] == 0.0
    # Two members: neither is the odd one out on scale.
    assert aggregate(torch.stack([x[0], x[0] * 1e4]), Aggregator.MEAN).screened == {}


def test_cosine_leaves_the_members_own_pull_out() -> None:
    # A member of pure noise: its cosine to the others is ~0 even though the mean contains it.
    x = honest(4)
    noise = torch.randn(x.shape[1], generator=torch.Generator().manual_seed(9)) * 3
    out = aggregate(torch.cat([x, noise[None]]), Aggregator.MEAN)
    assert abs(out.cosine[4]) < 0.06
    assert min(out.cosine[:4]) > 0.3  # the others still agree (the noise dilutes them)


def test_weights_and_bad_input() -> None:
    x = torch.stack([torch.ones(10), 3 * torch.ones(10)])
    assert torch.allclose(
        aggregate(x, Aggregator.MEAN, weights=[3, 1]).value, torch.full((10,), 1.5)
    )
    with pytest.raises(ValueError, match="weight"):
        aggregate(x, Aggregator.MEAN, weights=[1, 0])
    with pytest.raises(ValueError, match="n x d"):
        aggregate(torch.ones(10), Aggregator.MEAN)


def seen(cosine: float = 0.8, clip: float = 1.0, *flags: Flag) -> Observation:
    observation = Observation(flags=set(flags))
    observation.add_chunk(100, clip, cosine)
    return observation


def test_decisive_flags_ban_at_once_and_others_after_three_rounds_in_a_row() -> None:
    ledger = TrustLedger()
    assert ledger.observe(0, {"z": seen(0.8, 1.0, Flag.ZERO), "ok": seen()})[0].peer_id == "z"
    for round_ in range(1, 3):
        assert ledger.observe(round_, {"flip": seen(-0.5), "ok": seen()}) == []
    (ban,) = ledger.observe(3, {"flip": seen(-0.5), "ok": seen()})
    assert (ban.peer_id, ban.round, ban.flags) == ("flip", 3, (Flag.MISALIGNED,))
    assert ledger.banned("flip")
    assert ledger.banned("z")
    assert not ledger.banned("ok")
    table = ledger.table()
    assert table["ok"]["banned"] is None
    assert table["ok"]["flags"] == {}
    assert table["flip"]["banned"] == {"round": 3, "reason": "misaligned"}


def test_an_attacker_who_alternates_is_banned_by_the_window() -> None:
    ledger = TrustLedger(TrustPolicy(consecutive=3, window=10, window_flags=5))
    bans = []
    for round_ in range(10):
        sly = {"sly": seen(0.9, 0.05 if round_ % 2 else 1.0)}
        bans += ledger.observe(round_, sly | {"ok": seen()})
    assert [(b.peer_id, b.round) for b in bans] == [("sly", 9)]


def test_replays_of_any_earlier_update_at_the_same_place_are_flagged() -> None:
    ledger = TrustLedger()
    old = torch.randn(5000)

    def with_sketch(values: torch.Tensor) -> Observation:
        observation = seen()
        observation.sketches[(0, 5000)] = sketch(values)
        return observation

    ledger.observe(0, {"a": with_sketch(old), "b": with_sketch(torch.randn(5000))})
    ledger.observe(1, {"b": with_sketch(old)})  # b sends a's update of round 0
    assert ledger.scores["b"].flags == {Flag.REPLAY: 1}
    # The same values at another place are not a replay (nothing to compare with there).
    observation = seen()
    observation.sketches[(5000, 5000)] = sketch(old)
    ledger.observe(2, {"c": observation})
    assert "c" not in {p for p, s in ledger.scores.items() if s.flags}


SPEC = '[run]\nid = "t"\n'


def test_trust_section_defaults_keep_the_hash_and_open_runs_refuse_what_they_cannot_check() -> None:
    plain = RunSpec.from_toml(SPEC)
    assert RunSpec.from_toml(SPEC + '[trust]\nmode = "trusted"\n').hash == plain.hash
    opened = RunSpec.from_toml(SPEC + '[trust]\nmode = "open"\n')
    assert opened.hash != plain.hash
    assert opened.trust.effective_aggregator == "centered_clip"
    assert plain.trust.effective_aggregator == "mean"
    for bad, match in (
        ('[trust]\nmode = "open"\naggregator = "mean"\n', "malicious"),
        ('[trust]\nmode = "open"\n[averaging]\ncodec = "powersgd"\n', "powersgd"),
        ('[trust]\nmode = "open"\n[averaging]\ncodec = "topk"\n', "topk"),
        ('[trust]\nmode = "anarchy"\n', "trust.mode"),
        ('[trust]\naggregator = "max"\n', "trust.aggregator"),
    ):
        with pytest.raises(RunSpecError, match=match):
            RunSpec.from_toml(SPEC + bad)


def _allowlist_envelope(signer: Identity, version: int, peers: list[str]) -> Envelope:
    body = Allowlist(version=version, peers=frozenset(peers)).body()
    key = f"run/r/{'0' * 64}/allowlist"
    now = dht_time()
    return open_envelope(
        seal(signer, key=key, kind=Kind.ALLOWLIST, body=body, issued_at=now, expires_at=now + 60)
    )


def test_the_allowlist_believes_only_the_run_key_and_only_moves_forward() -> None:
    organizer, mallory = Identity.from_seed("org"), Identity.from_seed("mallory")
    alice, bob = Identity.from_seed("alice").peer_id, Identity.from_seed("bob").peer_id
    watcher = AllowlistWatcher(organizer.peer_id, me=alice)
    assert not watcher.allowed(alice)  # nothing read yet: a private run admits nobody
    assert watcher.take([_allowlist_envelope(mallory, 99, [alice, bob])]) is False
    assert not watcher.allowed(bob)
    assert watcher.take([_allowlist_envelope(organizer, 5, [alice])]) is True
    assert watcher.allowed(alice)
    assert not watcher.allowed(bob)
    # An older version replayed into the DHT changes nothing; a newer one takes over.
    assert watcher.take([_allowlist_envelope(organizer, 4, [alice, bob])]) is False
    assert watcher.take([_allowlist_envelope(organizer, 6, [bob])]) is True
    assert watcher.allowed(bob)
    assert not watcher.allowed(alice)
    with pytest.raises(AllowlistError):
        Allowlist.parse(b'{"version": 1, "peers": ["not-a-peer"]}')
    with pytest.raises(RunSpecError, match="run_key"):
        RunSpec.from_toml(SPEC + '[trust]\nmode = "private"\n')


def test_trust_metrics_show_flags_bans_scores_and_owner_checks() -> None:
    from prometheus_client import generate_latest

    from swarmgrad.node.metrics import NodeMetrics

    ledger = TrustLedger()
    ledger.observe(0, {"sgbad": Observation(flags={Flag.ZERO}), "sggood": Observation()})
    ledger.note(1, {"sgliar": Flag.LYING_OWNER})
    ledger.spot("sggood", 0.25)
    metrics = NodeMetrics(peer_id="sgme", run_id="r", spec_hash="00", algorithm="a", codec="c")
    checks = {"checked": 12, "failed": 1}
    metrics.read_trust(lambda: (ledger.table(), (*ledger.counts(), checks, {"adopted": 2})))
    text = generate_latest(metrics.registry).decode()
    assert 'swarmgrad_trust_flags_total{kind="zero"} 1.0' in text
    assert 'swarmgrad_trust_flags_total{kind="lying_owner"} 1.0' in text
    assert 'swarmgrad_banned_peers{reason="lying_owner"} 1.0' in text
    assert 'swarmgrad_banned_peers{reason="zero"} 1.0' in text
    assert 'swarmgrad_owner_checks_total{result="checked"} 12.0' in text
    assert 'swarmgrad_owner_checks_total{result="failed"} 1.0' in text
    assert 'swarmgrad_peer_cosine_ema{peer="sggood"}' in text
    assert 'swarmgrad_ban_evidence_total{result="adopted"} 2.0' in text
    assert 'swarmgrad_peer_loss_gain_ema{peer="sggood"} 0.25' in text
    assert 'swarmgrad_peer_loss_gain_ema{peer="sgbad"}' not in text  # never spot-checked
    assert 'swarmgrad_ban_evidence_total{result="rejected"} 0.0' in text


def test_bans_outlive_the_ledger_and_a_damaged_file_is_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "run" / "bans.json"
    ledger = TrustLedger(store=store)
    ledger.observe(3, {"sgzero": Observation(flags={Flag.ZERO}), "sggood": Observation()})
    ledger.note(4, {"sgliar": Flag.LYING_OWNER})
    again = TrustLedger(store=store)  # the node restarted
    assert again.banned("sgzero")
    assert again.banned("sgliar")
    assert not again.banned("sggood")
    assert again.bans["sgliar"].round == 4
    assert again.bans["sgliar"].flags == (Flag.LYING_OWNER,)
    store.write_text('{"version": 1, "bans": [{"peer_id": "sgx", "flags": ["not-a-flag"]}]}')
    with caplog.at_level("WARNING"):
        assert TrustLedger(store=store).bans == {}
    assert "ignoring the saved bans" in caplog.text


def test_evidence_stays_with_its_ban_and_adopting_never_overrides_it() -> None:
    ledger = TrustLedger()
    policy = ledger.policy
    for round_ in range(policy.consecutive):  # banned on statistics: nothing to publish
        ledger.observe(round_, {"sgflip": Observation(flags={Flag.MISALIGNED}), "ok": seen()})
    assert ledger.banned("sgflip")
    assert ledger.evidence() == []
    # Evidence read later is kept with the ban it confirms (so it is published from now on) ...
    assert ledger.adopt("sgflip", Flag.EQUIVOCATION, 7, b"proof-1", "sgalice")
    assert ledger.bans["sgflip"].flags == (Flag.MISALIGNED,)
    assert ledger.evidence() == [b"proof-1"]
    # ... and once a ban has evidence, more changes nothing.
    assert not ledger.adopt("sgflip", Flag.EQUIVOCATION, 7, b"proof-2", "sgbob")
    assert ledger.adopt("sgcheat", Flag.FORGERY, 9, b"proof-3", "sgbob")
    assert ledger.adopted == 1
    assert ledger.evidence() == [b"proof-3", b"proof-1"]  # newest ban first
    # A peer banned only on evidence it never sent this node still shows in the table.
    row = ledger.table()["sgcheat"]
    assert row["rounds"] == 0
    assert row["banned"] == {"round": 9, "reason": "forgery", "evidence": True, "source": "sgbob"}
    # The node's own conviction carries its evidence and no source.
    ledger.note(10, {"sgtwo": Flag.EQUIVOCATION}, {"sgtwo": b"proof-4"})
    assert ledger.table()["sgtwo"]["banned"] == {
        "round": 10, "reason": "equivocation", "evidence": True
    }  # fmt: skip
    assert ledger.evidence()[0] == b"proof-4"


def test_the_scores_table_says_where_a_ban_came_from() -> None:
    ledger = TrustLedger()
    ledger.adopt("sgcheat", Flag.FORGERY, 9, b"proof", "sgalice0123456789abcdef")
    ledger.note(10, {"sgtwo": Flag.EQUIVOCATION}, {"sgtwo": b"proof-2"})
    scores = {
        "node": "sgme",
        "epoch": 11,
        "peers": ledger.table(),
        "owner_checks": {"checked": 4, "failed": 1},
        "ban_records": {"adopted": 1},
    }
    console = Console(record=True, width=200)
    console.print(scores_table(scores))
    text = console.export_text()
    assert "1 bans adopted from published evidence" in text
    assert "round 9: forgery (evidence from sgalice012345678" in text
    assert "round 10: equivocation (evidence published)" in text


class _NoRecords:
    """A ban-record channel with nothing in it (``take`` is handed the records instead)."""

    async def publish_bans(self, body: bytes, *, expires_at: float) -> None:
        pass

    async def find_bans(self) -> list[Envelope]:
        return []


def test_the_ban_board_checks_a_bounded_number_of_new_records_each_time() -> None:
    """A flood of records from throwaway keys costs a bounded amount of checking per refresh;
    a record already checked is not checked again."""
    checked: list[bytes] = []

    def verify(data: bytes) -> tuple[str, Flag, int]:
        checked.append(data)
        raise ValueError("proves nothing")

    board = BanBoard(TrustLedger(), me="sgme", verify=verify, channel=_NoRecords())
    item = averaging_pb2.EvidenceList(items=[averaging_pb2.Evidence(reason="equivocation")])
    body = item.SerializeToString()
    flood = [
        Envelope(key="k", kind=Kind.BANS, public_key=bytes([i]) * 32, issued_at=0.0,
                 expires_at=1.0, body=body + bytes([0x12, 1, i]))  # one item, an unknown field
        for i in range(MAX_RECORDS + 36)
    ]  # fmt: skip
    assert board.take(flood) == 0
    assert board.counts["rejected"] == MAX_RECORDS
    board.take(flood)
    assert board.counts["rejected"] == MAX_RECORDS + 36
    board.take(flood)
    assert board.counts["rejected"] == MAX_RECORDS + 36
    assert len(checked) == MAX_RECORDS + 36


def test_a_ban_that_would_leave_a_node_refusing_half_its_peers_is_not_made(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node whose statistics flag most of its peers is the odd one out (an honest member
    among colluders sees the honest as outliers): its flags stay flags. Evidence and decisive
    flags still ban, whatever the count."""
    ledger = TrustLedger()
    peers = [f"p{i}" for i in range(5)]
    for round_ in range(ledger.policy.consecutive):
        ledger.observe(round_, {p: seen(-0.5) for p in peers})  # all five misaligned
    assert sorted(ledger.bans) == ["p0", "p1"]  # the third would make 3 of 5
    assert ledger.reconsidered == 3  # p2, p3, p4, once each round they qualify
    assert caplog.text.count("not banning") == 3  # said once per peer
    ledger.observe(3, {"p3": seen(0.8, 1.0, Flag.ZERO)})
    assert ledger.banned("p3")


@pytest.mark.parametrize("others", [2, 3, 4])
def test_too_few_members_judge_nobody_by_comparison_but_zeros_still_count(others: int) -> None:
    """Two colluders among an honest member's few others make it the outlier: from a chunk of
    fewer than MIN_JUDGED_MEMBERS, nobody is scored by scale, clip or cosine; all zeros and
    duplicates are facts about a member's own values, flagged anywhere."""
    g = torch.Generator().manual_seed(11)
    honest = torch.randn(4096, generator=g)
    colluded = 5.0 * torch.randn(4096, generator=g)
    tiny = colluded * 1e-4  # makes the honest values look 'absurdly' large next to theirs
    for pair in (colluded, tiny):
        rows = [honest, *(pair + 1e-3 * torch.randn(4096, generator=g) for _ in range(others - 1))]
        rows.append(torch.zeros(4096))
        stack = torch.stack(rows)
        observations: dict[str, Observation] = {}
        members = [f"m{i}" for i in range(len(rows))]
        observe_chunk(
            observations, members, stack, aggregate(stack, Aggregator.CENTERED_CLIP), (0, 4096)
        )
        judged = len(rows) >= MIN_JUDGED_MEMBERS
        assert observations["m0"].numel == (4096 if judged else 0)
        assert Flag.SCALE not in observations["m0"].flags or judged
        assert observations[members[-1]].flags == {Flag.ZERO}
