"""A volunteer joins a published run from its ticket alone, through whichever of the ticket's
bootstraps still answers; an altered ticket, and one for a spec the run no longer has, are
refused before any node starts."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.ticket import PREFIX, Ticket
from swarmgrad.simulations.processes import Child
from tests.helpers import wait_for_pattern, wait_until
from tests.integration.test_published import SPEC, finish, processes, start, swarmgrad

__all__ = ["processes"]  # the fixture, shared with test_published

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _bootstrap(tmp_path: Path, name: str, processes: list[Child], *peers: str) -> str:
    maddrs = tmp_path / f"{name}.json"
    links = [arg for peer in peers for arg in ("--peer", peer)]
    processes.append(
        start("bootstrap", "--maddrs-file", str(maddrs), *links, home=tmp_path / name,
              log=tmp_path / f"{name}.log")
    )  # fmt: skip
    wait_until(maddrs.exists, timeout_seconds=60, what=f"bootstrap {name}")
    return str(json.loads(maddrs.read_text())["maddrs"][0])


def test_a_volunteer_joins_from_the_ticket_alone_with_one_bootstrap_down(
    tmp_path: Path, cache_dir: Path, processes: list[Child]
) -> None:
    first = _bootstrap(tmp_path, "boot-1", processes)
    second = _bootstrap(tmp_path, "boot-2", processes, first)  # one DHT, two ways in
    organizer = tmp_path / "organizer"
    assert finish(swarmgrad("run-key", str(organizer / "run.key"), home=organizer), 60)[0] == 0
    (organizer / "run.toml").write_text(SPEC)
    ticket_file = organizer / "ticket.txt"
    processes.append(
        start("publish", str(organizer / "run.toml"), "--run-key", str(organizer / "run.key"),
              "--bootstrap", first, "--bootstrap", second, "--ticket-file", str(ticket_file),
              home=organizer, log=tmp_path / "publish.log")
    )  # fmt: skip
    wait_for_pattern(tmp_path / "publish.log", "published run", timeout_seconds=90)
    ticket = ticket_file.read_text().strip()
    assert ticket in (tmp_path / "publish.log").read_text()  # what the organizer copies
    assert Ticket.parse(ticket).bootstrap == (first, second)

    # An altered ticket (a bootstrap swapped by someone in between) and one for a spec the run
    # no longer has: exit 2, and no node started.
    payload, signature = ticket[len(PREFIX) :].split(".")
    flipped = payload[:-3] + ("A" if payload[-3] != "A" else "B") + payload[-2:]
    volunteer = tmp_path / "volunteer"
    code, out = finish(swarmgrad("join", f"{PREFIX}{flipped}.{signature}", home=volunteer), 60)
    assert code == 2, out
    assert "altered" in out or "not valid JSON" in out or "not a version-1" in out, out
    key = Identity.load(organizer / "run.key")
    stale = Ticket(run_id="published-demo", run_key=key.public_key, spec_hash="0" * 64,
                   bootstrap=(second,)).encode(key)  # fmt: skip
    code, out = finish(swarmgrad("join", stale, "--timeout", "90", home=volunteer), 150)
    assert code == 2, out
    assert "the organizer changed the run; ask for its new ticket" in out
    assert not (volunteer / "runs" / "known.json").exists()

    # The first bootstrap goes down; the ticket still gets the volunteer in, through the other.
    processes[0].send_signal(signal.SIGINT)
    processes[0].wait(timeout=30)
    (volunteer / "ticket.txt").parent.mkdir(parents=True, exist_ok=True)
    (volunteer / "ticket.txt").write_text(ticket + "\n")  # a file holding it works too
    joined = start("join", str(volunteer / "ticket.txt"), "--timeout", "90",
                   "--cache-dir", str(cache_dir), "--metrics-address", "off",
                   "--display", "log", home=volunteer, log=tmp_path / "join.log")  # fmt: skip
    processes.append(joined)
    wait_for_pattern(tmp_path / "join.log", "joined run published-demo", timeout_seconds=240)

    # The volunteer watches the run from the same ticket: one DHT reader, a JSON line a refresh,
    # and the volunteer among the peers; Ctrl-C ends the watch with exit 0.
    found = re.search(r"peer id (sg\w+)", (tmp_path / "join.log").read_text())
    assert found is not None
    me, watch_log = found.group(1), tmp_path / "watch.log"
    watcher = start("status", ticket, "--watch", "1", "--json", "--timeout", "60",
                    home=volunteer, log=watch_log)  # fmt: skip
    processes.append(watcher)

    def showing_me() -> int:
        if not watch_log.exists():  # the zygote opens it as it forks
            return 0
        lines = watch_log.read_text().split("\n")[:-1]  # whole lines only
        reads = [json.loads(line) for line in lines if line.startswith("{")]
        return sum(me in {peer["peer_id"] for peer in read["peers"]} for read in reads)

    wait_until(lambda: showing_me() >= 2, timeout_seconds=120, what="two reads with the volunteer")
    watcher.send_signal(signal.SIGINT)
    assert watcher.wait(60) == 0, watch_log.read_text()[-3000:]

    # doctor from the ticket, on another volunteer's machine: the run's published spec sized
    # against it, the run's DHT through the bootstrap still up, its clock against the running
    # volunteer's record, and that volunteer asked to dial it back.
    asked = swarmgrad("doctor", "--run", str(volunteer / "ticket.txt"), "--device", "cpu",
                      "--timeout", "90", home=tmp_path / "another")  # fmt: skip
    code, out = finish(asked, 150)
    assert code == 0, out
    checked = {line.split()[1]: line for line in out.splitlines() if line[:4] in ("OK  ", "FAIL")}
    assert {"memory", "disk", "run", "clock", "reach"} <= set(checked), out
    assert "published-demo: the DHT answers, 1 peer(s) listed" in checked["run"]
    assert "agrees with 1 peer(s)' records" in checked["clock"]
    assert "direct: a peer dialed this machine back at 127.0.0.1" in checked["reach"]
    assert "no NAT: peers see this machine's own address and port" in checked["reach"]

    joined.send_signal(signal.SIGINT)  # a volunteer's Ctrl-C: a graceful leave
    code = joined.wait(120)
    assert code == 0, (tmp_path / "join.log").read_text()[-3000:]
    assert (
        RunSpec.load(volunteer / "runs" / "published-demo.toml").hash
        == RunSpec.from_toml(SPEC).hash
    )
    assert json.loads((volunteer / "runs" / "known.json").read_text()) == {
        "published-demo": key.peer_id
    }
