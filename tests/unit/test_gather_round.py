"""The all-gather exchange's defences against peers that send what they like (collabopt.engine.gather_round,
collabopt.engine.gather_exchange), without a network: messages for groups this member has not registered, members
whose gathered data does not do."""

from __future__ import annotations

import asyncio
import logging
import time
import types

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine import gather_protocol as protocol
from collabopt.engine.gather_exchange import ExchangeService
from collabopt.engine.gather_round import PENDING_LIMIT, ExchangeRound, ExchangeServicer, Refused


def _peer(i: int) -> PeerID:
    return PeerID(b"\x00\x24\x08\x01\x12\x20" + bytes([i]) * 32)


def _raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _call(servicer: ExchangeServicer, rpc: str, fields: list, sender: PeerID, metadata: bytes | None = None):
    """A coroutine of one message to ``servicer``, as its handler gets it from the daemon."""
    request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(fields) if metadata is None else metadata)
    context = P2PContext(handle_name=rpc, local_id=_peer(0), remote_id=sender)
    return getattr(servicer, rpc)(request, context)


def _answer(message: averaging_pb2.DownloadData) -> list:
    return MSGPackSerializer.loads(message.metadata)


async def _settle() -> None:
    """Let every task that can go on without time passing do so."""
    for _ in range(5):
        await asyncio.sleep(0)


def _rounds(count: int = 3, absent: tuple[int, ...] = (), max_payload_bytes: int = 100, gathered=None,
            max_contributors: int | None = None):
    """The members' rounds; ``gathered(i)``: the gathered data member i received (default: the same for all)."""
    keys = [Ed25519PrivateKey.generate() for _ in range(count)]
    raw = [None if i in absent else _raw(k) for i, k in enumerate(keys)]
    members = [_peer(i) for i in range(count)]
    gathered = gathered or (lambda i: [b"entry %d" % m for m in range(count)])
    return [ExchangeRound(group_id=b"g", members=members, me=i, keys=raw, gathered=gathered(i), signing_key=keys[i],
                          stub_for=None, phase_timeout=5.0, max_payload_bytes=max_payload_bytes,
                          max_contributors=max_contributors)
            for i in range(count) if i not in absent]


# ---------------------------------------------------------------- messages for groups not registered
def test_a_message_for_an_unknown_group_is_refused_at_once_unless_this_member_assembles_one():
    r0, r1, _ = _rounds()
    _, signature = r1.sign(b"p", 1.0)
    offer = [b"g", b"p", 1.0, signature]

    async def scenario():
        servicer = ExchangeServicer(lambda schema: None)
        stranger = asyncio.ensure_future(_call(servicer, "rpc_offer", offer, _peer(1)))
        await _settle()  # (no matchmaking runs: no group is coming, no waiting)
        assert stranger.done() and _answer(stranger.result()) == [False, "a message for a group this member is not in"]
        servicer.assembling += 1
        early = asyncio.ensure_future(_call(servicer, "rpc_offer", offer, _peer(1)))
        other = asyncio.ensure_future(_call(servicer, "rpc_offer", [b"h", *offer[1:]], _peer(1)))
        await _settle()
        assert not early.done() and not other.done() and servicer.pending == 2
        servicer.register(b"g", r0)  # (the registration hands the waiting message on: no polling)
        await _settle()
        assert early.done() and _answer(early.result()) == [True, None] and r0.payloads[1]
        assert not other.done()
        servicer.assembled()  # (the matchmaking ended: group h is none of this member's)
        await _settle()
        assert other.done() and _answer(other.result()) == [False, "a message for a group this member is not in"]
        assert servicer.pending == 0 and not servicer._waiting

    asyncio.run(scenario())


def test_at_most_pending_limit_messages_wait_and_an_oversized_one_never_does(caplog):
    async def scenario():
        servicer = ExchangeServicer(lambda schema: None, max_payload_bytes=100)
        servicer.assembling += 1
        waiting = [asyncio.ensure_future(_call(servicer, "rpc_confirm", [bytes([i]) * 20, b"x" * 32], _peer(1)))
                   for i in range(PENDING_LIMIT)]
        await _settle()
        assert not any(task.done() for task in waiting) and servicer.pending == PENDING_LIMIT
        one_more = asyncio.ensure_future(_call(servicer, "rpc_confirm", [b"z" * 20, b"x" * 32], _peer(1)))
        big = asyncio.ensure_future(_call(servicer, "rpc_offer", [], _peer(1),
                                          metadata=b"\x00" * (servicer.max_message_bytes + 1)))
        await _settle()
        assert one_more.done() and "others wait" in _answer(one_more.result())[1]
        assert big.done() and "over" in _answer(big.result())[1]
        servicer.assembled()
        await _settle()
        assert all(task.done() and _answer(task.result())[0] is False for task in waiting)

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert "refused confirm from" in caplog.text


