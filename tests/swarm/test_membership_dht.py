"""collabopt.membership.SwarmKeyAuthorizer on real hivemind DHT nodes in this process's children: two members with
the swarm key store and read each other's records; a node with another key, or with none, cannot join, and its
direct store and find requests to a member are refused, as are its answers to a member."""

from __future__ import annotations

import functools
import time

import pytest
from hivemind.utils import MSGPackSerializer, get_dht_time

pytestmark = pytest.mark.swarm


async def _find(key: str, peer, _dht, node) -> object | None:
    """``key``'s value as ``peer``'s node answers a direct find; None where it refused (no answer)."""
    from hivemind.dht.routing import DHTID

    answer = await node.protocol.call_find(peer, [DHTID.generate(source=key)])
    if answer is None:
        return None
    found, _nearest = next(iter(answer.values()))
    return "not found" if found is None else MSGPackSerializer.loads(found.value)


async def _store(key: str, value: str, peer, _dht, node) -> list[bool] | None:
    """A direct store on ``peer``'s node; None where it refused."""
    from hivemind.dht.routing import DHTID

    return await node.protocol.call_store(peer, [DHTID.generate(source=key)], [MSGPackSerializer.dumps(value)],
                                          get_dht_time() + 60)


async def _ping(peer, _dht, node) -> object | None:
    """``peer``'s node id as its (validated) answer to a ping gives it; None where the answer was refused."""
    return await node.protocol.call_ping(peer)


def test_only_members_store_and_read_the_swarms_records():
    import hivemind

    from collabopt.membership import SwarmKey, SwarmKeyAuthorizer, new_swarm_key

    text = new_swarm_key()
    options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    alice = hivemind.DHT(authorizer=SwarmKeyAuthorizer(SwarmKey(text)), **options)
    dhts = [alice]
    try:
        initial_peers = [str(m) for m in alice.get_visible_maddrs()]
        bob = hivemind.DHT(initial_peers=initial_peers, authorizer=SwarmKeyAuthorizer(SwarmKey(text)), **options)
        dhts.append(bob)
        expiration = get_dht_time() + 60
        assert alice.store("members_record", "alice's", expiration)
        assert bob.get("members_record").value == "alice's"
        assert bob.store("bobs_record", "bob's", expiration)
        assert alice.get("bobs_record").value == "bob's"

        for name, authorizer in (("no key", None), ("another key", SwarmKeyAuthorizer(SwarmKey(new_swarm_key())))):
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="bootstrap failed"):  # its pings refused: it cannot join
                hivemind.DHT(initial_peers=initial_peers, authorizer=authorizer, bootstrap_timeout=10, **options)
            assert time.monotonic() - started < 5, f"{name}: refused only after a timeout"
            # started alone, it asks the members' nodes directly
            outsider = hivemind.DHT(initial_peers=initial_peers, authorizer=authorizer,
                                    ensure_bootstrap_success=False, **options)
            dhts.append(outsider)
            for member in (alice, bob):
                peer = member.peer_id
                assert outsider.run_coroutine(functools.partial(_find, "members_record", peer)) is None, name
                assert outsider.run_coroutine(functools.partial(_store, "outsiders_record", "x", peer)) is None, name
                # ... and members refuse its answers (a member's answer they take)
                assert member.run_coroutine(functools.partial(_ping, outsider.peer_id)) is None, name
            assert alice.run_coroutine(functools.partial(_ping, bob.peer_id)) is not None
            assert alice.run_coroutine(functools.partial(_find, "bobs_record", bob.peer_id)) == "bob's"
            assert outsider.get("members_record") is None
            assert alice.get("outsiders_record") is None and bob.get("outsiders_record") is None
    finally:
        for dht in dhts:
            dht.shutdown()
