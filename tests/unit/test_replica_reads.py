"""Reads of per-peer records from their key's replicas (collabopt.engine.replicas.read_replicas): which nodes are
asked, how their records merge, and a replica that does not answer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.engine import replicas
from collabopt.engine.replicas import READ_REPLICAS, read_replicas

KEYS = ["run_progress", "run_addresses"]


def dictionary(records: dict[bytes, tuple[object, float]]) -> ValueWithExpiration:
    value = DictionaryDHTValue()
    for subkey, (record, expiration) in records.items():
        value.store(subkey, MSGPackSerializer.dumps(record), expiration)
    return ValueWithExpiration(value, max(expiration for _, expiration in records.values()))


class Node:
    """A DHT node among ``others`` (node id -> that node's answers: key -> value, or None: it does not answer),
    all of them the keys' replicas (this one too where ``replica``)."""

    def __init__(self, others: dict[DHTID, dict | None], replica: bool = True):
        self.node_id, self.num_replicas, self.asked = DHTID.generate(), len(others) + replica, []
        self.others = others
        storage = DHTLocalStorage()
        self.protocol = SimpleNamespace(storage=storage, cache=DHTLocalStorage(), call_find=self.call_find,
                                        record_validator=None, serializer=MSGPackSerializer,
                                        routing_table=SimpleNamespace(uid_to_peer_id=dict.fromkeys(others)),
                                        client_mode=False)
        self.nearest = {node_id: f"peer-{node_id}" for node_id in others}
        if replica:
            self.nearest[self.node_id] = "me"

    async def find_nearest_nodes(self, queries, k_nearest, exclude_self):
        return {query: dict(self.nearest) for query in queries}

    async def call_find(self, peer, key_ids):
        node_id = next(node_id for node_id, name in self.nearest.items() if name == peer)
        self.asked.append((node_id, sorted(key_ids)))
        answers = self.others[node_id]
        if answers is None:
            return None
        by_id = {DHTID.generate(source=key): value for key, value in answers.items()}
        return {key_id: (by_id.get(key_id), {}) for key_id in key_ids}


@pytest.fixture(autouse=True)
def no_cached_replicas(monkeypatch):
    monkeypatch.setattr(replicas, "_replicas", {})
    monkeypatch.setattr(replicas, "JOINING", 0.0)  # (nodes that read from their start: test_a_node_that_just_joined...)


def nearest_first(node: Node, key: str) -> list[DHTID]:
    key_id = DHTID.generate(source=key)
    return sorted(node.others, key=key_id.xor_distance)


def test_a_replica_merges_its_own_records_with_those_of_its_nearest_other_replica_asked_once_for_every_key():
    now = get_dht_time()
    remote = {KEYS[0]: dictionary({b"a": ({"n": 1}, now + 50), b"b": ({"n": 2}, now + 60)}),
              KEYS[1]: dictionary({b"a": ({"at": "x"}, now + 60)})}
    node = Node({DHTID.generate(): dict(remote) for _ in range(3)})
    node.protocol.storage.store(DHTID.generate(source=KEYS[0]), MSGPackSerializer.dumps({"n": 3}), now + 55,
                                subkey=b"a")  # newer than the replica's record of a
    node.protocol.storage.store(DHTID.generate(source=KEYS[0]), MSGPackSerializer.dumps({"n": 0}), now + 30,
                                subkey=b"c")  # one the replica lacks
    found = asyncio.run(read_replicas(node, KEYS))

    asked: dict[DHTID, list[DHTID]] = {}  # this node's storage and each key's nearest other replica, one request each
    for key in KEYS:
        asked.setdefault(nearest_first(node, key)[0], []).append(DHTID.generate(source=key))
    assert sorted(node.asked) == sorted((node_id, sorted(key_ids)) for node_id, key_ids in asked.items())
    assert {subkey: item.value for subkey, item in found[KEYS[0]].value.items()} == {
        b"a": {"n": 3}, b"b": {"n": 2}, b"c": {"n": 0}}  # per subkey, the latest record
    assert found[KEYS[0]].expiration_time == now + 60
    assert {subkey: item.value for subkey, item in found[KEYS[1]].value.items()} == {b"a": {"at": "x"}}
    local = node.protocol.storage.get(DHTID.generate(source=KEYS[0])).value
    assert sorted(subkey for subkey, _ in local.items()) == [b"a", b"c"]  # (this node's storage is unchanged)

    replicas._replicas.clear()  # (another node's)
    alone = Node({DHTID.generate(): dict(remote)})  # one other replica: both keys in one request
    asyncio.run(read_replicas(alone, KEYS))
    assert [key_ids for _, key_ids in alone.asked] == [sorted(DHTID.generate(source=key) for key in KEYS)]


def test_a_replica_that_does_not_answer_is_replaced_by_the_next_nearest_and_the_replicas_are_looked_for_again():
    now = get_dht_time()
    answers = {KEYS[0]: dictionary({b"a": ({"n": 1}, now + 50)})}
    ids = [DHTID.generate() for _ in range(3)]
    key_id = DHTID.generate(source=KEYS[0])
    ids.sort(key=key_id.xor_distance)
    node = Node({ids[0]: None, ids[1]: dict(answers), ids[2]: dict(answers)})
    found = asyncio.run(read_replicas(node, KEYS[:1]))

    assert [node_id for node_id, _ in node.asked] == ids[:2]
    assert found[KEYS[0]].value[b"a"].value == {"n": 1}
    assert key_id not in replicas._replicas  # (the next store or read looks for the replicas again)


def test_a_node_that_is_not_a_replica_asks_the_three_nearest_and_finds_nothing_where_they_hold_nothing():
    node = Node({DHTID.generate(): {} for _ in range(4)}, replica=False)
    found = asyncio.run(read_replicas(node, KEYS[:1]))
    assert READ_REPLICAS == 3
    assert sorted(node_id for node_id, _ in node.asked) == sorted(nearest_first(node, KEYS[0])[:3])
    assert found == {KEYS[0]: None}


def test_a_node_that_just_joined_reads_three_replicas_even_where_it_is_one(monkeypatch):
    """Its own storage holds nothing yet, and its nearest other replica may be a newcomer too."""
    monkeypatch.setattr(replicas, "JOINING", 90.0)
    monkeypatch.setattr(replicas, "_first_read", {})
    node = Node({DHTID.generate(): {} for _ in range(4)})
    asyncio.run(read_replicas(node, KEYS[:1]))
    assert sorted(node_id for node_id, _ in node.asked) == sorted(nearest_first(node, KEYS[0])[:READ_REPLICAS])
    replicas._first_read[node.node_id] -= 90.0  # (90 s later)
    node.asked.clear()
    asyncio.run(read_replicas(node, KEYS[:1]))
    assert [node_id for node_id, _ in node.asked] == nearest_first(node, KEYS[0])[:1]