# ---------------------------------------------------------------- members whose gathered data does not do
def test_a_member_with_unreadable_data_or_no_key_is_absent_not_the_end_of_the_round(caplog):
    keys = [Ed25519PrivateKey.generate() for _ in range(4)]
    entries = [MSGPackSerializer.dumps([True, [{"seed": 0}, _raw(keys[0])], None]), b"\xc1garbage",
               MSGPackSerializer.dumps([True, [{"seed": 2}, b"short"], None]),
               MSGPackSerializer.dumps([True, [{"seed": 3}, _raw(keys[3])], None])]
    members = [_peer(i) for i in range(4)]
    service = types.SimpleNamespace(_public_key=_raw(keys[0]), _key=None, prefix="x",
                                    p2p=types.SimpleNamespace(peer_id=members[0]))
    with caplog.at_level(logging.WARNING):
        gathered, raw = ExchangeService._group_of(service, types.SimpleNamespace(peer_ids=members, gathered=entries))
    assert raw == [_raw(keys[0]), None, None, _raw(keys[3])]
    assert gathered == {members[0]: {"seed": 0}, members[3]: {"seed": 3}}
    assert "unreadable gathered data" in caplog.text and "announced no Ed25519 key" in caplog.text
    altered = types.SimpleNamespace(peer_ids=members, gathered=[entries[3], *entries[1:]])  # (not this member's key)
    assert "this member's own key" in ExchangeService._group_of(service, altered)


def test_an_absent_members_messages_and_statements_do_not_count():
    keys = [Ed25519PrivateKey.generate() for _ in range(3)]
    r0 = ExchangeRound(group_id=b"g", members=[_peer(i) for i in range(3)], me=0,
                       keys=[_raw(keys[0]), _raw(keys[1]), None], gathered=[b"", b"", b""], signing_key=keys[0],
                       stub_for=None, phase_timeout=1.0, max_payload_bytes=100)
    assert r0.absent == {2} and r0.present == [1]
    digest = protocol.payload_hash(b"p")
    signature = keys[2].sign(protocol.statement_bytes(b"g", _peer(2).to_bytes(), digest, 1.0))
    with pytest.raises(Refused, match="absent from this round"):
        r0.on_offer(2, [b"p", 1.0, signature])
    with pytest.raises(Refused, match="absent from this round"):
        r0.on_digest(1, [[[2, digest, 1.0, signature]]])
    servicer = ExchangeServicer(lambda schema: None)
    servicer.register(b"g", r0)
    answer = _answer(asyncio.run(_call(servicer, "rpc_confirm", [b"g", b"x" * 32], _peer(2))))
    assert answer[0] is False and "absent" in answer[1] and not r0.confirmations


class _Stub:
    """A member's stub that hands each message straight to another member's servicer."""

    def __init__(self, servicer: ExchangeServicer, caller: PeerID, calls: list | None = None):
        self.servicer, self.caller, self.calls = servicer, caller, calls

    def __getattr__(self, rpc: str):
        async def call(request, timeout):
            if self.calls is not None:
                self.calls.append((self.caller, rpc))
            context = P2PContext(handle_name=rpc, local_id=_peer(0), remote_id=self.caller)
            return await getattr(self.servicer, rpc)(request, context)
        return call


def _run_together(rounds, asked: set | None = None, weight=lambda i: i + 1.0, calls: list | None = None) -> list:
    """Run the members' ``rounds`` against each other in one loop, each member's messages handed straight to the
    others' servicers (``calls``: (caller, rpc) of each message); member i's payload: b"p<i>" of ``weight(i)``. The
    (decision, reason) of each."""
    async def scenario():
        servicers = {}
        for round_ in rounds:
            servicers[round_.members[round_.me]] = servicer = ExchangeServicer(lambda schema: None)
            servicer.register(b"g", round_)

        def stub_for(peer: PeerID, me: PeerID) -> _Stub:
            if asked is not None:
                asked.add(peer)
            return _Stub(servicers[peer], me, calls)
        for round_ in rounds:
            round_.stub_for = lambda peer, me=round_.members[round_.me]: stub_for(peer, me)
        start = time.monotonic()
        return await asyncio.gather(*(r.run(b"p%d" % r.me, weight(r.me), start) for r in rounds))
    return asyncio.run(scenario())


def test_the_present_members_apply_one_set_without_the_absent_one_which_counts_in_the_group_size():
    asked = set()
    (d0, reason0), (d1, reason1) = _run_together(_rounds(absent=(2,)), asked)
    assert asked == {_peer(0), _peer(1)}  # (the absent member 2 is sent nothing)
    assert reason0 is None and reason1 is None
    assert d0 == d1 and d0.senders == (0, 1) and d0.excluded == ()
    (alone,) = _rounds(absent=(1, 2))  # (the absent count in the group's size: 1 of 3 is no majority)
    decision, reason = asyncio.run(alone.run(b"zero", 1.0, 0.0))
    assert decision.senders == (0,) and "only 1 of 3" in reason


