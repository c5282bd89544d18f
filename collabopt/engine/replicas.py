"""Per-peer records (progress, addresses, models, metrics) and declarations stored on and read from their key's
replicas, with no crawl of the DHT at every call.

Every peer of a run keeps one record under a shared key: the key holds a dictionary of N records. hivemind's store
crawls the DHT for the key's nearest nodes first, and every node it asks answers with the whole dictionary it holds;
its ``get(latest=True)`` asks every node it can reach. So each call downloaded all N records from up to 20 nodes,
and a peer's DHT traffic grew as N². Here a store goes straight to the key's ``num_replicas`` nearest nodes, found by
one crawl per :data:`REPLICAS_TTL`, and a read asks one of those replicas where this node is one too (its own storage
holds what the others do), else the :data:`READ_REPLICAS` nearest; each node once for all the keys read together
(:func:`read_replicas`). A renewal with time to spare leaves with this node's next store (:func:`_send_waiting`).
See docs/decisions.md, "Records stored on their replicas" and "Renewals leave with the next store".
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import Any

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils.timed_storage import ValueWithExpiration

REPLICAS_TTL = 300.0  # seconds a key's replicas are reused before a crawl looks for them again
GROWN_TTL = 30.0  # ... once the routing table has grown since they were found (a new node may be nearer the key)
READ_REPLICAS = 3  # a node that is not one of a key's replicas reads this many of them (hivemind: a crawl of 20)
RIDE_ALONG = 10.0  # seconds a renewal with time to spare waits to leave with the next store (see _send_waiting)
JOINING = 90.0  # seconds from a node's first read during which it reads like a node that is no replica: see below
_first_read: dict[DHTID, float] = {}  # in the DHT's process: node id -> time.monotonic() of its first read

# in the DHT's process: key id -> (time.monotonic() when found, the routing table's node ids then, {node id: peer id}
# of the key's nearest nodes)
_replicas: dict[DHTID, tuple[float, frozenset, dict[Any, Any]]] = {}


class ReplicaRecords:
    """A DHT whose ``store`` and ``get`` keep per-peer records on their key's replicas; everything else is the DHT's.

    Give it where hivemind's code stores and reads records (the progress tracker) and use it for collabopt's own."""

    def __init__(self, dht: Any):
        self.dht = dht

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dht, name)

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None,
              return_future: bool = False, may_wait: float = 0.0) -> Any:
        """Store ``value`` under ``key`` (and ``subkey``) on the key's replicas: True if one of them took it.
        ``may_wait``: seconds the record may wait to leave with another store (a renewal with time to spare)."""
        future = self.dht.run_coroutine(functools.partial(_store_on_replicas, key, subkey, value, expiration_time,
                                                          may_wait=may_wait), return_future=True)
        return future if return_future else future.result()

    def get(self, key: str, latest: bool = True, return_future: bool = False) -> Any:
        """The key's value as hivemind's ``get`` returns it, merged from the key's replicas (:func:`read_replicas`;
        every read is of the latest records there: ``latest`` is hivemind's surface)."""
        future = self.dht.run_coroutine(functools.partial(_read_one, key), return_future=True)
        return future if return_future else future.result()


async def _nearest_nodes(node: Any, key_id: DHTID) -> dict[Any, Any]:
    """The key's ``num_replicas`` nearest nodes, as found at most :data:`REPLICAS_TTL` ago (a crawl asks several
    nodes, each answering with its neighbours: in a swarm whose nodes stay the same it finds the same ones), or
    :data:`GROWN_TTL` ago once the routing table has grown (holds a node it did not hold then: a table whose nodes
    leave it and come back, as hivemind's does when a request times out, made every key's replicas be looked for
    every 30 s); looked for again at once while they are fewer than ``num_replicas`` and the table has grown (a peer
    that started alone stores on the others at once). A replica that does not answer is looked for again at the next
    store (:func:`_store_on_replicas`).

    The crawl looks for the nodes nearest to the key's id with its last bit flipped: the same nodes in the same
    order (XOR distances change in their last bit only), and no node holds a value under it, while every node asked
    about the key itself answered with its whole dictionary as well (up to 5 kB each, the traffic probe)."""
    known = frozenset(node.protocol.routing_table.uid_to_peer_id)
    found = _replicas.get(key_id)
    age = time.monotonic() - found[0] if found is not None else float("inf")
    grown = found is not None and not known <= found[1]
    if age > REPLICAS_TTL or (grown and (age > GROWN_TTL or len(found[2]) < node.num_replicas)):
        beside = DHTID(int(key_id) ^ 1)
        nearest = await node.find_nearest_nodes([beside], k_nearest=node.num_replicas,
                                                exclude_self=node.protocol.client_mode)  # nobody reads a client
        known = frozenset(node.protocol.routing_table.uid_to_peer_id)  # (with the nodes the crawl found)
        found = _replicas[key_id] = (time.monotonic(), known, dict(nearest[beside]))
    return found[2]


