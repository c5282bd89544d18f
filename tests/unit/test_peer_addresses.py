"""The swarm's address book (collabopt/engine/peer_addresses.py): a DHT publishes where its peer is reachable and
connects to the peers the others published that it is not connected to."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

from collabopt.engine import peer_addresses
from collabopt.engine.peer_addresses import ADDRESSES_KEY, addresses_in, keep_peers_connected

ALICE, BOB, CAROL = (PeerID.from_base58(text) for text in (
    "QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4", "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51",
    "QmRTdBeGgZG2xdBqHdDs5sBHQnKpc5Rm7cKXgbKXYTyJwN"))


def record(peers):
    return ValueWithExpiration({peer: ValueWithExpiration(maddrs, 1e12) for peer, maddrs in peers.items()}, 1e12)


def at(peer, address):
    return f"{address}/p2p/{peer}"


def test_the_addresses_of_others_are_read_and_malformed_entries_left_out():
    found = record({ALICE.to_bytes(): [at(ALICE, "/ip4/192.0.2.10/tcp/1")],
                    BOB.to_bytes(): [at(BOB, "/ip4/192.0.2.11/tcp/2"), 7, at(BOB, "/ip4/" + "1" * 300),
                                     at(CAROL, "/ip4/192.0.2.14/tcp/5"), "/ip4/192.0.2.15/tcp/6"],
                    b"not a peer id": [at(CAROL, "/ip4/192.0.2.12/tcp/3")],
                    CAROL.to_bytes(): at(CAROL, "/ip4/192.0.2.13/tcp/4")})
    assert addresses_in(found, own=ALICE) == {BOB: [at(BOB, "/ip4/192.0.2.11/tcp/2")]}
    assert addresses_in(None, own=ALICE) == {} and addresses_in(ValueWithExpiration(b"x", 1.0), own=ALICE) == {}


class Node:
    """A DHT node of peer ALICE, connected to ``connected``, whose DHT holds ``published``."""

    def __init__(self, published, connected):
        self.peer_id, self.published, self.stored = ALICE, published, []
        self.p2p = SimpleNamespace(get_visible_maddrs=self.visible, list_peers=self.list_peers)
        self.connected = connected

    async def visible(self, latest=False):
        return [at(ALICE, "/ip4/192.0.2.10/tcp/1")]

    async def list_peers(self):
        return [SimpleNamespace(peer_id=peer) for peer in self.connected]

    async def store(self, key, value, expiration_time, subkey=None):
        self.stored.append((key, subkey, value))
        return True

    async def get(self, key, latest=False):
        return self.published


@pytest.mark.parametrize("publish", [True, False])
def test_a_peer_publishes_its_addresses_and_connects_to_the_published_peers_it_misses(monkeypatch, publish):
    monkeypatch.setattr(peer_addresses, "FIRST_LOOKS", ())  # (one look in the test's 0.1 s)
    monkeypatch.setattr(peer_addresses, "LOOK_EVERY", 60.0)
    node = Node(record({BOB.to_bytes(): [at(BOB, "/ip4/192.0.2.11/tcp/2")],
                        CAROL.to_bytes(): [at(CAROL, "/ip4/192.0.2.12/tcp/3")]}), connected=[CAROL])
    dialed = []

    async def connect(p2p, peer, maddrs):
        dialed.append((peer, maddrs))

    async def go():
        task = asyncio.ensure_future(keep_peers_connected(publish, connect, None, node))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.wait({task})
        return task

    task = asyncio.run(go())
    assert not task.cancelled() and task.exception() is None  # (it ends quietly with the DHT)
    assert dialed == [(BOB, [at(BOB, "/ip4/192.0.2.11/tcp/2")])]  # (CAROL is connected already)
    expected = [(ADDRESSES_KEY, ALICE.to_bytes(), [at(ALICE, "/ip4/192.0.2.10/tcp/1")])] if publish else []
    assert node.stored == expected  # (a client publishes nothing: others cannot reach it)
