"""A round in the model, as the node runs it: matchmaking (buckets, the census of whom to wait
for, the groups cut from the visible candidates) and the all-reduce (its bytes over the
members' links and relays, its latencies and codec time, the round deadline)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import simpy

from swarmgrad.node.averaging.cut import settle_time
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.averaging.grouping import bucket_count, bucket_of
from swarmgrad.node.averaging.matchmaking import (
    EXPECTED_REFRESH_SECONDS,
    POLL_SECONDS,
    READY_MARGIN_SECONDS,
)
from swarmgrad.node.averaging.membership import PROBE_AFTER_SECONDS
from swarmgrad.node.averaging.quiet import QUIET_SECONDS
from swarmgrad.node.averaging.rounds import WITHDRAW_MARGIN_SECONDS
from swarmgrad.node.averaging.slots import in_slot, slot_cut, slot_of
from swarmgrad.node.swarm_config import MATCHMAKING_SETTLE_SECONDS
from swarmgrad.simulations.des.board import Board, Exchange, ModelPeer, probe_answer
from swarmgrad.simulations.des.config import Events
from swarmgrad.simulations.des.groups import Candidates
from swarmgrad.simulations.des.state import ModelState
from swarmgrad.simulations.des.traffic import Traffic, round_traffic


class Rounds(ModelState):
    """A peer's round: matchmaking, then its group's exchange."""

    # -- matchmaking ------------------------------------------------------------------------------

    def _bucket_count(self, board: Board) -> int:
        """The node's bucket count for ``board``'s round from the live peer records at its epoch
        - 1 or later, re-read as often as the node reads its census."""
        cached = board.bucket_count
        if cached is None or self.env.now - cached[0] > EXPECTED_REFRESH_SECONDS:
            peers = [
                self.peers[i].peer_id
                for epoch, ids in self.census.items()
                if epoch >= board.round - 1
                for i in ids
            ]
            cached = board.bucket_count = (
                self.env.now,
                bucket_count(board.round, peers, self.group_size),
            )
        return cached[1]

    def _expected(self, board: Board, buckets: int, index: int) -> dict[str, ModelPeer]:
        """The census of ``board``'s round in one bucket (by peer id), re-read as often as the
        node does."""
        read = board.expected.get(buckets)
        if read is None or self.env.now - read[0] > EXPECTED_REFRESH_SECONDS:
            by_bucket: dict[int, dict[str, ModelPeer]] = {}
            for epoch in (board.round - 1, board.round):
                for i in self.census.get(epoch, ()):
                    peer = self.peers[i]
                    bucket = bucket_of(board.round, peer.peer_id, buckets)
                    by_bucket.setdefault(bucket, {})[peer.peer_id] = peer
            read = board.expected[buckets] = (self.env.now, by_bucket)
        return read[1].get(index, {})

    def _awaited(
        self,
        board: Board,
        bucket: tuple[int, int],
        r: int,
        visible: Candidates,
        started: float,
        wake: float,
    ) -> tuple[bool, float]:
        """Whether a peer of round ``r`` whose matchmaking began at ``started`` still awaits
        anyone of its bucket's census (expected at ``r`` or ``r`` - 1, not ``visible``, not
        gone), and when the first of them may change that (or ``wake``, if sooner).

        Every waiter of a bucket reads it again at each arrival, at the same moment and over the
        same census: the pass over the census's unseen peers is made once for all of them (until
        the census, the candidates or any peer's life or record change, or time moves on), and
        each reader only adds what depends on when its own matchmaking began: which of the peers
        that do not run it has asked, and had the answer from (``probe_answer``)."""
        expected, now = self._expected(board, *bucket), self.env.now
        moment = (visible.version, r, now, self.peer_changes)
        cached = visible.awaited
        if cached is None or cached[0] is not expected or cached[1] != moment:
            running, lapses, stopped = False, math.inf, []
            for peer_id in expected.keys() - visible.ids:
                peer = expected[peer_id]
                if peer.record_epoch != r and peer.record_epoch != r - 1:
                    continue
                if peer.alive and not peer.paused:
                    running = True
                    lapses = min(lapses, peer.record_lapses_at)
                else:
                    stopped.append((probe_answer(peer), peer))
            stopped.sort(key=lambda item: -item[0])  # the last to be given up on first
            cached = visible.awaited = (expected, moment, running, lapses, stopped)
        _, _, running, lapses, stopped = cached
        awaiting = running
        if running:
            wake = min(wake, lapses)
        asked = started + PROBE_AFTER_SECONDS
        for answer, peer in stopped:
            gone = asked + answer
            if now >= gone:
                break  # and so are the rest, whose answers come sooner
            awaiting = True
            wake = min(wake, peer.record_lapses_at, gone)
        return awaiting, wake

    def _board(self, round_: int) -> Board:
        board = self.boards.get(round_)
        if board is None:
            board = self.boards[round_] = Board(self.env, round_, self.group_size)
            self.boards.pop(round_ - 3, None)  # nobody reads that far back
        return board

    def _round(self, peer: ModelPeer) -> Events:
        """Matchmaking, then the all-reduce: (outcome, group size, the state it leaves)."""
        env, board, me = self.env, self._board(peer.epoch), peer.peer_id
        board.decided.pop(me, None)  # an earlier attempt's
        slot, cut_at = self._slot(env.now)
        record = self._records = self._records + 1
        earlier = board.records.get(me)
        if earlier is not None:
            board.withdraw(me, earlier[0])
        board.records[me] = (record, slot)
        delay = self.config.dht_seconds + peer.latency_seconds
        env.process(self._after(delay, board.show, me, record))
        # It lapses unless withdrawn sooner (a crashed peer's stays until then).
        lapse = delay + self.matchmaking_timeout + READY_MARGIN_SECONDS
        env.process(self._after(lapse, board.withdraw, me, record))
        if slot is None:  # signed past its slot's grace: in nobody's groups (``slots.py``)
            board.decided[me] = (None, env.now)
            self._settled(board, me)
            board.withdraw(me, record)
            return "no group", 1, None
        started = env.now
        deadline = env.now + self.matchmaking_timeout
        if cut_at is not None:
            # In a slot nobody cuts before its grace has passed, so whom the node waits for
            # until then changes nothing of its last read (but that one that stopped waiting
            # in the last poll before it reads half a poll later): it reads at the cut.
            deadline = env.now
            yield env.timeout(max(0.0, cut_at - env.now))
        while True:
            r = peer.epoch
            buckets = self._bucket_count(board)
            index = bucket_of(r, me, buckets)
            bucket = board.bucket(buckets, index, slot)
            if env.now >= deadline:
                break
            seen = bucket.visible.ids
            wake = deadline
            if len(seen) >= 2 and me in seen:
                # Nothing changes for this peer until one it awaits shows up (bucket.changed),
                # the record of one that stopped announcing lapses, or a dead one fails its
                # liveness probe: no need to poll till then.
                awaiting, wake = self._awaited(
                    board, (buckets, index), r, bucket.visible, started, wake
                )
                if not awaiting:
                    break
            else:
                wake = min(wake, env.now + EXPECTED_REFRESH_SECONDS)
            wake = max(wake, env.now + POLL_SECONDS)
            yield env.any_of([bucket.changed, env.timeout(wake - env.now)])
        # The last read: after the settle time (the node's rule for a store as long as its own
        # record's), and in a slot never before its grace has passed and the records signed in
        # it had the settle time to spread.
        spread = settle_time(delay, MATCHMAKING_SETTLE_SECONDS)
        settle = POLL_SECONDS / 2 + spread
        if cut_at is not None:
            settle = max(settle, cut_at + spread - env.now)
        yield env.timeout(settle)
        group = bucket.visible.group_of(me)
        if group is not None and all(self.by_id[p].relay is not None for p in group):
            group = None  # the node's "no member of the group can be dialed"
        board.decided[me] = (group, env.now)
        self._settled(board, me)
        if group is None:
            board.withdraw(me, record)
            return "no group", 1, None
        early = MATCHMAKING_SETTLE_SECONDS + WITHDRAW_MARGIN_SECONDS
        env.process(self._after(early, board.withdraw, me, record))
        try:
            return (yield from self._average(peer, board, group))
        finally:
            if peer.alive and not peer.paused:
                board.withdraw(me, record)

    def _slot(self, issued_at: float) -> tuple[int | None, float | None]:
        """The slot of a readiness record signed at ``issued_at`` (None: past its grace) and
        when its round's last read may begin at the soonest; without slots, 0 and None."""
        if not self.round_seconds:
            return 0, None
        slot = slot_of(issued_at, self.round_seconds)
        if not in_slot(issued_at, slot, self.round_seconds):
            return None, None
        return slot, slot_cut(slot, self.round_seconds)

    # -- the all-reduce ---------------------------------------------------------------------------

    def _average(self, peer: ModelPeer, board: Board, group: tuple[str, ...]) -> Events:
        exchange = yield from self._exchange(board, group)
        self._fire_armed(peer, "round")
        if peer.index not in exchange.members:
            return "aborted", len(group), None
        peer.exchange = exchange
        exchange.inputs[peer.index] = (peer.state, peer.sending)
        yield exchange.done
        peer.exchange = None
        traffic = exchange.traffic.get(peer.index)
        if traffic is not None:
            peer.bytes_sent += traffic.sent
            peer.bytes_received += traffic.received
        if len(exchange.members) < 2 or exchange.share == 0:
            return "aborted", len(group), None
        if self.config.round_overhead_seconds:
            yield self.env.timeout(self.config.round_overhead_seconds)  # the outer step
        complete = len(exchange.members) == len(group) and not exchange.dead and exchange.share == 1
        # Every member of one exchange ends with the same values; other groups with others.
        state = (peer.epoch, exchange.group, exchange.members, tuple(exchange.dead), exchange.share)
        if state not in self.lineage:
            brought = [v for i, v in exchange.inputs.items() if i not in exchange.dead]
            parents = tuple(dict.fromkeys(base for base, _ in brought))
            self.lineage[state] = (parents, exchange.share * sum(n for _, n in brought))
        return ("averaged" if complete else "partial"), len(group), state

    def _after(self, delay: float, action: Callable[[str, int], None], *args: Any) -> Events:
        yield self.env.timeout(delay)
        action(*args)

    def _exchange(self, board: Board, group: tuple[str, ...]) -> Events:
        """The exchange of ``group``: once every member has decided (or a sender timeout has
        passed), the members that computed this same group average among themselves."""
        exchange = board.exchanges.get(group)
        if exchange is not None:
            return exchange
        if not self._all_decided(board, group):
            waiting = board.waiting.get(group)
            if waiting is None:
                waiting = board.waiting[group] = self.env.event()
                for p in group:
                    board.watchers.setdefault(p, []).append(group)
            yield self.env.any_of(
                [waiting, self.env.timeout(self.allreduce.sender_timeout_seconds)]
            )
        exchange = board.exchanges.get(group)
        if exchange is None:
            agreed = tuple(
                self.by_id[p].index
                for p in group
                if board.decided.get(p, (None, 0.0))[0] == group and self.by_id[p].alive
            )
            exchange = Exchange(group=group, members=agreed, done=self.env.event())
            board.exchanges[group] = exchange
            exchange.process = self.env.process(self._transfer(exchange, board))
        return exchange

    def _all_decided(self, board: Board, group: tuple[str, ...]) -> bool:
        return all(p in board.decided or not self.by_id[p].alive for p in group)

    def _settled(self, board: Board, peer_id: str) -> None:
        """``peer_id`` decided (or died): wake the exchanges that were waiting for it."""
        for group in board.watchers.pop(peer_id, []):
            waiting = board.waiting.get(group)
            if waiting is not None and not waiting.triggered and self._all_decided(board, group):
                waiting.succeed()

    def _transfer(self, exchange: Exchange, board: Board) -> Events:
        """The all-reduce: as long as its bytes need, and never past the round deadline
        (``round_timeout_seconds``), where the chunks that had not arrived are missing."""
        env = self.env
        seconds, chunks = self._transfer_seconds(exchange)
        timeout = self.allreduce.round_timeout_seconds
        deadline = env.now + timeout
        end = min(env.now + seconds, deadline)
        while env.now < end:
            try:
                yield env.timeout(end - env.now)
            except simpy.Interrupt as halted:  # a member died: the others drop it this much later
                end = min(max(end, env.now + float(halted.cause or 0.0)), deadline)
        if seconds > timeout:
            # The parts stream their chunks side by side: by the deadline, about this share of
            # each part's chunks is through (none at all: the round is aborted), and about this
            # share of each member's bytes has moved.
            moved = timeout / seconds
            exchange.share = math.floor(chunks * moved) / chunks
            exchange.traffic = {
                i: Traffic(sent=int(t.sent * moved), received=int(t.received * moved))
                for i, t in exchange.traffic.items()
            }
        exchange.done.succeed()
        # A later attempt at this round that computes the same group is a new exchange.
        del board.exchanges[exchange.group]
        board.waiting.pop(exchange.group, None)

    def _transfer_seconds(self, exchange: Exchange) -> tuple[float, int]:
        """How long the all-reduce needs for its bytes, without a deadline, and the most chunks
        one part is cut into."""
        members = [self.by_id[p] for p in exchange.group]
        if len(exchange.members) < 2:
            return 0.0, 1
        group = Group(
            round=0,
            members=tuple(
                Member(
                    peer_id=m.peer_id,
                    endpoint=m.peer_id,
                    bandwidth=m.profile.bandwidth if m.profile.nat == "direct" else 0.0,
                )
                for m in members
            ),
        )
        position = {m.index: i for i, m in enumerate(members)}
        taking = [position[i] for i in exchange.members]
        by_position = round_traffic(group, self.params, self.allreduce, taking)
        chunks = max(
            -(-(end - start) // self.allreduce.chunk_values)
            for start, end in group.partition(self.params)
        )
        exchange.traffic = {members[i].index: t for i, t in by_position.items()}
        up: Counter[int] = Counter()
        down: Counter[int] = Counter()
        for index, t in exchange.traffic.items():
            up[index] += t.sent
            down[index] += t.received
            relay = self.peers[index].relay
            if relay is not None:  # the relay carries both directions of the relayed peer
                up[relay] += t.received
                down[relay] += t.sent
        transfer = max(
            max(b / self.peers[i].up for i, b in up.items()),
            max(b / self.peers[i].down for i, b in down.items()),
        )
        hops = [
            self.peers[i].latency_seconds * (1 if self.peers[i].relay is None else 2) for i in up
        ]
        latency = 3 * (sorted(hops)[-1] + sorted(hops)[-2]) if len(hops) > 1 else 0.0
        codec = 0.0
        if self.config.codec_values_per_second:  # the slowest CPU share of the group's
            share = min(m.profile.cpu_share for m in members)
            codec = 2 * self.params / (self.config.codec_values_per_second * share)
        absent = [m for m in members if m.index not in exchange.members]
        dissenters = [m for m in absent if m.alive and not m.paused]
        if dissenters:
            # Dissenters (they cut another group) open no stream here, and refuse ours as soon
            # as they run their own group of the round (``registry.py``). The owners they hold
            # up ask them after a quiet while whether they are still in this group's round, and
            # drop them when they say they have left it (``quiet.py``); at the latest, the join
            # timeout. A dead member's connection is refused at once, and each member stops
            # waiting for it then (``allreduce._owner_failed``).
            asked = QUIET_SECONDS + 2 * max(m.latency_seconds for m in dissenters)
            transfer = max(transfer, min(self.allreduce.join_timeout_seconds, asked))
        elif absent:
            transfer = max(transfer, 2 * max(m.latency_seconds for m in absent))
        return transfer + latency + codec, max(chunks, 1)
