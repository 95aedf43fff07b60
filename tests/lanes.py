"""Two lanes for ``pytest -n 2`` (what ``scripts/test.sh`` and CI run; see the README's
"Development"): the swarm tests one after another on one worker, everything else one after
another on the other.

A swarm test keeps both cores of a two-core machine busy and holds deadlines (matchmaking, a
round, a rejoin) that two swarms at once would miss; the tests in the other lane mostly wait
(namespaced NAT labs, kill -9 restarts, DHT lookups with frozen peers, published runs) or need no
sockets at all, so they fit in the swarm lane's idle share. xdist's own ``loadgroup`` cannot
express this under pytest 9 (it marks a group by rewriting ``item._nodeid``, which pytest no longer
reads), so the lanes are scopes of xdist's ``loadscope`` scheduler, decided by node id here, where
the controller (which collects nothing itself) can see it.

A test module belongs to the swarm lane unless it is listed below: a new test that trains a swarm
is safe by default, and one that only waits costs nothing but time until it is listed.
"""

from __future__ import annotations

from typing import Any

SWARM = "swarm lane"
WAITING = "waiting lane"

#: Test modules of the waiting lane (``tests/unit/`` is in it whole): each one mostly waits (its
#: CPU over wall time well under two cores) and bounds nothing by the time a busy machine takes.
#: Rounds of averagers in the test's own process (open rounds, withholding, colluders) are here
#: too: their messages take milliseconds against timeouts of seconds.
WAITING_MODULES = frozenset(
    {
        "tests/integration/test_ban_records.py",
        "tests/integration/test_bootstrap_identity.py",
        "tests/integration/test_colluders.py",
        "tests/integration/test_delay_proxy.py",
        "tests/integration/test_discovery.py",
        "tests/integration/test_discovery_records.py",
        "tests/integration/test_doctor.py",
        "tests/integration/test_early_slots.py",
        "tests/integration/test_export.py",
        "tests/integration/test_file_data.py",
        "tests/integration/test_libp2p_discovery.py",
        "tests/integration/test_nat.py",
        "tests/integration/test_netem.py",
        "tests/integration/test_open_audits.py",
        "tests/integration/test_open_checks.py",
        "tests/integration/test_open_convictions.py",
        "tests/integration/test_open_rounds.py",
        "tests/integration/test_packaging.py",
        "tests/integration/test_preflight.py",
        "tests/integration/test_published.py",
        "tests/integration/test_punch.py",
        "tests/integration/test_punched_links.py",
        "tests/integration/test_reachability.py",
        "tests/integration/test_readiness.py",
        "tests/integration/test_readme.py",
        "tests/integration/test_readme_paths.py",
        "tests/integration/test_relays.py",
        "tests/integration/test_restarts.py",
        "tests/integration/test_stage_recovery.py",
        "tests/integration/test_stage_service.py",
        "tests/integration/test_state_serving.py",
        "tests/integration/test_state_sync.py",
        "tests/integration/test_ticket_join.py",
        "tests/integration/test_withholding.py",
    }
)

#: Tests of those modules that bound a time (a lookup's, a stream's) and so stay in the swarm
#: lane, where nothing else runs beside them: one that failed there beside the swarm tests.
SWARM_TESTS = (
    # "lookups stay under 5 s with 2 of 8 peers frozen": beside a swarm they found no one.
    "tests/integration/test_discovery.py::test_frozen_peers_do_not_slow_lookups_past_a_bound",
)


#: Tests of swarm-lane modules that train no swarm and bound no time a busy machine takes: one
#: process at a time that fails its start (a bad spec, a port in use, a wrong DHT key), or a lone
#: node stopped by a signal. Each waits for its processes, with deadlines of tens of seconds, so
#: it fits in the waiting lane (~110 s off the swarm lane, the suite's critical path).
WAITING_TESTS = (
    "tests/integration/test_swarm.py::test_the_cli_explains_bad_input",
    "tests/integration/test_swarm.py::test_ctrl_c_leaves_gracefully_and_a_second_exits_at_once",
    "tests/integration/test_discovery_audit.py::test_a_taken_port_fails_the_start_and_a_restart",
    "tests/integration/test_discovery_audit.py::test_a_wrong_dht_secret_is_named_as_a_cause",
)


def lane(nodeid: str) -> str:
    """The lane of the test ``nodeid`` (``tests/.../test_x.py::test_y[param]``)."""
    module = nodeid.split("::", 1)[0]
    if nodeid.startswith(SWARM_TESTS):
        return SWARM
    if nodeid.startswith(WAITING_TESTS):
        return WAITING
    if module.startswith("tests/unit/") or module in WAITING_MODULES:
        return WAITING
    return SWARM


def make_scheduler(config: Any, log: Any) -> Any:
    """xdist's loadscope scheduler with the two lanes as its only scopes: each worker takes one
    lane whole (with one worker, both in turn; with more, the extra ones have nothing to do)."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return LaneScheduling(config, log)
