"""The member tokens of state downloads (collabopt/engine/member_checks.py): a downloader stores its token, the
serving member checks it. The averaging rounds' own checks: tests/unit/test_averager_gate.py; on a real swarm:
tests/swarm/test_swarm_membership.py."""

from __future__ import annotations

from types import SimpleNamespace

from hivemind.p2p import PeerID

from collabopt.engine import member_checks
from collabopt.membership import SwarmKey, SwarmKeyAuthorizer, new_swarm_key

ALICE, BOB = (PeerID.from_base58(text) for text in ("QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4",
                                                    "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51"))
KEY = SwarmKey(new_swarm_key())


def test_a_download_needs_the_member_token_the_downloader_stored():
    """The state service serves (and answers challenges of) only a caller whose token it finds in the DHT record
    ``<prefix>.members``; the downloader stores it there before it downloads, only where the swarm has a key."""
    import asyncio

    from hivemind.utils.timed_storage import ValueWithExpiration

    from collabopt.membership import MemberToken

    prefix, records = "run_state_averager", {}

    def store(key, subkey, value, expiration_time):
        records.setdefault(key, {})[subkey] = ValueWithExpiration(value, expiration_time)
        return True

    async def get(key, latest, return_future):
        found = records.get(key)
        return None if found is None else ValueWithExpiration(found, 0.0)

    dht = SimpleNamespace(kwargs=dict(authorizer=SwarmKeyAuthorizer(KEY)), peer_id=ALICE, store=store, get=get)
    refusal = asyncio.run(member_checks.download_refusal(dht, prefix, KEY, ALICE.to_bytes()))
    assert refusal is not None and "stored no member token" in refusal
    member_checks.store_member_token(dht, prefix)
    assert asyncio.run(member_checks.download_refusal(dht, prefix, KEY, ALICE.to_bytes())) is None
    stolen = MemberToken.from_bytes(records[f"{prefix}.members"][ALICE.to_bytes()].value)  # (BOB shows ALICE's)
    records[f"{prefix}.members"][BOB.to_bytes()] = ValueWithExpiration(stolen.to_bytes(), 0.0)
    assert asyncio.run(member_checks.download_refusal(dht, prefix, KEY, BOB.to_bytes())) is not None
    open_swarm = SimpleNamespace(kwargs={}, peer_id=BOB, store=lambda **kwargs: records.clear())
    member_checks.store_member_token(open_swarm, prefix)  # (no key: nothing stored)
    assert records
