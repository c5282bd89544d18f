"""Per-peer records stored on their key's replicas (collabopt.engine.replicas), on real DHT nodes: every peer reads
every record, signed records stay signed, a store downloads nothing once the key's replicas are known, and a read asks
a few replicas only."""

from __future__ import annotations

import functools
import time
import uuid

import pytest
from hivemind.utils import get_dht_time

pytestmark = pytest.mark.swarm

_calls: dict[str, int] = {}  # in a DHT's process: the requests of each kind its node made since _count


async def _count(method: str, _dht, node) -> None:
    if method not in _calls:  # (counted from now on; a second call starts the count again)
        call = getattr(node.protocol, method)

        async def counted(*args, **kwargs):
            _calls[method] += 1
            return await call(*args, **kwargs)

        setattr(node.protocol, method, counted)
    _calls[method] = 0


async def _made(method: str, _dht, node) -> int:
    return _calls[method]


async def _known(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def test_records_on_replicas_are_read_by_every_peer_and_a_store_downloads_nothing():
    import hivemind

    from collabopt.engine.record_signing import Ed25519SignatureValidator
    from collabopt.engine.replicas import READ_REPLICAS, ReplicaRecords

    options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], num_replicas=2, start=True)
    dhts = [hivemind.DHT(**options)]
    initial_peers = [str(m) for m in dhts[0].get_visible_maddrs()]
    dhts += [hivemind.DHT(initial_peers=initial_peers, **options) for _ in range(3)]
    dhts.append(hivemind.DHT(initial_peers=initial_peers, client_mode=True, **options))
    try:
        validator = Ed25519SignatureValidator()  # one key per process: the signed record is peer 0's
        for dht in dhts:
            dht.add_validators([validator])
        key, expiration = f"replicas_test_{uuid.uuid4().hex[:8]}", get_dht_time() + 120
        records = [ReplicaRecords(dht) for dht in dhts]
        subkeys = [validator.local_public_key] + [f"peer{i}".encode() for i in range(1, len(dhts))]
        for i, (peer, subkey) in enumerate(zip(records, subkeys, strict=True)):
            assert peer.store(key, {"peer": i}, expiration, subkey=subkey), f"peer {i}'s store was refused"

        for i, (dht, peer) in enumerate(zip(dhts, records, strict=True)):
            for found in (dht.get(key, latest=True), peer.get(key, latest=True)):  # hivemind's own read, and ours
                assert found is not None, f"peer {i} found no record"
                assert {subkey: item.value for subkey, item in found.value.items()} == {
                    subkey: {"peer": j} for j, subkey in enumerate(subkeys)}, f"peer {i} read other records"

        dhts[1].run_coroutine(functools.partial(_count, "call_find"))
        assert records[1].get(key) is not None
        assert 1 <= dhts[1].run_coroutine(functools.partial(_made, "call_find")) <= READ_REPLICAS  # (replicas known)
        dhts[1].run_coroutine(functools.partial(_count, "call_find"))
        assert records[1].store(key, {"peer": 1, "again": True}, expiration + 1, subkey=subkeys[1])
        assert dhts[1].run_coroutine(functools.partial(_made, "call_find")) == 0, "a store asked for the dictionary"
        assert dhts[1].store(key, {"peer": 1}, expiration + 2, subkey=subkeys[1])  # hivemind's store, for contrast
        assert dhts[1].run_coroutine(functools.partial(_made, "call_find")) > 0, "the counter saw hivemind's crawl"
    finally:
        for dht in dhts:
            dht.shutdown()


def test_a_peer_that_stored_alone_stores_on_the_peers_that_join():
    import hivemind

    from collabopt.engine.replicas import ReplicaRecords

    options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], num_replicas=2, start=True)
    first = hivemind.DHT(**options)
    others = []
    try:
        key, expiration = f"replicas_alone_{uuid.uuid4().hex[:8]}", get_dht_time() + 120
        assert ReplicaRecords(first).store(key, {"alone": True}, expiration, subkey=b"first")
        initial_peers = [str(m) for m in first.get_visible_maddrs()]
        others = [hivemind.DHT(initial_peers=initial_peers, **options) for _ in range(3)]
        deadline = time.monotonic() + 10
        while first.run_coroutine(_known) < len(others) and time.monotonic() < deadline:
            time.sleep(0.1)  # each joiner pings the first peer as it starts: the first peer learns of it
        assert first.run_coroutine(_known) == len(others)
        first.run_coroutine(functools.partial(_count, "call_store"))
        assert ReplicaRecords(first).store(key, {"alone": False}, expiration + 1, subkey=b"first")
        assert first.run_coroutine(functools.partial(_made, "call_store")) >= 1, "it still stored on itself alone"
        for dht in others:
            found = dht.get(key, latest=True)
            assert found is not None and found.value[b"first"].value == {"alone": False}
    finally:
        for dht in [first, *others]:
            dht.shutdown()
