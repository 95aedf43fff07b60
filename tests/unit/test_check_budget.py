"""What one storing peer can make a DHT node spend on signature checks (issue 42, finding 4:
throwaway keys re-signing a flood under the coming round keys cost each honest DHT process
~40% of a core). Both backends' storage sides, no DHT nodes here; ``test_store_budget.py``
floods a real hivemind DHT node."""

from __future__ import annotations

import pytest

from swarmgrad.node.discovery import envelope as envelope_module
from swarmgrad.node.discovery.check_budget import CHECKS_BURST, MAX_NAMED_REFUSERS, CheckBudget
from swarmgrad.node.discovery.envelope import Kind, OverBudget, RecordError, open_envelope, peek
from swarmgrad.node.discovery.libp2p_directory import Directory
from swarmgrad.node.discovery.records import validate
from swarmgrad.node.identity import Identity
from tests.unit.test_round_key_budget import NOW, readiness


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def counted_checks(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The signatures checked from here on (each one's public key)."""
    envelope_module._OPENED.clear()
    checked: list[bytes] = []
    real = envelope_module.verify_signature

    def counting(public_key: bytes, signature: bytes, message: bytes) -> bool:
        checked.append(public_key)
        return real(public_key, signature, message)

    monkeypatch.setattr(envelope_module, "verify_signature", counting)
    return checked


def test_a_storer_gets_its_burst_then_its_rate_and_others_are_not_touched() -> None:
    clock = Clock()
    checks = CheckBudget(per_second=10.0, burst=20, clock=clock)
    assert sum(checks.take("flooder") for _ in range(50)) == 20
    assert checks.refused == 30
    assert checks.take("honest")  # a bucket of its own
    clock.now = 1.0  # a second later: ten more
    assert sum(checks.take("flooder") for _ in range(50)) == 10
    clock.now = 100.0  # idle for long: a burst again, never more
    assert sum(checks.take("flooder") for _ in range(50)) == 20


def test_refusals_are_reported_by_storer_within_bounds() -> None:
    checks = CheckBudget(per_second=1.0, burst=1, clock=Clock())
    for storer in ("flooder", "flooder", "flooder", "other", "other"):
        checks.take(storer)
    assert checks.take_refusals() == (2, [("flooder", 2), ("other", 1)])
    assert checks.take_refusals() == (0, [])  # reported once
    for storer in range(MAX_NAMED_REFUSERS + 50):  # keys cost nothing: names are bounded
        checks.take(storer)
        checks.take(storer)
    named, _ = checks.take_refusals()
    assert named == MAX_NAMED_REFUSERS
    assert checks.refused == 3 + MAX_NAMED_REFUSERS + 50  # while every refusal is counted


def test_the_storers_table_is_bounded() -> None:
    checks = CheckBudget(per_second=1.0, burst=1, most_storers=3)
    for storer in range(100):
        checks.take(storer)
    assert len(checks._buckets) == 3
    with pytest.raises(ValueError, match="positive rate"):
        CheckBudget(per_second=0.0)


def test_a_new_value_costs_the_storer_a_check_and_a_value_met_before_costs_nothing(
    counted_checks: list[bytes],
) -> None:
    """Each value new to the node costs one check of the storer's budget, whether it passes or
    not; a value refused by a cheaper check (another key, another slot, a padded readiness
    record) costs no signature check; a value opened before costs nothing at all."""
    me = Identity.generate()
    key, value, expires = readiness(me, issued=NOW)
    asked: list[bool] = []

    def may_check() -> bool:
        asked.append(True)
        return True

    validate(key, me.peer_id, value, expires, NOW, may_check=may_check)
    validate(key, me.peer_id, value, expires, NOW, may_check=may_check)  # remembered
    assert len(asked) == len(counted_checks) == 1
    other = Identity.generate()
    _, padded, padded_expires = readiness(other, issued=NOW, pad=3700)
    _, unseen, unseen_expires = readiness(other, issued=NOW)
    for wrong in (
        lambda: validate(key, me.peer_id, unseen, unseen_expires, NOW, may_check=may_check),
        lambda: validate(key, other.peer_id, padded, padded_expires, NOW, may_check=may_check),
        lambda: validate(key + "0", me.peer_id, value, expires, NOW, may_check=may_check),
    ):
        with pytest.raises(RecordError):
            wrong()
    assert len(asked) == 3  # the two new values; the third was opened before
    assert len(counted_checks) == 1  # none of them reached its signature


def test_past_its_budget_a_value_is_refused_unchecked_and_can_be_stored_later(
    counted_checks: list[bytes],
) -> None:
    me = Identity.generate()
    key, value, expires = readiness(me, issued=NOW)
    with pytest.raises(OverBudget, match="try again later"):
        validate(key, me.peer_id, value, expires, NOW, may_check=lambda: False)
    assert counted_checks == []
    opened = validate(key, me.peer_id, value, expires, NOW, may_check=lambda: True)
    assert opened.signer == me.peer_id


def test_peek_reads_a_forgery_open_refuses_it() -> None:
    me = Identity.generate()
    _, value, _ = readiness(me, issued=NOW)
    forged = value[:-1] + bytes([value[-1] ^ 1])
    assert peek(forged).kind == Kind.READY  # read, not believed
    with pytest.raises(RecordError, match="bad signature"):
        open_envelope(forged)


def test_a_flooding_storer_is_held_to_its_budget_in_the_libp2p_directory(
    counted_checks: list[bytes],
) -> None:
    """One peer storing fresh values from throwaway keys as fast as it can: the directory
    checks its burst and refuses the rest unchecked (OverBudget, which the sidecar counts as a
    refused value); another peer's value and the node's own still go in."""
    directory = Directory()
    directory.checks = CheckBudget(clock=Clock())  # no refill while the test runs
    flood = [readiness(Identity.generate(), issued=NOW) for _ in range(CHECKS_BURST + 100)]
    stored = refused = 0
    for key, value, expires in flood:
        try:
            stored += directory.store(
                key, peek(value).signer, value, expires, NOW, storer=b"flooder"
            )
        except OverBudget:
            refused += 1
    assert stored == CHECKS_BURST
    assert refused == 100
    assert len(counted_checks) == CHECKS_BURST  # the refused ones cost no check
    honest, mine = Identity.generate(), Identity.generate()
    key, value, expires = readiness(honest, issued=NOW + 1)
    assert directory.store(key, honest.peer_id, value, expires, NOW, storer=b"honest")
    key, value, expires = readiness(mine, issued=NOW + 1)
    assert directory.store(key, mine.peer_id, value, expires, NOW)  # its own: no storer


def test_a_hivemind_dht_node_checks_a_record_once_and_its_storer_pays_once(
    counted_checks: list[bytes],
) -> None:
    """Every replica's answer to every read of a round key brings the same records again: the
    validator accepts a record it accepted before without checking it again, and without
    charging its storer; the same value in another slot is still refused."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer as Pack

    from swarmgrad.node.discovery import hivemind_storage

    me, other = Identity.generate(), Identity.generate()
    now = hivemind_storage.get_dht_time()
    key, value, expires = readiness(me, issued=now)
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), Pack.dumps(me.peer_id),
                       Pack.dumps(value), expires)  # fmt: skip
    validator = hivemind_storage.SealedValues()
    validator.checks = CheckBudget(per_second=1.0, burst=1, clock=Clock())
    token = hivemind_storage._STORER.set((b"storer", False))
    try:
        assert all(validator.validate(record) for _ in range(5))
        assert len(counted_checks) == 1
        elsewhere = DHTRecord(record.key, Pack.dumps(other.peer_id), record.value, expires)
        assert not validator.validate(elsewhere)  # checked (its value is known) and refused
        assert validator.checks.refused == 0
        _, fresh, fresh_expires = readiness(other, issued=now)
        new = DHTRecord(record.key, Pack.dumps(other.peer_id), Pack.dumps(fresh), fresh_expires)
        assert not validator.validate(new)  # a new value: the storer's budget is spent
        assert validator.checks.refused == 1
        assert len(counted_checks) == 1
    finally:
        hivemind_storage._STORER.reset(token)


def test_the_dht_log_names_the_peers_it_refused(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("hivemind")
    from hivemind.p2p import PeerID

    from swarmgrad.node.discovery import hivemind_storage

    flooder = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    validator = hivemind_storage.SealedValues()
    validator.checks = CheckBudget(per_second=1.0, burst=1, clock=Clock())
    for _ in range(4):
        validator.checks.take((flooder.to_bytes(), False))
    validator.checks.take((flooder.to_bytes(), True))
    validator.checks.take((flooder.to_bytes(), True))
    with caplog.at_level("INFO", logger=hivemind_storage.__name__):
        validator._log_refusals()
    assert "refused 4 stores past the budget of signature checks of their 2 storers" in caplog.text
    assert f"most: {flooder.to_base58()} 3, {flooder.to_base58()} (cache) 1" in caplog.text


def test_matchmaking_reads_a_crowded_round_key_less_often() -> None:
    from swarmgrad.node.averaging.matchmaking import MAX_POLL_SECONDS, POLL_SECONDS, poll_pause

    assert poll_pause(0) == poll_pause(64) == POLL_SECONDS
    assert poll_pause(96) == pytest.approx(1.5 * POLL_SECONDS)
    assert poll_pause(310) == poll_pause(100_000) == MAX_POLL_SECONDS
