"""Two peers that dial each other at the same moment both connect (collabopt.engine.p2p, ``p2pd_environment``).

The members of a new group do dial each other at once, as its round begins. With libp2p's default (dials from the
listening port), such a pair can make one TCP connection by simultaneous open, on which both sides act as the
initiator: both handshakes fail ("noise: message is too short") and each side backs off from the other's address.
On loopback that was 5 pairs in 40; with ``P2PD_ENVIRONMENT`` emptied (libp2p's default) this test fails so.
"""

from __future__ import annotations

import asyncio

import pytest

from collabopt.engine.p2p import connect_to, own_replica, start_dht

TRIES = 40


@pytest.fixture
def two_dhts(monkeypatch):
    monkeypatch.delenv("LIBP2P_TCP_REUSEPORT", raising=False)  # collabopt's value, not one of the caller's
    dhts = []
    try:
        for _ in range(2):
            dhts.append(start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        yield dhts
    finally:
        for dht in dhts:
            dht.shutdown()


def test_two_peers_that_dial_each_other_at_the_same_moment_both_connect(two_dhts):
    async def run() -> list[str]:
        a_maddrs, b_maddrs = [[str(m) for m in dht.get_visible_maddrs()] for dht in two_dhts]
        replicas, failures = [], []
        try:
            for dht in two_dhts:
                replicas.append(await own_replica(dht))
            a, b = replicas
            for attempt in range(TRIES):
                outcomes = await asyncio.gather(connect_to(a, b.peer_id, b_maddrs), connect_to(b, a.peer_id, a_maddrs),
                                                return_exceptions=True)
                failures += [f"{attempt}: {outcome}" for outcome in outcomes if isinstance(outcome, BaseException)]
                await asyncio.gather(a._client.disconnect(b.peer_id), b._client.disconnect(a.peer_id))
        finally:
            await asyncio.gather(*(replica.shutdown() for replica in replicas))
        return failures

    failures = asyncio.run(run())
    assert not failures, f"{len(failures)} of {2 * TRIES} dials failed:\n" + "\n".join(failures[:4])
