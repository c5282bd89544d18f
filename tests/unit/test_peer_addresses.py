"""The run's address book (collabopt/engine/peer_addresses.py): a training peer publishes where it is reachable
under its run's key and signed subkey, and connects to a few of the run's peers it misses; records that would wipe
or take over the book, or make peers dial addresses of someone's choosing, are refused or left out."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from collabopt.engine import peer_addresses
from collabopt.engine.peer_addresses import (
    AddressesSchema,
    AddressRecordValidator,
    addresses_key,
    keep_peers_connected,
    look_period,
    peers_to_dial,
    published_peers,
)
from collabopt.engine.record_signing import Ed25519SignatureValidator
from collabopt.engine.replicas import RIDE_ALONG

ALICE, BOB, CAROL, DAVE = (PeerID.from_base58(text) for text in (
    "QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4", "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51",
    "QmRTdBeGgZG2xdBqHdDs5sBHQnKpc5Rm7cKXgbKXYTyJwN", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"))
RUN = "addr_run"


def at(peer, address):
    return f"{address}/p2p/{peer}"


def owner(name):
    return f"[ed25519:{name}]".encode()


def book(records):
    """A value read under a dictionary key: owner -> record."""
    return ValueWithExpiration({key: ValueWithExpiration(value, 1e12) for key, value in records.items()}, 1e12)


def progress(**peers):
    return book({owner(name): {"peer_id": peer.to_bytes(), "epoch": 0} for name, peer in peers.items()})


# ---- which published peers a peer dials


def test_a_record_counts_only_where_its_owner_trains_in_the_run_under_the_same_peer_id():
    found = book({owner("bob"): dict(peer_id=BOB.to_bytes(), maddrs=[at(BOB, "/ip4/192.0.2.11/tcp/2")]),
                  owner("mallory"): dict(peer_id=CAROL.to_bytes(), maddrs=[at(CAROL, "/ip4/203.0.113.9/tcp/22")]),
                  owner("eve"): dict(peer_id=DAVE.to_bytes(), maddrs=[at(DAVE, "/ip4/203.0.113.8/tcp/23")])})
    # mallory's progress record names another peer id than its address record; eve has no progress record
    dialed = peers_to_dial(published_peers(found, progress(bob=BOB, mallory=ALICE), ALICE), connected=set())
    assert dialed == {BOB: [at(BOB, "/ip4/192.0.2.11/tcp/2")]}


def test_only_the_peers_own_addresses_count_and_at_most_a_few():
    maddrs = [at(BOB, f"/ip4/192.0.2.{i}/tcp/2") for i in range(12)]
    found = book({owner("bob"): dict(peer_id=BOB.to_bytes(), maddrs=[at(CAROL, "/ip4/203.0.113.9/tcp/22"), 7,
                                                                       "/ip4/203.0.113.9/tcp/23", *maddrs])})
    dialed = peers_to_dial(published_peers(found, progress(bob=BOB), ALICE), connected=set())
    assert dialed == {BOB: maddrs[:peer_addresses.MAX_MADDRS - 3]}  # (the first MAX_MADDRS entries are read)


def test_neither_this_peer_nor_a_connected_one_is_dialed_and_at_most_a_few_per_look():
    names = {f"p{i}": PeerID(bytes([0x12, 0x20]) + bytes([i]) * 32) for i in range(10)}
    names.update(alice=ALICE, carol=CAROL)
    found = book({owner(name): dict(peer_id=peer.to_bytes(), maddrs=[at(peer, "/ip4/192.0.2.1/tcp/1")])
                  for name, peer in names.items()})
    dialed = peers_to_dial(published_peers(found, progress(**names), ALICE), connected={CAROL})
    assert len(dialed) == peer_addresses.DIALS_PER_LOOK
    assert ALICE not in dialed and CAROL not in dialed
    everyone = peers_to_dial(published_peers(found, progress(**names), ALICE), connected={CAROL}, limit=100)
    assert set(everyone) == set(names.values()) - {ALICE, CAROL}


def test_malformed_values_give_nobody_to_dial():
    for found in (None, ValueWithExpiration(b"x", 1e12), book({owner("bob"): b"x"}),
                  book({owner("bob"): dict(peer_id=b"not a peer id", maddrs=["/p2p/x"])})):
        assert peers_to_dial(published_peers(found, progress(bob=BOB), ALICE), connected=set()) == {}


def test_lookups_are_spaced_out_as_the_swarm_grows():
    assert look_period(3) == peer_addresses.LOOK_EVERY
    assert look_period(4 * peer_addresses.PEERS_PER_LOOK) == 4 * peer_addresses.LOOK_EVERY
    assert look_period(10**6) == peer_addresses.LONGEST_LOOK


# ---- what the DHT of a peer accepts under the key


@pytest.fixture(scope="module")
def keys():
    return os.urandom(32), os.urandom(32)


def validators(key):
    return CompositeValidator([SchemaValidator(AddressesSchema, prefix=RUN), AddressRecordValidator([RUN]),
                               Ed25519SignatureValidator(key)])


def signed(key, value, expiration=None, subkey_of=None, run=RUN):
    """A record under the run's key, signed by ``key``, under the subkey of ``subkey_of`` (default: ``key``)."""
    subkey = Ed25519SignatureValidator(subkey_of or key).local_public_key
    record = DHTRecord(DHTID.generate(source=addresses_key(run)).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), get_dht_time() + 45 if expiration is None else expiration)
    return DHTRecord(record.key, record.subkey, validators(key).sign_value(record), record.expiration_time)


