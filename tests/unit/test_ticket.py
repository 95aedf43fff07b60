"""Run tickets: what an organizer signs, a volunteer parses; altered, foreign or malformed
tickets are refused with a reason, before anything in them is used."""

from __future__ import annotations

import base64
import json

import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.node.ticket import MAX_BOOTSTRAPS, PREFIX, Ticket, TicketError

KEY = Identity.from_seed("ticket/organizer")
PEER = "12D3KooWBkRinoh3Gvjj4Fox47vxGJFRMJeG78QqjcrMnKZCDBZa"
BOOT = (f"/ip4/203.0.113.5/tcp/31337/p2p/{PEER}", f"/ip4/198.51.100.7/tcp/31337/p2p/{PEER}")


def _ticket(**changes: object) -> Ticket:
    fields: dict[str, object] = {
        "run_id": "shakespeare",
        "run_key": KEY.public_key,
        "spec_hash": "ab" * 32,
        "bootstrap": BOOT,
        "discovery": "hivemind",
    }
    return Ticket(**(fields | changes))  # type: ignore[arg-type]


def _resigned(payload: dict[str, object], key: Identity = KEY) -> str:
    """A ticket with ``payload`` as its contents, validly signed by ``key``."""
    from swarmgrad.node import ticket

    raw = json.dumps(payload, separators=(",", ":")).encode()
    sig = key.sign(ticket._DOMAIN + raw)
    return f"{PREFIX}{ticket._b64(raw)}.{ticket._b64(sig)}"


def test_a_ticket_round_trips_and_names_its_run_key() -> None:
    text = _ticket().encode(KEY)
    assert text.startswith(PREFIX)
    assert len(text) < 1000  # one copyable line
    parsed = Ticket.parse(f"  {text}\n")
    assert parsed == _ticket()
    assert parsed.run_key_id == KEY.peer_id


def test_only_the_run_key_it_names_can_sign_a_ticket() -> None:
    with pytest.raises(TicketError, match="signed by the run key it names"):
        _ticket().encode(Identity.from_seed("ticket/other"))


def test_an_altered_ticket_is_refused() -> None:
    text = _ticket().encode(KEY)
    payload, signature = text[len(PREFIX) :].split(".")
    raw = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    # A man in the middle swaps in his own bootstrap: the signature no longer holds.
    raw["bootstrap"] = [
        "/ip4/192.0.2.66/tcp/1/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
    ]
    forged = base64.urlsafe_b64encode(json.dumps(raw, separators=(",", ":")).encode()).decode()
    with pytest.raises(TicketError, match="signature is not run key sg"):
        Ticket.parse(f"{PREFIX}{forged.rstrip('=')}.{signature}")
    # ... and a ticket cut short while copying says so.
    with pytest.raises(TicketError):
        Ticket.parse(text[:-10])


def test_a_stranger_signing_with_its_own_key_gets_a_ticket_for_its_own_key_only() -> None:
    # Anyone can sign a ticket; it names the signer's key, whose fingerprint the volunteer
    # sees, and the DHT read then finds no run that key published.
    stranger = Identity.from_seed("ticket/stranger")
    parsed = Ticket.parse(_ticket(run_key=stranger.public_key).encode(stranger))
    assert parsed.run_key_id == stranger.peer_id != KEY.peer_id


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("shakespeare", "not a run ticket"),
        (PREFIX + "a.b", "not base64|not valid JSON|cut short"),
        (PREFIX + "!!!.???", "not base64|not valid JSON"),
        (PREFIX + "x" * 9000 + ".y", "at most 8192 characters"),
        (PREFIX + ".", "cut short"),
        (PREFIX + "abc.", "cut short"),
    ],
)
def test_garbage_is_refused_with_a_reason(text: str, reason: str) -> None:
    with pytest.raises(TicketError, match=reason):
        Ticket.parse(text)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"v": 2}, "version-1"),
        ({"extra": 1}, "version-1"),
        ({"run": ""}, "run id"),
        ({"run": "x" * 200}, "run id"),
        ({"key": "AAAA"}, "Ed25519 public key"),
        ({"spec": "zz" * 32}, "sha256"),
        ({"dht": "kademlia"}, "DHT backend"),
        ({"bootstrap": []}, "1 to 16 bootstrap"),
        ({"bootstrap": ["/ip4/1.2.3.4/tcp/1"] * (MAX_BOOTSTRAPS + 1)}, "1 to 16 bootstrap"),
        ({"bootstrap": [7]}, "1 to 16 bootstrap"),
        ({"bootstrap": ["not-a-multiaddr"]}, "1 to 16 bootstrap"),
    ],
)
def test_a_signed_ticket_with_bad_contents_is_refused(
    change: dict[str, object], reason: str
) -> None:
    from swarmgrad.node import ticket

    payload: dict[str, object] = {
        "v": 1, "run": "r", "key": ticket._b64(KEY.public_key), "spec": "ab" * 32,
        "dht": "hivemind", "bootstrap": list(BOOT),
    }  # fmt: skip
    with pytest.raises(TicketError, match=reason):
        Ticket.parse(_resigned(payload | change))
