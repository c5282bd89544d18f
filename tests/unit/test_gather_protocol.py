"""The all-gather exchange's rules (collabopt.engine.gather_protocol) on tables of evidence, and one round's checks
of what comes from the network (collabopt.engine.gather_round), without a network."""

from __future__ import annotations

import asyncio

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine import gather_protocol as protocol
from collabopt.engine.gather_round import ExchangeRound, ExchangeServicer, Refused

H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))


@pytest.mark.parametrize("evidence, applied, excluded", [
    ({0: {(H1, 1.0)}, 1: {(H2, 2.0)}, 2: {(H3, 1.0)}}, [0, 1, 2], []),  # everyone's one statement
    ({0: {(H1, 1.0)}, 1: {(H2, 2.0)}, 2: {(H3, 1.0), (H1, 1.0)}}, [0, 1], [2]),  # two payloads: excluded
    ({0: {(H1, 1.0)}, 1: {(H2, 2.0), (H2, 3.0)}}, [0], [1]),  # one payload, two weights: excluded too
    ({0: {(H1, 1.0)}, 2: {(H3, 1.0)}}, [0, 2], []),  # nobody holds member 1's: left out
    ({2: {(H3, 1.0)}, 0: {(H1, 1.0)}, 1: set()}, [0, 2], []),  # the group's order, whatever the table's
])
def test_decide(evidence, applied, excluded):
    decision = protocol.decide(evidence)
    assert list(decision.senders) == applied and list(decision.excluded) == excluded
    assert all(evidence[s] == {(d, w)} for s, d, w in decision.applied)


def test_decision_hash_covers_the_view_the_set_and_the_exclusions():
    a = protocol.Decision(((0, H1, 1.0), (1, H2, 1.0)), ())
    variants = [protocol.Decision(((0, H1, 1.0),), ()), protocol.Decision(((0, H1, 1.0), (1, H2, 2.0)), ()),
                protocol.Decision(((0, H1, 1.0), (1, H3, 1.0)), ()), protocol.Decision(a.applied, (2,))]
    hashes = {protocol.decision_hash(b"view", d) for d in [a, *variants]} | {protocol.decision_hash(b"other", a)}
    assert len(hashes) == 6


def test_view_hash_covers_every_members_gathered_data_as_received():
    members, keys = [b"m0", b"m1", b"m2"], [b"k0", b"k1", b"k2"]
    view = protocol.view_hash(b"g", members, keys, [b"e0", b"e1", b"epoch 7 anchor A"])
    assert view == protocol.view_hash(b"g", members, keys, [b"e0", b"e1", b"epoch 7 anchor A"])
    others = [protocol.view_hash(b"g", members, keys, [b"e0", b"e1", b"epoch 7 anchor B"]),
              protocol.view_hash(b"g", members, keys, [b"e0x", b"e1", b"epoch 7 anchor A"]),
              protocol.view_hash(b"g", members, [b"k0", b"k1", b"kx"], [b"e0", b"e1", b"epoch 7 anchor A"]),
              protocol.view_hash(b"h", members, keys, [b"e0", b"e1", b"epoch 7 anchor A"])]
    assert len({view, *others}) == 5
    with pytest.raises(ValueError, match="gathered"):
        protocol.view_hash(b"g", members, keys, [b"e0", b"e1"])


SET3 = protocol.Decision(((0, H1, 1.0), (1, H2, 1.0), (2, H3, 1.0)), ())
SET2 = protocol.Decision(((0, H1, 1.0), (1, H2, 1.0)), (2,))
MINE = b"m" * 32


@pytest.mark.parametrize("decision, group_size, confirmations, refused", [
    (SET3, 3, {1: MINE, 2: MINE}, None),
    (SET3, 3, {1: MINE}, None),  # member 2 killed after its payload came: 2 of 3 confirmed
    (SET3, 3, {}, "only 1 of 3"),  # nobody confirmed: a minority
    (SET3, 4, {1: MINE}, "only 2 of 4"),  # half is not more than half
    (SET3, 3, {1: MINE, 2: b"x" * 32}, "members [2] decided another set"),
    (SET2, 3, {1: MINE, 2: b"x" * 32}, None),  # an excluded member's confirmation does not count
    (SET2, 3, {2: MINE}, "only 1 of 3"),  # ... nor towards the majority
    (protocol.Decision(((1, H2, 1.0), (2, H3, 1.0)), (0,)), 3, {1: MINE, 2: MINE}, "own contribution"),
])
def test_refusal(decision, group_size, confirmations, refused):
    reason = protocol.refusal(decision, 0, group_size, MINE, confirmations)
    assert reason is None if refused is None else refused in reason


def test_statements_of_other_rounds_senders_or_weights_differ():
    statement = protocol.statement_bytes
    variants = {statement(b"g", b"peer", H1, 1.0), statement(b"h", b"peer", H1, 1.0),
                statement(b"g", b"peeR", H1, 1.0), statement(b"g", b"peer", H2, 1.0), statement(b"g", b"peer", H1, 2.0)}
    assert len(variants) == 5


# ---------------------------------------------------------------- one round's checks, without a network
def _peer(i: int) -> PeerID:
    return PeerID(b"\x00\x24\x08\x01\x12\x20" + bytes([i]) * 32)


