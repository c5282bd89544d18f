"""The swarm key in collabopt's averaging service (collabopt/engine/averager.py): a join request without the
caller's valid member token never reaches hivemind's matchmaking, and every member checks every member's token
before its all-reduce. A search's own rule (``admits``) refuses a join request the same way."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from collabopt.engine import averager, protocol
from collabopt.membership import MemberToken, SwarmKey, new_swarm_key

ALICE, BOB = (PeerID.from_base58(text) for text in ("QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4",
                                                    "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51"))
KEY = SwarmKey(new_swarm_key())
SCOPE = "run_grad_averager"


def entry(peer, key=KEY, scope=SCOPE, epoch=3):
    token = None if key is None else MemberToken.issue(key, scope, peer.to_bytes()).to_bytes()
    return [True, {"epoch": epoch}, token]


class Matchmaking:
    request_timeout = 3.0

    def __init__(self, step_control=None):
        self.requests, self.step_control = [], step_control

    async def rpc_join_group(self, request, context):
        self.requests.append(context.remote_id)
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)


def join(gate, peer, data, client_mode=False):
    async def go():
        request = averaging_pb2.JoinRequest(gather=MSGPackSerializer.dumps(data) if data is not None else b"\xff",
                                            client_mode=client_mode)
        return [m.code async for m in gate.rpc_join_group(request, SimpleNamespace(remote_id=peer))]
    return asyncio.run(go())


def test_the_gate_refuses_a_join_request_without_the_callers_token_before_matchmaking_reads_it():
    matchmaking = Matchmaking()
    gate = averager._MemberGate(matchmaking, KEY, SCOPE)
    assert join(gate, ALICE, entry(ALICE)) == [averaging_pb2.ACCEPTED]
    for peer, data in ((BOB, entry(ALICE)), (ALICE, entry(ALICE, key=None)), (ALICE, None),
                       (ALICE, entry(ALICE, scope="run_state_averager")),
                       (ALICE, entry(ALICE, key=SwarmKey(new_swarm_key())))):
        assert join(gate, peer, data) == [averaging_pb2.PROTOCOL_VIOLATION], (peer, data)
    assert matchmaking.requests == [ALICE]  # (only the member's request reached it)
    open_gate = averager._MemberGate(Matchmaking(), None, SCOPE)  # an open swarm: matchmaking's checks only
    assert join(open_gate, BOB, entry(BOB, key=None)) == [averaging_pb2.ACCEPTED]


def test_every_member_checks_every_token_of_its_group():
    service = SimpleNamespace(_key=KEY, prefix=SCOPE)
    members = (ALICE, BOB)
    assert averager.AveragingService._refusal(service, members, [entry(ALICE), entry(BOB)]) is None
    refusal = averager.AveragingService._refusal(service, members, [entry(ALICE), entry(ALICE)])
    assert str(BOB) in refusal and "no member of the swarm" in refusal
    assert averager.AveragingService._refusal(SimpleNamespace(_key=None, prefix=SCOPE), members,
                                              [entry(ALICE, None), entry(BOB, None)]) is None


def test_a_search_that_does_not_admit_a_peer_refuses_its_join_request_before_matchmaking_reads_it():
    """The leader's own search rule: here the gradient rounds' (protocol.sync_admits), for a leader at epoch 3."""
    search = averager._Search(0.0, 0.0, b"", admits=functools.partial(protocol.sync_admits, {"epoch": 3}))
    for key in (KEY, None):
        matchmaking = Matchmaking(search)
        gate = averager._MemberGate(matchmaking, key, SCOPE)
        assert join(gate, BOB, entry(BOB, key=key, epoch=7)) == [averaging_pb2.BAD_GROUP_KEY]
        assert join(gate, ALICE, entry(ALICE, key=key, epoch=3)) == [averaging_pb2.ACCEPTED]
        assert join(gate, BOB, entry(BOB, key=key, epoch=2)) == [averaging_pb2.ACCEPTED]
        # a client-mode peer can lead no group of its own: refused, it would have none
        assert join(gate, BOB, entry(BOB, key=key, epoch=7), client_mode=True) == [averaging_pb2.ACCEPTED]
        assert matchmaking.requests == [ALICE, BOB, BOB]
    assert join(averager._MemberGate(Matchmaking(averager._Search(0.0, 0.0, b"")), None, SCOPE), BOB,
                entry(BOB, key=None, epoch=7)) == [averaging_pb2.ACCEPTED]  # (no rule: hivemind's checks only)