def test_members_told_different_metadata_of_a_member_see_different_views_and_none_applies():
    """A leader that tells member 0 one epoch/anchor of member 2 and member 1 another (so that they would weigh
    member 2's contribution differently) makes their views differ: every member refuses the round."""
    told = {0: b"epoch 7 anchor A", 1: b"epoch 7 anchor B", 2: b"epoch 7 anchor A"}  # (what each got for member 2)
    rounds = _rounds(gathered=lambda i: [b"entry 0", b"entry 1", told[i]])
    assert rounds[0].view == rounds[2].view != rounds[1].view
    results = _run_together(rounds)
    assert [decision.senders for decision, _ in results] == [(0, 1, 2)] * 3  # (the same contributions arrived)
    assert all(reason is not None and "decided another set" in reason for _, reason in results)
    same = _rounds()  # (identical gathered data: one view, every member applies)
    assert len({r.view for r in same}) == 1
    assert [reason for _, reason in _run_together(same)] == [None, None, None]


def test_only_the_rounds_contributors_send_a_payload_and_every_member_applies_their_set():
    """max_contributors=2 in a group of 4: the two members chosen send their payloads, the other two the empty one
    with their weight (they wait); all four decide and apply the same set. A payload from a member not chosen is
    refused by every member (it would make a fifth contribution), and so is a statement of weight 0 for a payload
    that is not empty, or of weight -0.0 (equal to 0.0 in a set, not in a decision's hash)."""
    rounds = _rounds(count=4, max_contributors=2)
    chosen = rounds[0].contributors
    assert len(chosen) == 2 and all(r.contributors == chosen for r in rounds)
    results = _run_together(rounds)
    assert all(reason is None for _, reason in results)
    decision = results[0][0]
    assert all(d == decision for d, _ in results) and decision.senders == (0, 1, 2, 3)
    for sender, digest, weight in decision.applied:
        assert weight == sender + 1.0
        assert digest == (protocol.payload_hash(b"p%d" % sender) if sender in chosen else protocol.EMPTY_HASH)
    outsider, insider = min(set(range(4)) - chosen), min(chosen)
    fresh = _rounds(count=4, max_contributors=2)
    receiver = next(r for r in fresh if r.me not in (outsider, insider))
    for member in (outsider, insider):
        receiver.keys[member] = fresh[member].signing_key.public_key()
    _, signature = fresh[outsider].sign(b"more", 1.0)
    with pytest.raises(Refused, match="not one of this round's 2 contributors"):
        receiver.on_offer(outsider, [b"more", 1.0, signature])
    _, unread = fresh[insider].sign(b"more", 0.0)
    with pytest.raises(Refused, match="weight 0 .* not empty"):  # (bytes no aggregate reads: refused)
        receiver.on_offer(insider, [b"more", 0.0, unread])
    _, negative = fresh[insider].sign(b"", -0.0)
    with pytest.raises(Refused, match="malformed"):
        receiver.on_offer(insider, [b"", -0.0, negative])
    _, empty = fresh[outsider].sign(b"", 3.0)
    receiver.on_offer(outsider, [b"", 3.0, empty])  # (its part in the round: it waits, with its weight)
    assert list(receiver.held[outsider]) == [(protocol.EMPTY_HASH, 3.0)]


def test_absent_members_are_never_chosen_to_contribute():
    rounds = _rounds(count=5, absent=(1, 3), max_contributors=2)
    assert all(len(r.contributors) == 2 and not r.contributors & {1, 3} for r in rounds)
    assert _rounds(count=4, absent=(2,), max_contributors=3)[0].contributors == {0, 1, 3}


def test_a_member_of_weight_zero_sends_the_empty_payload_which_nobody_fetches():
    """Weight 0 (nothing trained): the member sends the empty payload whatever it was handed; and a waiting member's
    statement that one member got only through the others' digests needs no fetch: every member holds the empty
    payload."""
    results = _run_together(_rounds(), weight=lambda i: 0.0 if i == 0 else i + 1.0)
    assert all(reason is None for _, reason in results)
    assert all(decision.applied[0] == (0, protocol.EMPTY_HASH, 0.0) for decision, _ in results)
    rounds, calls = _rounds(count=4, max_contributors=2), []
    waiting = min(set(range(4)) - rounds[0].contributors)
    blind = next(m for m in range(4) if m != waiting)

    async def offer_to_all_but_one(payload, weight, digest, signature, deadline, me=rounds[waiting]):
        await asyncio.gather(*(me._call(m, "rpc_offer", deadline, payload, weight, signature)
                               for m in me.present if m != blind))
    rounds[waiting].send_offers = offer_to_all_but_one
    results = _run_together(rounds, calls=calls)
    assert all(reason is None for _, reason in results)
    assert rounds[blind].payloads[waiting] == {protocol.EMPTY_HASH: b""} and waiting not in rounds[blind].held
    assert not [call for call in calls if call[1] == "rpc_fetch"]
