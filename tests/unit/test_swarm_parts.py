"""A node's parts (``node/swarm_parts.py``) are built offline, each by its room's constructor,
and the ``Swarm`` holds them as built: nothing is wired in after construction, and nothing that
needs the DHT exists before the node joins."""

from __future__ import annotations

from collections import Counter

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.swarm_config import SwarmConfig
from swarmgrad.node.swarm_parts import build_parts
from swarmgrad.simulations.swarm import DEMO_SPEC

RUN_KEY = "sg" + "a" * 30


def test_a_swarm_holds_the_parts_it_was_built_from_and_nothing_of_the_dht_before_joining() -> None:
    spec = RunSpec.from_toml(DEMO_SPEC + '\n[trust]\nmode = "open"\n')
    identity = Identity.generate()
    parts = build_parts(spec, identity, SwarmConfig())
    stage = {"stage": 2, "span_start": 4, "span_end": 6, "state": "serving", "version": 3}
    swarm = Swarm(spec, identity, SwarmConfig(), parts=parts, describe=lambda: stage)
    assert swarm.transport is parts.transport
    assert swarm.state is parts.state
    assert swarm.membership is parts.membership
    assert swarm.ledger is parts.averager.ledger
    assert parts.allowlist is None  # an open run: anyone may take part
    # Not joined: no DHT, so no directory, reachability or ban board, and no peers to show.
    assert (swarm.directory, swarm.reachability, swarm.board) == (None, None, None)
    assert swarm.peers == []
    assert swarm.visible_maddrs() == []
    assert swarm.ban_counts == Counter()
    # Its record carries what ``describe`` adds (a stage replica's fields), as it is now.
    record = swarm._own_record(dht_time(), 60.0)
    assert (record.stage, record.span_start, record.span_end, record.version) == (2, 4, 6, 3)
    stage["version"] = 4
    assert swarm._own_record(dht_time(), 60.0).version == 4


def test_a_private_runs_parts_admit_nobody_until_its_allowlist_is_read() -> None:
    spec = RunSpec.from_toml(DEMO_SPEC + f'\n[trust]\nmode = "private"\nrun_key = "{RUN_KEY}"\n')
    identity = Identity.generate()
    parts = build_parts(spec, identity, SwarmConfig())
    assert parts.allowlist is not None
    swarm = Swarm(spec, identity, SwarmConfig(), parts=parts)
    stranger = Identity.generate().peer_id
    assert swarm.excludes(stranger)
    assert swarm.excludes(identity.peer_id)  # fails closed: not even itself, before a read
