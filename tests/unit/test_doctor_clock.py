"""``doctor``'s clock check: this clock against the run's peers', from the issue times on their
records (re-issued every 15 s), by the median so that a few lying peers move it little."""

from __future__ import annotations

from swarmgrad.node.doctor import ANNOUNCE_SECONDS, Finding, RunRead, clock

NOW = 1_800_000_000.0


def _clock(*ages: float) -> Finding:
    return clock(RunRead(Finding("run", True, ""), issued=tuple(NOW - a for a in ages),
                         read_at=NOW))  # fmt: skip


def test_records_as_old_as_their_reissue_period_agree() -> None:
    found = _clock(0.5, 7.0, ANNOUNCE_SECONDS, 3.0)
    assert found.ok
    assert "agrees with 4 peer(s)' records" in found.detail


def test_records_from_the_future_say_this_clock_is_behind() -> None:
    found = _clock(-95.0, -88.0, -90.0)
    assert not found.ok
    assert "~90 s behind" in found.detail
    assert "60 s" in found.detail
    assert "NTP" in found.fix


def test_records_all_too_old_say_this_clock_is_ahead() -> None:
    found = _clock(125.0, 130.0, 140.0)
    assert not found.ok
    assert f"~{130 - ANNOUNCE_SECONDS:.0f} s or more ahead of" in found.detail


def test_a_few_peers_that_lie_about_their_time_do_not_move_the_verdict() -> None:
    assert _clock(2.0, 5.0, 9.0, -3600.0, 3600.0).ok


def test_with_no_peers_there_is_nothing_to_compare() -> None:
    found = _clock()
    assert found.ok
    assert "no peers" in found.detail
