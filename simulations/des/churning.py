"""The model's churn (``model.py``): peers that start, end their sessions, crash, stop, pause
and resume, by the run's schedule (``simulations/churn.py``: a kill "during" a round or a state
download is armed until the peer enters that phase) and the profiles' random sessions
(``session_seconds``: exponential, then ``offline_seconds`` away). A crash loses what the peer
trained since its last averaged round; its connections reset, so the others drop it from the
round it was in after a round trip. A paused one (frozen, partitioned) goes quiet instead: the
others ask whether it is there once its results are late and drop it when it leaves
``UNANSWERED_PROBES`` questions unanswered (``averaging/quiet.py``), or at the sender
timeout if that is sooner."""

from __future__ import annotations

from swarmgrad.node.averaging.quiet import QUIET_SECONDS, UNANSWERED_PROBES
from swarmgrad.node.reachability.service import LIVENESS_TIMEOUT_SECONDS
from swarmgrad.simulations.churn import ChurnEvent
from swarmgrad.simulations.des.board import ModelPeer
from swarmgrad.simulations.des.config import Events
from swarmgrad.simulations.des.rounds import Rounds


class Churning(Rounds):
    """Sessions and the churn schedule; ``model.SwarmModel`` gives a peer its life."""

    def _life(self, peer: ModelPeer, *, restarted: bool) -> Events:
        raise NotImplementedError

    # -- sessions -------------------------------------------------------------------------------

    def _start(self, peer: ModelPeer) -> None:
        peer.alive, peer.paused, peer.finished = True, False, False
        self.peer_changes += 1
        peer.online_since = self.env.now
        self.live += 1
        self.training.add(peer.index)
        self._announce(peer, peer.epoch)
        peer.sessions += 1
        peer.process = self.env.process(self._life(peer, restarted=peer.sessions > 1))
        if peer.profile.session_seconds is not None:
            session = self.rng.expovariate(1.0 / peer.profile.session_seconds)
            self.env.process(self._session(peer, session, peer.sessions))

    def _session(self, peer: ModelPeer, seconds: float, session: int) -> Events:
        yield self.env.timeout(seconds)
        if peer.alive and peer.sessions == session and not peer.finished:
            self._kill(peer)
            yield self.env.timeout(peer.profile.offline_seconds)
            if not peer.alive:
                self._start(peer)

    # -- churn ----------------------------------------------------------------------------------

    def _kill(self, peer: ModelPeer, *, graceful: bool = False) -> None:
        peer.alive = False
        self.peer_changes += 1
        peer.online_seconds += self.env.now - peer.online_since
        flown = peer.flight.value if peer.flight is not None and peer.flight.triggered else None
        if flown is not None and flown[0] in ("averaged", "partial"):
            peer.unaveraged -= peer.sending  # an overlapped round that averaged, not yet landed
        # What it trained since its last averaged round never reaches the model: its
        # checkpoints hold the state it had then.
        peer.dropped += peer.unaveraged
        peer.unaveraged = 0
        self.live -= 1
        self.training.discard(peer.index)
        if graceful:
            self._unlist(peer)
        else:
            self.env.process(self._lapse(peer))
        self._halt(peer, reset=True)
        for board in self.boards.values():
            self._settled(board, peer.peer_id)

    def _halt(self, peer: ModelPeer, *, reset: bool) -> None:
        """Stop ``peer``'s process; its all-reduce goes on without it. ``reset``: its process is
        gone, and so are its connections (the others' streams fail at once, as a SIGKILLed
        member's did in ``benchmarks/allreduce.py``); else it fell silent (paused, partitioned)
        and they find out by asking it (module docstring)."""
        if peer.process is not None and peer.process.is_alive:
            peer.process.interrupt()
        if peer.flight is not None and peer.flight.is_alive:
            peer.flight.interrupt()
        peer.flight = None
        exchange, peer.exchange = peer.exchange, None
        if exchange is not None and exchange.process is not None and exchange.process.is_alive:
            exchange.dead.append(peer.index)
            exchange.process.interrupt(
                2 * peer.latency_seconds if reset else self._quiet_found_seconds()
            )

    def _quiet_found_seconds(self) -> float:
        """How long the others take to drop a member that fell silent mid-round."""
        asked = QUIET_SECONDS + UNANSWERED_PROBES * LIVENESS_TIMEOUT_SECONDS
        return min(self.allreduce.sender_timeout_seconds, asked)

    def _churn(self) -> Events:
        for event in self.config.events:
            while self.reached < event.at_epoch:
                yield self.epoch_changed
            target = self.peers[event.node]
            if event.during:
                self.armed = event
                while self.armed is not None:
                    yield self.epoch_changed
                continue
            self._fire(event, target)

    def _fire(self, event: ChurnEvent, target: ModelPeer) -> None:
        if event.action == "start":
            self._start(target)
        elif event.action in ("kill", "stop"):
            self._kill(target, graceful=event.action == "stop")
        elif event.action in ("pause", "partition"):
            target.paused = True
            self.peer_changes += 1
            self.env.process(self._lapse(target))
            self._halt(target, reset=False)
        else:  # resume or heal: stale, it catches up by state sync
            target.paused = False
            self.peer_changes += 1
            self._announce(target, target.epoch)
            target.process = self.env.process(self._life(target, restarted=True))
        self.fired.append({"event": event.describe(), "time": self.env.now})
        self._advanced()

    def _fire_armed(self, peer: ModelPeer, phase: str) -> None:
        event = self.armed
        if event is not None and event.node == peer.index and event.during == phase:
            self.armed = None
            self.env.process(self._fire_soon(event, peer))

    def _fire_soon(self, event: ChurnEvent, peer: ModelPeer) -> Events:
        yield self.env.timeout(0)
        self._fire(event, peer)
