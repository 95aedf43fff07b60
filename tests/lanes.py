"""Two lanes for the parallel suite (``pytest -n 2``, as ``scripts/test.sh`` runs it).

A swarm test keeps both cores busy training its nodes; two of them side by side miss their
rounds' deadlines. Most of the other tests mostly wait (a NAT lab's routers, a kill -9 and a
restart, a DHT lookup) or end in well under a second. So the swarm tests form one unit of work,
run one after another on one worker, and every other test module is a unit of its own that
either worker takes when it has room: the other worker from the start, the swarm worker once its
lane is done.

Tests that assert an upper bound on how long something took stay in the swarm lane too: beside
them then runs only what mostly waits.

xdist's own ``--dist loadgroup`` would say this with marks, but it names a test's group by
rewriting its node id, which pytest 9.2 no longer reads (``Node._id``): every group fell apart
into single tests, and two swarms met. The scheduler here reads the node ids as they are.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

#: Modules whose tests start swarms of training nodes (or a Ray head), with both cores busy.
SWARM_MODULES = frozenset(
    {
        "test_allreduce.py",
        "test_churn.py",
        "test_des_calibration.py",
        "test_hostile.py",
        "test_observing.py",
        "test_open_swarm.py",
        "test_overlap_swarm.py",
        "test_pipeline.py",
        "test_ray_launcher.py",
        "test_swarm.py",
    }
)
#: Tests of those modules that train nothing much (bad input, a schedule's checks, signals).
#: (Moving tests that train two nodes beside the swarms, to even the lanes, was tried: the swarm
#: tests beside them ran past their timeouts and a status query's DHT join failed.)
NOT_SWARMS = (
    "test_the_cli_explains_bad_input",
    "test_ctrl_c_leaves_gracefully",
    "test_a_schedule_is_checked",
    "test_the_launcher_options_are_checked",
)
#: Tests elsewhere that bound an elapsed time (a relay found again, lookups past frozen peers).
TIMED = (
    "test_natted_peers_find_another_relay",
    "test_frozen_peers_do_not_slow_lookups_past_a_bound",
)
SWARM_LANE = "swarms"


def lane(nodeid: str) -> str:
    """The unit of work a test belongs to: the swarm lane, or its own module."""
    module, _, name = nodeid.partition("::")
    if name.startswith(TIMED):
        return SWARM_LANE
    if module.startswith("tests/integration/") and module.rsplit("/", 1)[-1] in SWARM_MODULES:
        return module if name.startswith(NOT_SWARMS) else SWARM_LANE
    return module


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling, with ``lane`` as the scope: the swarm lane goes to one worker
    whole, and before any other unit (it is the longest: started late, it would end late)."""

    def _split_scope(self, nodeid: str) -> str:
        return lane(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        if SWARM_LANE in self.workqueue:
            self.workqueue.move_to_end(SWARM_LANE, last=False)
        super()._assign_work_unit(node)


def make_scheduler(config: Any, log: Any) -> LaneScheduling:
    return LaneScheduling(config, log)