async def _store_on_replicas(key: str, subkey: Any, value: Any, expiration_time: float, _dht: Any, node: Any,
                             may_wait: float = 0.0) -> bool:
    """Runs in the DHT's process: sign the record as hivemind's store does and send it to the key's nearest nodes,
    with every store that waits for a ride (:func:`_send_waiting`); with ``may_wait``, it waits itself for the next
    store at most that many seconds. True if one replica took it."""
    key_id = DHTID.generate(source=key)
    protocol = node.protocol
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration_time)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
    waiting = _Waiting(key_id, subkey, record, await _nearest_nodes(node, key_id),
                       asyncio.get_running_loop().create_future())
    _waiting.setdefault(node.node_id, []).append(waiting)
    if may_wait > 0:
        await asyncio.wait({waiting.stored}, timeout=may_wait)  # (the next store takes it along)
    if not waiting.stored.done():
        await _send_waiting(node)
    return await waiting.stored


@dataclasses.dataclass
class _Waiting:
    """A signed record on its way to its key's replicas (``stored``: whether one took it)."""

    key_id: DHTID
    subkey: Any
    record: DHTRecord
    replicas: dict[Any, Any]
    stored: asyncio.Future


_waiting: dict[DHTID, list[_Waiting]] = {}  # in the DHT's process: per node, the records that wait for its next store


async def _send_waiting(node: Any) -> None:
    """Send every waiting record to its replicas: one request per node for all the records it is a replica of.

    A peer's records are renewed on timers of their own (progress, addresses, model, metrics), and each store was a
    request to every replica, each with ~600 bytes of libp2p framing: renewals that may wait (:data:`RIDE_ALONG`)
    leave with the next store instead. A replica that does not answer makes the next store look for the replicas of
    its records' keys again."""
    protocol, entries = node.protocol, _waiting.pop(node.node_id, [])
    stored = [False] * len(entries)
    to_send: dict[Any, list[int]] = {}
    for i, entry in enumerate(entries):
        for node_id, peer_id in entry.replicas.items():
            if node_id != node.node_id:
                to_send.setdefault(peer_id, []).append(i)
            elif protocol.record_validator is None or protocol.record_validator.validate(entry.record):
                stored[i] |= bool(protocol.storage.store(entry.key_id, entry.record.value,
                                                         entry.record.expiration_time, subkey=entry.subkey))
    peers = list(to_send)
    answers = await asyncio.gather(*(protocol.call_store(
        peer, [entries[i].key_id for i in to_send[peer]], [entries[i].record.value for i in to_send[peer]],
        [entries[i].record.expiration_time for i in to_send[peer]], subkeys=[entries[i].subkey for i in to_send[peer]])
        for peer in peers))
    for peer, answer in zip(peers, answers, strict=True):
        for j, i in enumerate(to_send[peer]):
            if answer is None:
                _replicas.pop(entries[i].key_id, None)
            else:
                stored[i] |= bool(answer[j])
    for entry, took in zip(entries, stored, strict=True):
        if not entry.stored.done():
            entry.stored.set_result(took)


async def _read_one(key: str, _dht: Any, node: Any) -> ValueWithExpiration | None:
    return (await read_replicas(node, [key]))[key]