def test_a_peers_signed_record_is_accepted(keys):
    alice, _ = keys
    record = signed(alice, dict(peer_id=ALICE.to_bytes(), maddrs=[at(ALICE, "/ip4/192.0.2.10/tcp/1")]))
    assert validators(alice).validate(record)


def test_a_plain_value_that_would_replace_the_book_is_refused(keys):
    alice, _ = keys
    key_id = DHTID.generate(source=addresses_key(RUN)).to_bytes()
    for value in (b"x", {Ed25519SignatureValidator(alice).local_public_key: dict(peer_id=ALICE.to_bytes(),
                                                                                maddrs=["/ip4/1.2.3.4/tcp/1"])}):
        record = DHTRecord(key_id, DHTProtocol.IS_REGULAR_VALUE, MSGPackSerializer.dumps(value), get_dht_time() + 1e9)
        assert not validators(alice).validate(record)
        assert not AddressRecordValidator([RUN]).validate(dataclass_replace(record, expiration_time=get_dht_time()))


def dataclass_replace(record, **changes):
    return DHTRecord(**{**record.__dict__, **changes})


def test_a_record_that_outlives_its_owners_renewals_is_refused(keys):
    alice, _ = keys
    value = dict(peer_id=ALICE.to_bytes(), maddrs=[at(ALICE, "/ip4/192.0.2.10/tcp/1")])
    assert validators(alice).validate(signed(alice, value, get_dht_time() + peer_addresses.LONGEST_RECORD - 5))
    assert not validators(alice).validate(signed(alice, value, get_dht_time() + 1e9))


def test_nobody_writes_under_another_peers_subkey(keys):
    alice, mallory = keys
    value = dict(peer_id=ALICE.to_bytes(), maddrs=[at(ALICE, "/ip4/203.0.113.9/tcp/22")])
    assert not validators(mallory).validate(signed(mallory, value, subkey_of=alice))


def test_an_unsigned_subkey_is_refused(keys):
    alice, _ = keys
    record = signed(alice, dict(peer_id=ALICE.to_bytes(), maddrs=[at(ALICE, "/ip4/192.0.2.10/tcp/1")]))
    unsigned = dataclass_replace(record, subkey=MSGPackSerializer.dumps(ALICE.to_bytes()))
    assert not AddressRecordValidator([RUN]).validate(unsigned)
    assert not validators(alice).validate(unsigned)


@pytest.mark.parametrize("value", [
    dict(peer_id=ALICE.to_bytes(), maddrs=[f"/ip4/192.0.2.{i}/tcp/1" for i in range(9)]),
    dict(peer_id=ALICE.to_bytes(), maddrs=["/ip4/192.0.2.1/tcp/" + "1" * 300]),
    dict(peer_id=ALICE.to_bytes(), maddrs=[]),
    dict(peer_id=b"x" * 100, maddrs=["/ip4/192.0.2.1/tcp/1"]),
    dict(peer_id=ALICE.to_base58(), maddrs=["/ip4/192.0.2.1/tcp/1"]),
    dict(peer_id=ALICE.to_bytes(), maddrs=["/ip4/192.0.2.1/tcp/1"], padding="x" * 10_000),
    b"x",
])
def test_a_record_of_another_shape_or_size_is_refused(keys, value):
    alice, _ = keys
    assert not validators(alice).validate(signed(alice, value))