def _raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@pytest.fixture
def rounds():
    """Round 'g' as members 0 and 1 see it (member 2's key is known to both)."""
    keys = [Ed25519PrivateKey.generate() for _ in range(3)]
    members = [_peer(i) for i in range(3)]
    return keys, [ExchangeRound(group_id=b"g", members=members, me=i, keys=[_raw(k) for k in keys],
                                gathered=[b"", b"", b""], signing_key=keys[i], stub_for=None, phase_timeout=1.0,
                                max_payload_bytes=100) for i in range(3)]


def test_an_offer_counts_only_with_its_senders_signature_and_within_the_size(rounds):
    keys, (r0, r1, r2) = rounds
    _, signature = r1.sign(b"payload", 2.0)
    r0.on_offer(1, [b"payload", 2.0, signature])
    assert r0.payloads[1] and list(r0.held[1]) == [(protocol.payload_hash(b"payload"), 2.0)]
    with pytest.raises(Refused, match="signature does not verify"):
        r0.on_offer(2, [b"payload", 2.0, signature])  # member 1's signature, claimed by member 2
    with pytest.raises(Refused, match="signature does not verify"):
        r0.on_offer(1, [b"payload", 3.0, signature])  # another weight than the signed one
    _, big = r1.sign(b"x" * 101, 1.0)
    with pytest.raises(Refused, match="max_payload_bytes=100"):
        r0.on_offer(1, [b"x" * 101, 1.0, big])
    with pytest.raises(Refused, match="malformed"):
        r0.on_offer(1, [b"payload", float("nan"), signature])
    assert 2 not in r0.held and len(r0.held[1]) == 1


def test_a_digest_proves_an_equivocation_and_cannot_grow_without_bound(rounds):
    keys, (r0, r1, r2) = rounds
    d1, s1 = r2.sign(b"one", 1.0)
    d2, s2 = r2.sign(b"two", 1.0)
    r0.on_offer(2, [b"one", 1.0, s1])
    r0.on_digest(1, [[[2, d2, 1.0, s2]]])
    evidence = {2: set(r0.held[2]) | {(d, w) for _, d, w in r0.digests[1]}}
    assert protocol.decide(evidence).excluded == (2,)
    with pytest.raises(Refused, match="second digest"):
        r0.on_digest(1, [[]])
    with pytest.raises(Refused, match="more than two statements"):
        r0.on_digest(2, [[[2, d1, 1.0, s1]] * 7])
    forged = Ed25519PrivateKey.generate().sign(protocol.statement_bytes(b"g", _peer(2).to_bytes(), d2, 1.0))
    with pytest.raises(Refused, match="does not verify"):  # (member 1 cannot frame member 2)
        r1.on_digest(0, [[[2, d2, 1.0, forged]]])


def test_the_servicer_refuses_strangers_and_garbage_with_a_reason_and_never_raises(rounds, caplog):
    _, (r0, r1, _) = rounds
    servicer = ExchangeServicer(lambda schema: None)
    servicer.rounds[b"g"] = r0
    _, signature = r1.sign(b"p", 1.0)

    def call(rpc, metadata, sender):
        request = averaging_pb2.DownloadData(metadata=metadata)
        context = P2PContext(handle_name="x", local_id=_peer(0), remote_id=sender)
        return MSGPackSerializer.loads(asyncio.run(getattr(servicer, rpc)(request, context)).metadata)

    offer = MSGPackSerializer.dumps([b"g", b"p", 1.0, signature])
    assert call("rpc_offer", offer, _peer(1)) == [True, None]
    assert call("rpc_fetch", MSGPackSerializer.dumps([b"g", 1, protocol.payload_hash(b"p")]), _peer(2)) == [True, b"p"]
    assert call("rpc_offer", offer, _peer(9))[1] == "a message from a peer that is no other member of the group"
    assert call("rpc_offer", b"\xc1garbage", _peer(1)) == [False, "an unreadable message"]
    assert call("rpc_confirm", MSGPackSerializer.dumps([b"g", 5]), _peer(1))[0] is False
    assert call("rpc_fetch", MSGPackSerializer.dumps([b"g", 2, H1]), _peer(1))[0] is False
    assert "refused offer from" in caplog.text


def test_contributors_are_every_member_up_to_the_limit_and_a_fair_choice_of_limit_beyond_it():
    members = [bytes([i]) * 38 for i in range(16)]
    assert protocol.contributors(b"g", members[:8], 8) == frozenset(range(8))
    assert protocol.contributors(b"g", members, None) == frozenset(range(16))
    chosen = [protocol.contributors(b"round %d" % r, members, 4) for r in range(400)]
    assert all(len(c) == 4 for c in chosen)
    assert chosen[0] == frozenset({3, 6, 8, 9})  # (pinned: every peer of this rule chooses alike)
    assert {15 - m for m in protocol.contributors(b"round 0", members[::-1], 4)} == chosen[0]  # (by id, not order)
    times = [sum(m in c for c in chosen) for m in range(16)]
    assert min(times) > 60 and max(times) < 140, times  # (each about 100 of 400 rounds: no member left out)