async def read_replicas(node: Any, keys: list[str]) -> dict[str, ValueWithExpiration | None]:
    """Runs in the DHT's process: each key's value, merged as hivemind's ``get`` merges it (per subkey, the latest
    record), from its replicas (:func:`_nearest_nodes`): where this node is one of them, its own storage and the
    nearest other replica; else, and during its first :data:`JOINING` seconds, the :data:`READ_REPLICAS` nearest.
    One find request per node asked, for all the keys it is asked for.

    Every store goes to all of a key's replicas, so a replica holds what the others hold, and one that is a replica
    in this node's view is one in the view of a storer that knows fewer nodes near the key: its storage meets every
    such store; the nearest other replica meets the stores of those that know more (it is among their nearest unless
    four nodes nearer to the key are new to this one). A node that just joined holds nothing yet (the others store
    on it once they have crawled again, :data:`GROWN_TTL`, and renewed their records), and its nearest other replica
    may be another newcomer (a late joiner started beside a restarted peer saw no record and began at epoch 0): it
    reads 3 replicas for its first :data:`JOINING` seconds.
    hivemind's read (a beam of 3 nodes in a crawl, ~4 requests) had every node it asked answer with every peer's
    signed record: the largest part of a compressed DiLoCo peer's control traffic (the traffic probe, B6). A replica
    that does not answer is replaced by the next nearest and makes the next store or read look for the replicas
    again."""
    protocol = node.protocol
    now = time.monotonic()
    joining = now - _first_read.setdefault(node.node_id, now) < JOINING
    key_ids = {key: DHTID.generate(source=key) for key in keys}
    found: dict[str, list[Any]] = {key: [protocol.storage.get(key_id), protocol.cache.get(key_id)]
                                   for key, key_id in key_ids.items()}
    needed, candidates = {}, {}
    for key, key_id in key_ids.items():
        replicas = await _nearest_nodes(node, key_id)
        needed[key] = 1 if node.node_id in replicas and not joining else READ_REPLICAS
        candidates[key] = [peer_id for node_id, peer_id in sorted(replicas.items(), key=lambda item:
                           key_id.xor_distance(item[0])) if node_id != node.node_id]
    while True:
        asks: dict[Any, list[str]] = {}
        for key in keys:
            for peer in candidates[key][:max(0, needed[key])]:  # (each key's nearest: see the rule above)
                asks.setdefault(peer, []).append(key)
            del candidates[key][:max(0, needed[key])]
        if not asks:
            break
        peers = list(asks)
        answers = await asyncio.gather(*(protocol.call_find(peer, [key_ids[key] for key in asks[peer]])
                                         for peer in peers))
        for peer, answer in zip(peers, answers, strict=True):
            for key in asks[peer]:
                if answer is None:
                    _replicas.pop(key_ids[key], None)
                    continue
                needed[key] -= 1
                found[key].append(answer[key_ids[key]][0])
    return {key: _merged(key_ids[key], found[key], protocol) for key in keys}


def _merged(key_id: DHTID, candidates: list[Any], protocol: Any) -> ValueWithExpiration | None:
    """The candidates' value as hivemind's ``DHT.get`` returns it (``_SearchState``): dictionaries merged subkey by
    subkey (the latest record of each), else the value of the latest expiration; signatures stripped, values
    deserialized. The candidates are not changed (one is this node's own storage)."""
    value, expiration = None, -float("inf")
    for candidate in candidates:
        if candidate is None:
            continue
        if isinstance(candidate.value, DictionaryDHTValue):
            if not isinstance(value, DictionaryDHTValue) and candidate.expiration_time > expiration:
                value = DictionaryDHTValue()  # (a dictionary replaces an older plain value, as in hivemind)
            if isinstance(value, DictionaryDHTValue):
                value.maxsize = max(value.maxsize, candidate.value.maxsize)
                for subkey, entry in candidate.value.items():
                    value.store(subkey, entry.value, entry.expiration_time)
        elif candidate.expiration_time > expiration:
            value = candidate.value
        expiration = max(expiration, candidate.expiration_time)
    if value is None:
        return None

    def loads(subkey: bytes, value_bytes: bytes, item_expiration: float) -> Any:
        if protocol.record_validator is not None:
            record = DHTRecord(key_id.to_bytes(), subkey, value_bytes, item_expiration)
            value_bytes = protocol.record_validator.strip_value(record)
        return protocol.serializer.loads(value_bytes)

    if isinstance(value, DictionaryDHTValue):
        return ValueWithExpiration({subkey: ValueWithExpiration(loads(protocol.serializer.dumps(subkey), item, until),
                                                                until) for subkey, (item, until) in value.items()},
                                   expiration)
    return ValueWithExpiration(loads(DHTProtocol.IS_REGULAR_VALUE, value, expiration), expiration)