def test_the_book_of_another_run_is_not_this_runs(keys):
    alice, _ = keys
    record = signed(alice, b"x", get_dht_time() + 1e9, run="another_run")
    assert AddressRecordValidator([RUN]).validate(record)  # (its own run's validators judge it)
    assert addresses_key(RUN) != addresses_key("another_run")


# ---- the book's loop


class Node:
    """A DHT node of peer ALICE, connected to ``connected``, whose DHT holds ``published`` and ``training``."""

    def __init__(self, published, training, connected):
        self.peer_id, self.published, self.training = ALICE, published, training
        self.p2p = SimpleNamespace(get_visible_maddrs=self.visible, list_peers=self.list_peers)
        self.connected, self.read = connected, []

    async def visible(self, latest=False):
        return [at(ALICE, "/ip4/192.0.2.10/tcp/1")]

    async def list_peers(self):
        return [SimpleNamespace(peer_id=peer) for peer in self.connected]

    async def get(self, key):
        self.read.append(key)
        return {addresses_key(RUN): self.published, f"{RUN}_progress": self.training}.get(key)


def run_book(monkeypatch, node, publish, seconds=0.1, look_every=60.0, during=None):
    monkeypatch.setattr(peer_addresses, "FIRST_LOOKS", ())  # (one look in the test's 0.1 s)
    monkeypatch.setattr(peer_addresses, "LOOK_EVERY", look_every)
    stored, dialed = [], []

    async def store(key, subkey, value, expiration, _dht, _node, may_wait):
        stored.append((key, subkey, value, may_wait))
        await asyncio.sleep(may_wait)  # (a renewal waits for a ride)
        return True

    async def connect(p2p, peer, maddrs):
        dialed.append((peer, maddrs))

    async def read_replicas(node, keys):
        return {key: await node.get(key) for key in keys}

    monkeypatch.setattr(peer_addresses, "_store_on_replicas", store)
    monkeypatch.setattr(peer_addresses, "read_replicas", read_replicas)

    async def go():
        task = asyncio.ensure_future(keep_peers_connected(RUN, owner("alice"), publish, connect, None, node))
        await asyncio.sleep(seconds)
        if during is not None:
            await during()
        running = dict(peer_addresses._BOOKS)
        await peer_addresses._stop(RUN, None, node)
        await asyncio.wait({task})
        return task, running

    task, running = asyncio.run(go())
    assert not task.cancelled() and task.exception() is None  # (it ends quietly when stopped)
    assert running == {RUN: task} and peer_addresses._BOOKS == {}
    return stored, dialed


@pytest.mark.parametrize("publish", [True, False])
def test_a_peer_publishes_its_addresses_and_connects_to_the_run_peers_it_misses(monkeypatch, publish):
    published = book({owner("bob"): dict(peer_id=BOB.to_bytes(), maddrs=[at(BOB, "/ip4/192.0.2.11/tcp/2")]),
                      owner("carol"): dict(peer_id=CAROL.to_bytes(), maddrs=[at(CAROL, "/ip4/192.0.2.12/tcp/3")])})
    node = Node(published, progress(bob=BOB, carol=CAROL), connected=[CAROL])
    stored, dialed = run_book(monkeypatch, node, publish)
    assert dialed == [(BOB, [at(BOB, "/ip4/192.0.2.11/tcp/2")])]  # (CAROL is connected already)
    assert set(node.read) == {addresses_key(RUN), f"{RUN}_progress"}
    record = dict(peer_id=ALICE.to_bytes(), maddrs=[at(ALICE, "/ip4/192.0.2.10/tcp/1")])
    assert stored == ([(addresses_key(RUN), owner("alice"), record, 0.0)] if publish else [])  # (a client: nothing)


