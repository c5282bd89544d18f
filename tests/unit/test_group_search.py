"""How a round's matchmaking finds the others (collabopt/engine/group_search.py): DHT stores and lookups within
bounded waits, and the declarations of peers met before, asked directly, as hivemind's GroupKeyManager reads them."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from collabopt.engine import group_search
from collabopt.engine.group_search import PeerHints, SearchDHT, declared_expiration

ALICE, BOB, CAROL = (PeerID.from_base58(text) for text in (
    "QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4", "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51",
    "QmRTdBeGgZG2xdBqHdDs5sBHQnKpc5Rm7cKXgbKXYTyJwN"))
KEY = "run_grad_averager.0b"


@pytest.fixture(autouse=True)
def short_waits(monkeypatch):
    monkeypatch.setattr(group_search, "STORE_WAIT", 0.05)
    monkeypatch.setattr(group_search, "LOOKUP_WAIT", 0.05)
    monkeypatch.setattr(group_search, "PACE", 0.0)
    monkeypatch.setattr(group_search, "ASK_EVERY", 0.0)


class SilentDHT:
    """A DHT whose stores and lookups wait for a node that does not answer: they end when the test says so."""

    def __init__(self):
        self.peer_id = ALICE
        self.stores, self.lookups = [], []

    def store(self, **kwargs):
        self.stores.append(asyncio.get_running_loop().create_future())
        return self.stores[-1]

    def get(self, key, latest, return_future):
        self.lookups.append(asyncio.get_running_loop().create_future())
        return self.lookups[-1]


def search_dht(dht, hints=(), answers=None):
    peer_hints = PeerHints()
    peer_hints.add(hints)
    search = SearchDHT(dht, None, schema_hash=b"schema", prefix="run_grad_averager", hints=peer_hints,
                       entry=lambda: b"")
    asked = []

    async def ask(peer, key):
        asked.append(peer)
        answer = (answers or {}).get(peer)
        if answer == "silent":
            await asyncio.sleep(3600)
        return answer

    search._ask = ask
    return search, asked


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_a_declaration_whose_store_waits_for_a_silent_node_returns_and_the_store_goes_on():
    async def go():
        dht = SilentDHT()
        search, _ = search_dht(dht)
        declared = await search.store(key=KEY, subkey=ALICE.to_bytes(), value=True, expiration_time=1.0)
        return declared, dht.stores[0].done()

    assert run(go()) == (True, False)


def test_a_peer_met_before_is_found_by_its_own_answer_while_the_dht_lookup_waits():
    async def go():
        expiration = get_dht_time() + 30
        search, _ = search_dht(SilentDHT(), hints=[BOB], answers={BOB: expiration})
        found = await GroupKeyManager(search, "run_grad_averager", "", None).get_averagers(KEY, only_active=True)
        return found, expiration

    found, expiration = run(go())
    assert found == [(BOB, expiration)]


def test_a_slow_lookup_answers_a_later_search_and_is_not_started_twice():
    async def go():
        dht = SilentDHT()
        search, _ = search_dht(dht)
        first = await search.get(KEY, latest=True)
        carol = ValueWithExpiration(True, get_dht_time() + 30)
        dht.lookups[0].set_result(ValueWithExpiration({CAROL.to_bytes(): carol}, carol.expiration_time))
        second = await search.get(KEY, latest=True)
        return first, second, len(dht.lookups), search.hints.peers()

    first, second, lookups, hints = run(go())
    assert first is None and list(second.value) == [CAROL.to_bytes()]
    assert lookups == 1
    assert hints == [CAROL]  # (a peer the DHT returned is asked directly from then on)


def test_a_peer_that_does_not_answer_is_left_alone_for_a_while():
    async def go():
        search, asked = search_dht(SilentDHT(), hints=[BOB, CAROL], answers={BOB: "silent", CAROL: None})
        for _ in range(3):
            await search.get(KEY, latest=True)
        return asked

    asked = run(go())
    assert asked.count(BOB) == 1 and asked.count(CAROL) == 3


def test_a_peer_answers_its_declaration_under_the_key_only_while_it_looks_for_a_group():
    leaders = SimpleNamespace(declared_group_key=KEY, declared_expiration_time=123.0)
    done = SimpleNamespace(done=lambda: False)
    looking = SimpleNamespace(client_mode=False, is_looking_for_group=True, assembled_group=done,
                              potential_leaders=leaders)
    assert declared_expiration(looking, KEY) == 123.0
    assert declared_expiration(looking, KEY + "1") is None
    assert declared_expiration(None, KEY) is None
    assert declared_expiration(SimpleNamespace(**vars(looking) | dict(is_looking_for_group=False)), KEY) is None
    assert declared_expiration(SimpleNamespace(**vars(looking) | dict(client_mode=True)), KEY) is None
    assembled = SimpleNamespace(**vars(looking) | dict(assembled_group=SimpleNamespace(done=lambda: True)))
    assert declared_expiration(assembled, KEY) is None
    undeclared = SimpleNamespace(declared_group_key=KEY, declared_expiration_time=math.inf)
    assert declared_expiration(SimpleNamespace(**vars(looking) | dict(potential_leaders=undeclared)), KEY) is None


def test_hints_keep_the_most_recent_peers():
    hints = PeerHints()
    peers = [PeerID(bytes([i]) * 34) for i in range(group_search.HINTS_KEPT + 2)]
    hints.add(peers)
    hints.add([peers[0]])
    assert hints.peers() == peers[3:] + [peers[0]]
