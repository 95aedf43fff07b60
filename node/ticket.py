"""A run ticket: the one string a volunteer needs to join a published run.

It carries the run id, the run key's public key (so its fingerprint), the spec's hash, the DHT
backend and the bootstrap multiaddrs, signed by the run key. ``swarmgrad publish`` prints it;
``swarmgrad join TICKET`` checks the signature, reads the run from the DHT through the ticket's
bootstraps (any one of them that answers is enough), and refuses a run whose signed spec is not
the ticket's.

Layout: ``sgrun1.`` + base64url(payload) + ``.`` + base64url(signature), where the payload is
compact JSON and the signature is the run key's Ed25519 signature of a domain tag and the
payload. A ticket is parsed as hostile input: size, encoding, fields and their bounds are
checked before the signature, and nothing in it is trusted before the signature.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmgrad.node.discovery.base import BACKENDS, BackendName
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.errors import SetupError
from swarmgrad.protocol.keys import KEY_BYTES, peer_id_of, verify_signature

__all__ = [
    "MAX_TICKET_CHARS",
    "PREFIX",
    "Ticket",
    "TicketError",
    "looks_like_ticket",
    "read_ticket",
]

PREFIX = "sgrun1."
_DOMAIN = b"swarmgrad run ticket v1\x00"
#: Bounds on what a ticket may hold: a few bootstraps, each a multiaddr of reasonable length.
MAX_TICKET_CHARS = 8192
MAX_BOOTSTRAPS = 16
MAX_MADDR_CHARS = 512
MAX_RUN_ID_CHARS = 128


class TicketError(SetupError):
    """Not a valid run ticket, or not signed by the run key it names; the message says which."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    run_id: str
    run_key: bytes  # the run key's raw Ed25519 public key
    spec_hash: str  # hex sha256 of the spec's canonical form
    bootstrap: tuple[str, ...]
    discovery: BackendName = "hivemind"

    @property
    def run_key_id(self) -> str:
        """The run key's fingerprint (``sg...``), as ``swarmgrad run-key`` prints it."""
        return peer_id_of(self.run_key)

    def encode(self, key: Identity) -> str:
        """This ticket, signed by ``key`` (which must be the run key it names)."""
        if key.public_key != self.run_key:
            raise TicketError("a ticket is signed by the run key it names")
        payload = json.dumps(
            {
                "v": 1,
                "run": self.run_id,
                "key": _b64(self.run_key),
                "spec": self.spec_hash,
                "dht": self.discovery,
                "bootstrap": list(self.bootstrap),
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()
        _validate(payload)  # what the organizer prints, a volunteer can parse
        return f"{PREFIX}{_b64(payload)}.{_b64(key.sign(_DOMAIN + payload))}"

    @classmethod
    def parse(cls, text: str) -> Ticket:
        """The ticket in ``text``; TicketError if it is malformed or its signature is not its
        run key's."""
        text = text.strip()
        if len(text) > MAX_TICKET_CHARS:
            raise TicketError(f"a run ticket has at most {MAX_TICKET_CHARS} characters")
        if not text.startswith(PREFIX) or text.count(".") != 2:
            raise TicketError(f"not a run ticket (one starts with {PREFIX!r})")
        payload_part, signature_part = text[len(PREFIX) :].split(".")
        payload, signature = _unb64(payload_part), _unb64(signature_part)
        ticket = _validate(payload)
        if not verify_signature(ticket.run_key, signature, _DOMAIN + payload):
            raise TicketError(
                f"the ticket's signature is not run key {ticket.run_key_id}'s: it was altered "
                f"(or copied incompletely); ask the organizer for it again"
            )
        return ticket


def looks_like_ticket(text: str) -> bool:
    return text.strip().startswith(PREFIX)


def read_ticket(argument: str) -> Ticket | None:
    """The ticket ``argument`` is (or names a file holding), or None for anything else (a run
    id, a spec file); TicketError for a ticket that is not valid."""
    if looks_like_ticket(argument):
        return Ticket.parse(argument)
    path = Path(argument)
    if path.is_file() and path.stat().st_size <= MAX_TICKET_CHARS:
        text = path.read_text(errors="replace")
        if looks_like_ticket(text):
            return Ticket.parse(text)
    return None


def _validate(payload: bytes) -> Ticket:
    try:
        fields: Any = json.loads(payload)
    except (ValueError, RecursionError):
        raise TicketError("the ticket's contents are not valid JSON") from None
    expected = {"v", "run", "key", "spec", "dht", "bootstrap"}
    if not isinstance(fields, dict) or set(fields) != expected or fields["v"] != 1:
        raise TicketError("the ticket's contents are not a version-1 run ticket")
    run, spec, dht, boot = fields["run"], fields["spec"], fields["dht"], fields["bootstrap"]
    if not isinstance(run, str) or not 0 < len(run) <= MAX_RUN_ID_CHARS:
        raise TicketError("the ticket's run id is missing or too long")
    key = _unb64(fields["key"]) if isinstance(fields["key"], str) else b""
    if len(key) != KEY_BYTES:
        raise TicketError("the ticket's run key is not an Ed25519 public key")
    if not isinstance(spec, str) or len(spec) != 64 or not _is_hex(spec):
        raise TicketError("the ticket's spec hash is not a sha256 in hex")
    backend = next((b for b in BACKENDS if b == dht), None)
    if backend is None:
        raise TicketError(f"the ticket's DHT backend must be one of {', '.join(BACKENDS)}")
    if (
        not isinstance(boot, list)
        or not 0 < len(boot) <= MAX_BOOTSTRAPS
        or not all(_maddr(m) for m in boot)
    ):
        raise TicketError(
            f"the ticket needs 1 to {MAX_BOOTSTRAPS} bootstrap multiaddrs (each /ip4/...)"
        )
    return Ticket(run_id=run, run_key=key, spec_hash=spec, bootstrap=tuple(boot), discovery=backend)


def _maddr(value: object) -> bool:
    return isinstance(value, str) and value.startswith("/") and len(value) <= MAX_MADDR_CHARS


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return text == text.lower()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    if not text or len(text) > MAX_TICKET_CHARS:
        raise TicketError("the ticket is cut short or too long")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise TicketError("the ticket is not base64 where it should be (altered?)") from None
