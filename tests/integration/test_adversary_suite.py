"""The adversary suite's short version (``benchmarks/adversaries.py``, run as a user runs it): an
open run of 5 real node processes, all honest, then with one owner that withholds one member's
account a round (each member in turn) and returns its part's result x(-3), issue 42's critical
attack. The liar is banned by every honest node within three rounds, no honest node is ever
banned, the honest replicas stay identical, and the honest swarm learns as well as the honest
reference."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "adversaries.py"
NODES, ROUNDS = 5, 4
#: How much worse than the honest reference the attacked swarm's loss may end. Groups form as
#: nodes get ready, so the same seed does not give the same averages: two honest runs here ended
#: at 5.990 and 6.000, attacked ones at 6.020 (0.3-0.5% above; once banned, the liar's updates
#: are missing from every later round, and its first round's part is dropped). A lie that got
#: through costs far more: applied for 3 rounds on the code the review tried (38f1593), it took
#: the loss to 9.0 (honest: 6.08), +48%. 3% is ten times the measured cost and a sixteenth of
#: the lie's.
LOSS_SLACK = 1.03


def _run_suite(work: Path) -> dict[str, dict[str, Any]]:
    """The suite's honest and withhold_lie scenarios; their results, by scenario."""
    out = work / "records.json"
    command = [sys.executable, str(SUITE), "--scenarios", "honest_g8", "withhold_lie",
               "--nodes", str(NODES), "--rounds", str(ROUNDS), "--timeout", "400",
               "--work", str(work / "runs"), "--json", str(out)]  # fmt: skip
    # Its own session: a timeout kills the suite and the scenario process it started.
    suite = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        printed = suite.communicate(timeout=1000)[0].decode(errors="replace")
    finally:
        if suite.poll() is None:
            os.killpg(suite.pid, signal.SIGKILL)
            suite.wait()
    assert suite.returncode == 0, printed[-3000:]
    records = json.loads(out.read_text())["records"]
    return {r["scenario"]: r["result"] for r in records}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _run_suite(tmp_path_factory.mktemp("adversaries"))


@pytest.mark.timeout(1100)
def test_the_honest_reference_bans_nobody_and_learns(results: dict[str, dict[str, Any]]) -> None:
    honest = results["honest_g8"]
    assert honest["error"] is None, honest["error"]
    assert honest["bans"] == []
    assert honest["replicas_identical"]
    assert all(epoch >= ROUNDS for epoch in honest["epochs"].values()), honest["epochs"]
    assert honest["final_val_loss"] < honest["initial_val_loss"] - 1.0


@pytest.mark.timeout(1100)
def test_a_rotating_withholder_that_lies_is_banned_by_every_honest_node_and_costs_nothing(
    results: dict[str, dict[str, Any]],
) -> None:
    attacked, honest = results["withhold_lie"], results["honest_g8"]
    assert attacked["error"] is None, attacked["error"]
    (liar,) = attacked["attackers"]
    assert attacked["honest_banned"] == [], attacked["bans"]
    banned = attacked["attackers_banned"][str(liar)]
    assert {by for _, by in banned} == set(attacked["honest"]), attacked["bans"]
    assert max(round_ for round_, _ in banned) <= 2, attacked["bans"]
    assert attacked["replicas_identical"]
    assert all(attacked["epochs"][str(i)] >= ROUNDS for i in attacked["honest"])
    loss, reference = attacked["final_val_loss"], honest["final_val_loss"]
    assert math.isfinite(loss)
    assert loss <= reference * LOSS_SLACK, (loss, reference)