def test_renewals_wait_for_a_ride_in_the_background_while_the_looks_go_on(monkeypatch):
    """The first record goes out at once; a renewal may wait (RIDE_ALONG) to leave with another store of this peer,
    and the book's looks do not wait for it."""
    monkeypatch.setattr(peer_addresses, "PUBLISH_EVERY", 0.02)
    node = Node(None, progress(alice=ALICE), connected=[])  # (no other record yet: every look reads)
    stored, _ = run_book(monkeypatch, node, True, seconds=0.2, look_every=0.02)
    assert [may_wait for *_, may_wait in stored][:3] == [0.0, RIDE_ALONG, RIDE_ALONG]
    assert len(node.read) >= 2 * 5  # (renewals that wait 10 s did not hold up ~10 looks)


def test_the_book_is_read_again_at_once_when_a_peer_it_named_is_no_longer_connected(monkeypatch):
    """While every peer the book named is connected, a look asks only the p2p daemon (nothing on the wire); a cut
    connection makes the next look read the book and dial the peer at its published addresses."""
    published = book({owner("bob"): dict(peer_id=BOB.to_bytes(), maddrs=[at(BOB, "/ip4/192.0.2.11/tcp/2")]),
                      owner("carol"): dict(peer_id=CAROL.to_bytes(), maddrs=[at(CAROL, "/ip4/192.0.2.12/tcp/3")])})
    node = Node(published, progress(bob=BOB, carol=CAROL), connected=[BOB, CAROL])
    reads_while_connected = []

    async def cut_carol():  # ~10 looks went by with everyone connected
        reads_while_connected.append(len(node.read))
        node.connected = [BOB]
        await asyncio.sleep(0.1)

    _, dialed = run_book(monkeypatch, node, False, seconds=0.2, look_every=0.02, during=cut_carol)
    assert reads_while_connected == [2]  # the first look's two reads (addresses, progress), then none
    assert dialed and all(call == (CAROL, [at(CAROL, "/ip4/192.0.2.12/tcp/3")]) for call in dialed)
    assert len(node.read) > 2


@pytest.mark.parametrize("case", ["no other record yet", "a training peer without an address record"])
def test_the_book_is_read_at_every_look_until_every_training_peer_is_in_it_and_connected(monkeypatch, case):
    """Peers that start together may read the book before the others' records are there; a training peer may be in
    the progress records before its address record: neither read lets the peer wait the quiet period."""
    if case == "no other record yet":
        node = Node(None, progress(alice=ALICE), connected=[])
    else:
        published = book({owner("bob"): dict(peer_id=BOB.to_bytes(), maddrs=[at(BOB, "/ip4/192.0.2.11/tcp/2")])})
        node = Node(published, progress(bob=BOB, carol=CAROL), connected=[BOB])
    run_book(monkeypatch, node, False, seconds=0.2, look_every=0.02)
    assert len(node.read) >= 2 * 5  # (about 10 looks, each reading the addresses and the progress records)


def test_a_second_book_for_the_run_replaces_the_first():
    async def go():
        async def never(*_):
            await asyncio.sleep(3600)

        node = Node(None, None, [])
        first = asyncio.ensure_future(keep_peers_connected(RUN, owner("alice"), False, never, None, node))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(keep_peers_connected(RUN, owner("alice"), False, never, None, node))
        await asyncio.sleep(0.05)
        first_done, books = first.done(), dict(peer_addresses._BOOKS)
        await peer_addresses._stop(RUN, None, node)
        await asyncio.wait({second})
        return first_done, books == {RUN: second}

    assert asyncio.run(go()) == (True, True)


def test_a_false_record_for_a_peer_never_shadows_its_own_for_good():
    found = book({owner("mallory"): dict(peer_id=BOB.to_bytes(), maddrs=[at(BOB, "/ip4/203.0.113.9/tcp/22")]),
                  owner("bob"): dict(peer_id=BOB.to_bytes(), maddrs=[at(BOB, "/ip4/192.0.2.11/tcp/2")])})
    seen = {tuple(peers_to_dial(published_peers(found, progress(bob=BOB, mallory=BOB), ALICE), connected=set())[BOB])
            for _ in range(64)}
    assert seen == {(at(BOB, "/ip4/203.0.113.9/tcp/22"),), (at(BOB, "/ip4/192.0.2.11/tcp/2"),)}
