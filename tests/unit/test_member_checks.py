"""The member tokens in a group's gathered data (collabopt/engine/member_checks.py): what a leader and every
member check before an all-reduce. On a real swarm: tests/swarm/test_swarm_membership.py."""

from __future__ import annotations

from types import SimpleNamespace

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from collabopt.engine import member_checks
from collabopt.engine.member_checks import MemberMatchmaking, gathered_refusal, with_token, without_token
from collabopt.membership import SwarmKey, SwarmKeyAuthorizer, new_swarm_key

ALICE, BOB = (PeerID.from_base58(text) for text in ("QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4",
                                                    "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51"))
GATHERED = MSGPackSerializer.dumps([1e6, 0, MSGPackSerializer.dumps({"epoch": 3})])
KEY = SwarmKey(new_swarm_key())


def test_a_members_token_passes_for_it_only_and_hivemind_reads_its_data_as_before():
    data = with_token(GATHERED, KEY, "run_grad_averager", ALICE.to_bytes())
    assert gathered_refusal(data, KEY, "run_grad_averager", ALICE.to_bytes()) is None
    assert "another peer" in gathered_refusal(data, KEY, "run_grad_averager", BOB.to_bytes())
    assert "this run" in gathered_refusal(data, KEY, "run_state_averager", ALICE.to_bytes())
    assert "this run" in gathered_refusal(data, SwarmKey(new_swarm_key()), "run_grad_averager", ALICE.to_bytes())
    assert without_token(data) == GATHERED


def test_data_without_a_token_or_with_garbage_is_refused():
    assert "no member token" in gathered_refusal(GATHERED, KEY, "run_grad_averager", ALICE.to_bytes())
    assert "cannot be read" in gathered_refusal(b"\xff" * 10, KEY, "run_grad_averager", ALICE.to_bytes())
    garbage = MSGPackSerializer.dumps([1e6, 0, b"", b"short"])
    assert "cannot be read" in gathered_refusal(garbage, KEY, "run_grad_averager", ALICE.to_bytes())


def _leader(key, hivemind_says=None):
    """A MemberMatchmaking whose hivemind checks give ``hivemind_says`` (the state of a leader is hivemind's)."""
    leader = object.__new__(MemberMatchmaking)
    leader.group_key_manager = SimpleNamespace(dht=SimpleNamespace(kwargs=dict(
        authorizer=SwarmKeyAuthorizer(key)) if key is not None else {}), prefix="run_grad_averager")
    return leader, hivemind_says


def test_a_leader_refuses_a_join_request_without_the_callers_token(monkeypatch):
    monkeypatch.setattr(Matchmaking, "_check_reasons_to_reject", lambda self, request, context: None)
    leader, _ = _leader(KEY)
    member = averaging_pb2.JoinRequest(gather=with_token(GATHERED, KEY, "run_grad_averager", ALICE.to_bytes()))
    assert leader._check_reasons_to_reject(member, SimpleNamespace(remote_id=ALICE)) is None
    for request, caller in ((member, BOB), (averaging_pb2.JoinRequest(gather=GATHERED), ALICE)):
        answer = leader._check_reasons_to_reject(request, SimpleNamespace(remote_id=caller))
        assert answer.code == averaging_pb2.PROTOCOL_VIOLATION
    open_leader, _ = _leader(None)  # an open swarm: hivemind's checks only
    assert open_leader._check_reasons_to_reject(averaging_pb2.JoinRequest(gather=GATHERED),
                                                SimpleNamespace(remote_id=BOB)) is None


def test_the_all_reduce_is_refused_when_one_member_has_no_token():
    import asyncio
    import dataclasses

    from hivemind.averaging.group_info import GroupInfo
    from hivemind.averaging.partition import AllreduceException

    class Base:
        async def _aggregate_with_group(self, group_info, *args, **kwargs):
            return group_info

    class Averager(member_checks.MemberChecks, Base):
        prefix = "run_grad_averager"
        dht = SimpleNamespace(kwargs=dict(authorizer=SwarmKeyAuthorizer(KEY)))

    tokens = tuple(with_token(GATHERED, KEY, "run_grad_averager", peer.to_bytes()) for peer in (ALICE, BOB))
    group = GroupInfo(b"group", (ALICE, BOB), tokens)
    passed = asyncio.run(Averager()._aggregate_with_group(group, 0))
    assert passed.gathered == (GATHERED, GATHERED)
    for gathered in ((tokens[0], GATHERED), (tokens[1], tokens[0])):  # no token; tokens swapped
        try:
            asyncio.run(Averager()._aggregate_with_group(dataclasses.replace(group, gathered=gathered), 0))
        except AllreduceException as e:
            assert "no member of the swarm" in str(e)
        else:
            raise AssertionError("the round was not refused")


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
