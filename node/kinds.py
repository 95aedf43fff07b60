"""The node's shared vocabularies, one enum each: how a peer is reached, why something failed,
how a round ended. They are ``StrEnum``\\ s: records, status files and metric labels carry the
values as plain strings, and a value read back compares equal to its member."""

from __future__ import annotations

import enum


class Reach(enum.StrEnum):
    """How a node's gRPC endpoint is reached (its record's ``reachability``)."""

    UNKNOWN = "unknown"  # no verdict yet (or nobody could be asked)
    DIRECT = "direct"  # peers dialed it back
    UPNP = "upnp"  # through a port its router mapped
    RELAYED = "relayed"  # through a relay it keeps a stream open to
    UNREACHABLE = "unreachable"  # nobody can dial it: it owns no part of a round

    @property
    def owner_share(self) -> float:
        """The share of its bandwidth a node reached this way offers as a round's owner: a
        relayed owner makes every member's stream cross the relay twice."""
        return {Reach.RELAYED: 0.1, Reach.UNREACHABLE: 0.0}.get(self, 1.0)


class Presence(enum.StrEnum):
    """What a round's peer, asked whether it is there, turned out to be (``averaging/quiet.py``)."""

    GONE = "gone"  # no answer as itself within the question's deadline
    THERE = "there"  # it answered, and has not left the round (or could not say: an older node)
    LEFT = "left"  # it answered that it has left the round: it sends nothing more in it


class Link(enum.StrEnum):
    """How this node reaches a peer (metrics: ``swarmgrad_links{kind}``): the peer's
    :class:`Reach`, or a link this node punched to it."""

    UNKNOWN = "unknown"
    DIRECT = "direct"
    UPNP = "upnp"
    PUNCHED = "punched"
    RELAYED = "relayed"
    UNREACHABLE = "unreachable"


class Failure(enum.StrEnum):
    """Why a member or a round failed, as counted in ``swarmgrad_failures_total{kind}``."""

    TIMEOUT = "timeout"  # a peer missed a deadline
    PROTOCOL_VIOLATION = "protocol_violation"  # a peer sent something invalid (either way)
    DROPPED_MEMBER = "dropped_member"  # a group member went away mid-round
    ABORTED_ROUND = "aborted_round"  # a round produced nothing
    DISCOVERY = "discovery"  # the DHT did not answer
    STATE_DOWNLOAD = "state_download"  # a state download failed (unreachable or lying donor)
    INTERNAL = "internal"  # an unexpected error in this node's own round code (logged in full)


class RoundOutcome(enum.StrEnum):
    """How a round ended for this node (a trainer's report; metrics use :attr:`label`)."""

    AVERAGED = "averaged"  # with its whole group
    PARTIAL = "partial"  # some values were not averaged, or some members only in part
    NO_GROUP = "no group"  # nobody else was ready in time: train on
    ABORTED = "aborted"  # the group formed but the all-reduce produced nothing
    RESYNCED = "resynced"  # this replica was behind or diverged: it downloaded the swarm's state
    ALONE = "alone"  # sync DP: it held the whole global batch itself and stepped alone

    @property
    def label(self) -> str:
        return self.value.replace(" ", "_")
