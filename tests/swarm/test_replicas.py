"""Per-peer records stored on their key's replicas (collabopt.engine.replicas), on real DHT nodes: every peer reads
every record, signed records stay signed, and a store downloads nothing once the key's replicas are known."""

from __future__ import annotations

import uuid

import pytest
from hivemind.utils import get_dht_time

pytestmark = pytest.mark.swarm

_finds = 0  # in a DHT's process: the find requests its node made since _count_finds


async def _count_finds(_dht, node) -> None:
    global _finds
    call_find = node.protocol.call_find

    async def counted(*args, **kwargs):
        global _finds
        _finds += 1
        return await call_find(*args, **kwargs)

    node.protocol.call_find, _finds = counted, 0


async def _finds_made(_dht, node) -> int:
    return _finds


def test_records_on_replicas_are_read_by_every_peer_and_a_store_downloads_nothing():
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from collabopt.engine.replicas import ReplicaRecords

    options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], num_replicas=2, start=True)
    dhts = [hivemind.DHT(**options)]
    initial_peers = [str(m) for m in dhts[0].get_visible_maddrs()]
    dhts += [hivemind.DHT(initial_peers=initial_peers, **options) for _ in range(3)]
    dhts.append(hivemind.DHT(initial_peers=initial_peers, client_mode=True, **options))
    try:
        validator = RSASignatureValidator()  # one key per process: the signed record is peer 0's
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

        records[1].dht.run_coroutine(_count_finds)
        assert records[1].store(key, {"peer": 1, "again": True}, expiration + 1, subkey=subkeys[1])
        assert records[1].dht.run_coroutine(_finds_made) == 0, "a store with known replicas asked for the dictionary"
        assert dhts[1].store(key, {"peer": 1}, expiration + 2, subkey=subkeys[1])  # hivemind's store, for contrast
        assert records[1].dht.run_coroutine(_finds_made) > 0, "the counter saw hivemind's store crawl"
    finally:
        for dht in dhts:
            dht.shutdown()
