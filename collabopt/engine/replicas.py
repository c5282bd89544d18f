"""Per-peer records (progress, metrics) stored on their key's replicas, with no crawl of the DHT at every call.

Every peer of a run keeps one record under a shared key: the key holds a dictionary of N records. hivemind's store
crawls the DHT for the key's nearest nodes first, and every node it asks answers with the whole dictionary it holds;
its ``get(latest=True)`` asks every node it can reach. So each call downloaded all N records from up to 20 nodes,
and a peer's DHT traffic grew as N². Here a store goes straight to the key's ``num_replicas`` nearest nodes, found by
one crawl per :data:`REPLICAS_TTL`, and a read asks the :data:`READ_REPLICAS` nearest nodes. See docs/decisions.md,
"Records stored on their replicas".
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

REPLICAS_TTL = 300.0  # seconds a key's replicas are reused before a crawl looks for them again
GROWN_TTL = 30.0  # ... once the routing table has grown since they were found (a new node may be nearer the key)
READ_REPLICAS = 3  # a read merges the dictionaries of the key's nearest nodes up to this many (hivemind: 20)

# in the DHT's process: key id -> (time.monotonic() when found, nodes in the routing table then, {node id: peer id}
# of the key's nearest nodes)
_replicas: dict[DHTID, tuple[float, int, dict[Any, Any]]] = {}


class ReplicaRecords:
    """A DHT whose ``store`` and ``get`` keep per-peer records on their key's replicas; everything else is the DHT's.

    Give it where hivemind's code stores and reads records (the progress tracker) and use it for collabopt's own."""

    def __init__(self, dht: Any):
        self.dht = dht

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dht, name)

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None,
              return_future: bool = False) -> Any:
        """Store ``value`` under ``key`` (and ``subkey``) on the key's replicas: True if one of them took it."""
        future = self.dht.run_coroutine(functools.partial(_store_on_replicas, key, subkey, value, expiration_time),
                                        return_future=True)
        return future if return_future else future.result()

    def get(self, key: str, latest: bool = False, return_future: bool = False) -> Any:
        """The key's value merged from its :data:`READ_REPLICAS` nearest nodes (``latest``: ask them all)."""
        return self.dht.get(key, latest=latest, return_future=return_future, beam_size=READ_REPLICAS)


async def _nearest_nodes(node: Any, key_id: DHTID) -> dict[Any, Any]:
    """The key's ``num_replicas`` nearest nodes, as found at most :data:`REPLICAS_TTL` ago (a crawl asks several
    nodes, each answering with its neighbours: in a swarm whose nodes stay the same it finds the same ones), or
    :data:`GROWN_TTL` ago once the routing table has grown; looked for again at once while they are fewer than
    ``num_replicas`` and the table has grown (a peer that started alone stores on the others at once). A replica
    that does not answer is looked for again at the next store (:func:`_store_on_replicas`)."""
    known = len(node.protocol.routing_table.uid_to_peer_id)
    found = _replicas.get(key_id)
    age = time.monotonic() - found[0] if found is not None else float("inf")
    grown = found is not None and known > found[1]
    if age > REPLICAS_TTL or (grown and (age > GROWN_TTL or len(found[2]) < node.num_replicas)):
        nearest = await node.find_nearest_nodes([key_id], k_nearest=node.num_replicas,
                                                exclude_self=node.protocol.client_mode)  # nobody reads a client
        found = _replicas[key_id] = (time.monotonic(), known, dict(nearest[key_id]))
    return found[2]


async def _store_on_replicas(key: str, subkey: Any, value: Any, expiration_time: float, _dht: Any,
                             node: Any) -> bool:
    """Runs in the DHT's process: sign the record as hivemind's store does and send it to the key's nearest nodes.

    A replica that does not answer makes the next store look for the replicas again."""
    key_id = DHTID.generate(source=key)
    protocol = node.protocol
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration_time)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
    stored, calls = False, []
    for node_id, peer_id in (await _nearest_nodes(node, key_id)).items():
        if node_id == node.node_id:
            valid = protocol.record_validator is None or protocol.record_validator.validate(record)
            stored |= bool(valid and protocol.storage.store(key_id, record.value, expiration_time, subkey=subkey))
        else:
            calls.append(protocol.call_store(peer_id, [key_id], [record.value], [expiration_time], subkeys=[subkey]))
    answers = await asyncio.gather(*calls)
    if any(answer is None for answer in answers):
        _replicas.pop(key_id, None)
    return stored or any(answer and answer[0] for answer in answers)
