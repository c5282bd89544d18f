"""Stores of per-peer records on their key's replicas (collabopt.engine.replicas._store_on_replicas): a renewal that
may wait leaves with the next store, in one request per replica for all the records it is a replica of."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.utils import MSGPackSerializer, get_dht_time

from collabopt.engine import replicas
from collabopt.engine.replicas import _nearest_nodes, _store_on_replicas


class Node:
    """A DHT node whose keys' replicas are ``replicas`` (key -> names of other nodes, "me" for this one); the nodes in
    ``silent`` do not answer. ``sent`` lists each store request: (node, [(key id, subkey)])."""

    def __init__(self, replicas: dict[str, list[str]], silent: tuple[str, ...] = ()):
        self.node_id, self.num_replicas, self.sent, self.silent = DHTID.generate(), 5, [], silent
        self.ids = {name: DHTID.generate() for names in replicas.values() for name in names if name != "me"}
        self.ids["me"] = self.node_id
        self.by_key = {DHTID.generate(source=key): names for key, names in replicas.items()}
        self.protocol = SimpleNamespace(storage=DHTLocalStorage(), record_validator=None,
                                        serializer=MSGPackSerializer, call_store=self.call_store,
                                        routing_table=SimpleNamespace(uid_to_peer_id={}), client_mode=False)

    async def find_nearest_nodes(self, queries, k_nearest, exclude_self):
        self.crawls = getattr(self, "crawls", 0) + 1
        keys = [DHTID(int(query) ^ 1) for query in queries]  # (the crawl asks beside the key: see below)
        assert all(key in self.by_key for key in keys) and not set(queries) & set(self.by_key)
        return {query: {self.ids[name]: name for name in self.by_key[key]}
                for query, key in zip(queries, keys, strict=True)}

    async def call_store(self, peer, keys, values, expiration_time, subkeys):
        self.sent.append((peer, list(zip(keys, subkeys, strict=True))))
        return None if peer in self.silent else [True] * len(keys)


@pytest.fixture(autouse=True)
def nothing_cached_or_waiting(monkeypatch):
    monkeypatch.setattr(replicas, "_replicas", {})
    monkeypatch.setattr(replicas, "_waiting", {})


def store(node: Node, key: str, subkey: bytes, may_wait: float = 0.0):
    return _store_on_replicas(key, subkey, {"v": 1}, get_dht_time() + 60, None, node, may_wait=may_wait)


def test_a_renewal_that_may_wait_leaves_with_the_next_store_one_request_per_replica():
    node = Node({"run_progress": ["me", "x", "y"], "run_addresses": ["me", "x", "y"]})

    async def go():
        renewal = asyncio.ensure_future(store(node, "run_addresses", b"a", may_wait=5.0))
        await asyncio.sleep(0.05)
        assert node.sent == []  # (it waits)
        return await store(node, "run_progress", b"p"), await renewal

    assert asyncio.run(go()) == (True, True)
    both = sorted([(DHTID.generate(source="run_addresses"), b"a"), (DHTID.generate(source="run_progress"), b"p")])
    assert sorted(peer for peer, _ in node.sent) == ["x", "y"]
    assert all(sorted(records) == both for _, records in node.sent)
    stored = node.protocol.storage.get(DHTID.generate(source="run_addresses"))  # (this node is a replica too)
    assert stored is not None and b"a" in dict(stored.value.items())


def test_a_renewal_leaves_alone_when_no_store_came_within_its_wait_and_records_go_only_to_their_replicas():
    node = Node({"run_models": ["x"], "run_progress": ["y"]})

    async def go():
        renewal = asyncio.ensure_future(store(node, "run_models", b"m", may_wait=0.05))
        assert await renewal
        assert node.sent == [("x", [(DHTID.generate(source="run_models"), b"m")])]
        assert await store(node, "run_progress", b"p")

    asyncio.run(go())
    assert node.sent[1:] == [("y", [(DHTID.generate(source="run_progress"), b"p")])]


def test_the_crawl_for_a_keys_replicas_asks_beside_the_key_so_that_no_node_answers_with_its_records():
    """The nodes nearest to the key's id with its last bit flipped are the key's nearest, in the same order."""
    key_id = DHTID.generate(source="run_progress")
    nodes = [DHTID.generate() for _ in range(50)]
    assert sorted(nodes, key=key_id.xor_distance) == sorted(nodes, key=DHTID(int(key_id) ^ 1).xor_distance)


def test_a_replica_that_does_not_answer_makes_the_next_store_look_for_the_replicas_of_its_keys_again():
    node = Node({"run_progress": ["x", "y"], "run_metrics": ["y"]}, silent=("x",))
    assert asyncio.run(store(node, "run_progress", b"p"))  # (y took it)
    assert DHTID.generate(source="run_progress") not in replicas._replicas
    assert asyncio.run(store(node, "run_metrics", b"m"))
    assert DHTID.generate(source="run_metrics") in replicas._replicas


def test_the_replicas_are_looked_for_again_when_a_new_node_joins_the_routing_table_not_when_one_comes_back(
        monkeypatch):
    monkeypatch.setattr(replicas, "GROWN_TTL", 0.0)
    node = Node({"run_progress": ["me", "x"]})
    table = node.protocol.routing_table.uid_to_peer_id
    table.update({node.ids["x"]: "x", DHTID.generate(): "y"})
    key_id = DHTID.generate(source="run_progress")
    asyncio.run(_nearest_nodes(node, key_id))
    left = table.popitem()  # (hivemind drops a node whose request timed out, and adds it again when it answers)
    asyncio.run(_nearest_nodes(node, key_id))
    table.update([left])
    asyncio.run(_nearest_nodes(node, key_id))
    assert node.crawls == 1
    table[DHTID.generate()] = "z"  # a node this one did not know
    asyncio.run(_nearest_nodes(node, key_id))
    assert node.crawls == 2
