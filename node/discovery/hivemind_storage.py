"""What a hivemind DHT process keeps and believes for others, and how much checking it does for
each peer that stores in it: its record validator, its bounded storage, and its protocol that
names the storer. Runs in hivemind's DHT process (``hivemind_dht._DHT`` installs the storage
and protocol there); imports hivemind, never libp2p.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import hivemind.dht.protocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmgrad.node.discovery.budget import Budget, BudgetFull, entry_bytes, freshness
from swarmgrad.node.discovery.check_budget import CheckBudget
from swarmgrad.node.discovery.envelope import OverBudget, RecordError, peek
from swarmgrad.node.discovery.records import charge, open_checked

log = logging.getLogger(__name__)

#: Who asked this DHT process to store the values being checked: (the caller's peer id, whether
#: it stores cache copies); None while it checks values that it asked for itself (a get).
_STORER: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar("storer", default=None)
#: How often the process logs the stores it refused for want of checks, at most.
LOG_EVERY_SECONDS = 60.0
#: Records a validator remembers as accepted: at most, and their values' bytes in all.
ACCEPTED_ENTRIES = 16384
ACCEPTED_BYTES = 8 << 20


class SealedValues(RecordValidatorBase):  # type: ignore[misc]
    """What hivemind's DHT nodes keep: only sealed swarmgrad values (``records.validate``),
    under the key their seal names (hivemind gives a validator the key's hash; the seal's key
    must hash to it). Runs in the DHT's process, on every store another node asks for and every
    value another node returns to a get; a node that refuses a value answers ``store_ok=False``.
    """

    def __init__(self) -> None:
        super().__init__()
        #: Signature checks per storing peer (``check_budget.py``).
        self.checks = CheckBudget()
        self._logged_at, self._logged_refused = 0.0, 0
        #: Records accepted lately, whole (key, subkey, value, expiry): the same record again
        #: (every replica's answer to every read of a round key) is valid until it expires.
        self._accepted: OrderedDict[tuple[bytes, bytes, bytes, float], None] = OrderedDict()
        self._accepted_bytes = 0

    def validate(self, record: DHTRecord) -> bool:
        whole = (record.key, record.subkey, record.value, record.expiration_time)
        if whole in self._accepted and record.expiration_time > get_dht_time():
            self._accepted.move_to_end(whole)
            return True
        if self._check(record):
            self._remember(whole)
            return True
        return False

    def _remember(self, whole: tuple[bytes, bytes, bytes, float]) -> None:
        self._accepted[whole] = None
        self._accepted_bytes += len(whole[2])
        while len(self._accepted) > ACCEPTED_ENTRIES or self._accepted_bytes > ACCEPTED_BYTES:
            old, _ = self._accepted.popitem(last=False)
            self._accepted_bytes -= len(old[2])

    def _check(self, record: DHTRecord) -> bool:
        try:
            value = MSGPackSerializer.loads(record.value)
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # not msgpack at all: anything a peer sent
            return False
        if not isinstance(subkey, str):  # a plain value (no subkey), or another kind of subkey
            return False
        try:
            charge(value, self.checks.for_storer(_STORER.get()))
        except OverBudget:
            self._log_refusals()  # past its budget: refused before any check
            return False
        try:
            envelope = peek(value)  # for its key, of which hivemind gives only the hash
            if DHTID.generate(source=envelope.key).to_bytes() != record.key:
                return False
            open_checked(envelope.key, subkey, value, record.expiration_time, get_dht_time())
        except RecordError:
            return False
        return True

    def _log_refusals(self) -> None:
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_SECONDS:
            storers, most = self.checks.take_refusals()
            log.info(
                "refused %d stores past the budget of signature checks of their %d storers "
                "(most: %s)",
                self.checks.refused - self._logged_refused, storers,
                ", ".join(f"{_storer_name(storer)} {count}" for storer, count in most),
            )  # fmt: skip
            self._logged_at, self._logged_refused = now, self.checks.refused


def _storer_name(storer: Hashable) -> str:
    """A storer as the log names it: its libp2p peer id (and "cache" for its cache copies)."""
    if isinstance(storer, tuple) and storer and isinstance(storer[0], bytes):
        try:
            name = PeerID(storer[0]).to_base58()
        except Exception:  # not a peer id: name it by its bytes
            name = storer[0].hex()
        return f"{name} (cache)" if storer[1:] == (True,) else name
    return str(storer)


class BoundedStorage(DHTLocalStorage):  # type: ignore[misc]
    """hivemind's storage of a DHT node (what it holds for others, and its cache), within the
    limits both backends share (:mod:`.budget`): per key, and in all. hivemind checks each value
    (:class:`SealedValues`) but not how many it keeps: unbounded, a flood of sealed values from
    throwaway keys under one key filled the node's memory and made every answer for that key
    too large to send. A store over the limits is refused (``store_ok=False``); the signers a
    key already holds keep their slots, but under a round key the stalest readiness records
    give way to a fresher one."""

    def __init__(self, maxsize: int | None = None) -> None:
        super().__init__(maxsize)
        self.budget = Budget()

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        stored = bool(super().store(key, value, expiration_time))
        if stored:  # a plain value (the cache's copy of a whole answer) replaced the entries
            self.budget.drop_key(key)
        return stored

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        now = get_dht_time()
        self.budget.purge(now)
        size = entry_bytes(str(subkey), value)
        rank = _freshness(value, now)
        try:
            gave_way = self.budget.make_room(key, subkey, size, rank=rank)
        except BudgetFull as error:
            log.debug("refused a value under %s: %s", key, error)
            return False
        for old_key, old_subkey in gave_way:  # stale readiness records (budget.py)
            held = super().get(old_key)
            if held is not None and isinstance(held.value, DictionaryDHTValue):
                del held.value[old_subkey]
        stored = bool(super().store_subkey(key, subkey, value, expiration_time))
        if stored:
            self.budget.add(key, subkey, size, expiration_time, rank=rank)
        return stored


def _freshness(value: bytes, now: float) -> float | None:
    """``budget.freshness`` of a stored value (msgpack of a sealed value, checked already)."""
    try:
        return freshness(peek(MSGPackSerializer.loads(value)), now)
    except Exception:  # not a sealed value: the validator refused it, or it is hivemind's own
        return None


class StorerProtocol(hivemind.dht.protocol.DHTProtocol):  # type: ignore[misc]
    """hivemind's DHT protocol, telling its validator who asked for each store: the values one
    peer asks this node to store are checked within that peer's budget (``check_budget.py``),
    its cache copies (``in_cache``) within another, so that relaying others' values never
    takes the room of a peer's own."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names a protocol's handlers after its class: peers call "DHTProtocol.*".
        name: str = hivemind.dht.protocol.DHTProtocol._get_handle_name(namespace, method_name)
        return name

    async def rpc_store(
        self, request: dht_pb2.StoreRequest, context: P2PContext
    ) -> dht_pb2.StoreResponse:
        cached = bool(request.in_cache) and all(request.in_cache)
        token = _STORER.set((context.remote_id.to_bytes(), cached))
        try:
            response: dht_pb2.StoreResponse = await super().rpc_store(request, context)
            return response
        finally:
            _STORER.reset(token)
