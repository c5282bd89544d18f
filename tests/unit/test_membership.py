"""collabopt.membership: the swarm key, member tokens, and the DHT authorizer on hivemind's real DHT messages."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hivemind.proto import dht_pb2

from collabopt.membership import (
    DHT_REQUEST,
    DHT_RESPONSE,
    KEY_BYTES,
    MEMBER,
    WINDOW,
    MemberToken,
    SwarmKey,
    SwarmKeyAuthorizer,
    _message_mac,
    member_token_refusal,
    new_swarm_key,
)

RUN = "trust_run"
ALICE, BOB = b"\x00\x24alice-peer-id", b"\x00\x24bob-peer-id"
NOW = 1_800_000_000.0


def test_a_new_key_is_256_random_bits_as_text_and_a_bad_one_is_refused_by_name():
    keys = {new_swarm_key() for _ in range(20)}
    assert len(keys) == 20
    for text in keys:
        assert text.isascii() and text.strip() == text and len(text) >= 43
        SwarmKey(text + "\n")  # (as read from a key file)
    for bad in ("", "secret", new_swarm_key()[:20], "not base64 at all! " * 4, "é" * 50):
        with pytest.raises(ValueError, match="swarm_key"):
            SwarmKey(bad)
    key_text = new_swarm_key()
    assert key_text not in repr(SwarmKey(key_text)) and key_text not in str(SwarmKey(key_text))
    assert KEY_BYTES == 32


def test_each_use_has_its_own_sub_key():
    key, other = SwarmKey(new_swarm_key()), SwarmKey(new_swarm_key())
    derived = [key.derive(label) for label in (DHT_REQUEST, DHT_RESPONSE, MEMBER)]
    assert len(set(derived)) == 3
    key_text = new_swarm_key()
    assert SwarmKey(key_text).derive(MEMBER) == SwarmKey(key_text + "\n").derive(MEMBER)  # (the same on every member)
    assert other.derive(MEMBER) != key.derive(MEMBER)


def test_a_token_makes_its_own_peer_a_member_until_it_expires():
    key = SwarmKey(new_swarm_key())
    token = MemberToken.issue(key, RUN, ALICE, lifetime=600, now=NOW)
    assert member_token_refusal(key, RUN, token, ALICE, now=NOW) is None
    assert member_token_refusal(key, RUN, token, ALICE, now=NOW + 599) is None
    assert "expired" in member_token_refusal(key, RUN, token, ALICE, now=NOW + 600)
    # through a gather: bytes and back
    assert MemberToken.from_bytes(token.to_bytes()) == token
    for junk in (b"", b"x" * 40, "text", None, 5):
        with pytest.raises(ValueError):
            MemberToken.from_bytes(junk)


def test_a_token_is_bound_to_its_peer_its_run_and_the_key():
    key = SwarmKey(new_swarm_key())
    token = MemberToken.issue(key, RUN, ALICE, now=NOW)
    # Bob presents Alice's token (copied from her gather): not his
    assert "another peer" in member_token_refusal(key, RUN, token, BOB, now=NOW)
    # Bob rewrites it with his peer id: the MAC no longer matches
    forged = dataclasses.replace(token, peer_id=BOB)
    assert "key" in member_token_refusal(key, RUN, forged, BOB, now=NOW)
    # or extends its expiry
    assert "key" in member_token_refusal(key, RUN, dataclasses.replace(token, expires=token.expires + 1e6), ALICE,
                                         now=NOW)
    # another run, another key
    assert "key" in member_token_refusal(key, "other_run", token, ALICE, now=NOW)
    assert "key" in member_token_refusal(SwarmKey(new_swarm_key()), RUN, token, ALICE, now=NOW)
    outsider = MemberToken.issue(SwarmKey(new_swarm_key()), RUN, BOB, now=NOW)
    assert "key" in member_token_refusal(key, RUN, outsider, BOB, now=NOW)


class Clock:
    def __init__(self, now: float = NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def store_request() -> dht_pb2.StoreRequest:
    return dht_pb2.StoreRequest(keys=[b"k" * 20], subkeys=[b""], values=[b"value"], expiration_time=[NOW + 100],
                                in_cache=[False], peer=dht_pb2.NodeInfo(node_id=b"n" * 20))


def signed(authorizer: SwarmKeyAuthorizer) -> dht_pb2.StoreRequest:
    request = store_request()
    asyncio.run(authorizer.sign_request(request, None))
    return request


def copy(message):
    other = type(message)()
    other.CopyFrom(message)
    return other


def validates(authorizer: SwarmKeyAuthorizer, request) -> bool:
    return asyncio.run(authorizer.validate_request(copy(request)))


def test_a_member_accepts_a_members_request_once_and_refuses_others():
    text, clock = new_swarm_key(), Clock()
    alice, bob = SwarmKeyAuthorizer(SwarmKey(text), clock=clock), SwarmKeyAuthorizer(SwarmKey(text), clock=clock)
    request = signed(alice)
    assert validates(bob, request)
    assert not validates(bob, request)  # replayed
    assert validates(bob, signed(alice))  # a new request: a new nonce
    # a request with another key, or with none (hivemind's DHT without an authorizer sends no auth at all)
    assert not validates(bob, signed(SwarmKeyAuthorizer(SwarmKey(new_swarm_key()), clock=clock)))
    assert not validates(bob, store_request())
    # a member's request altered on its way (another value), or its nonce changed to replay it
    tampered = signed(alice)
    tampered.values[0] = b"other value"
    assert not validates(bob, tampered)
    renonced = copy(request)
    renonced.auth.nonce = b"n" * 16
    assert not validates(bob, renonced)


def test_a_request_outside_the_time_window_is_refused():
    text = new_swarm_key()
    receiver = SwarmKeyAuthorizer(SwarmKey(text), clock=Clock())
    for offset, accepted in ((-WINDOW - 1, False), (WINDOW + 1, False), (-WINDOW + 1, True), (WINDOW - 1, True)):
        request = signed(SwarmKeyAuthorizer(SwarmKey(text), clock=Clock(NOW + offset)))
        assert validates(receiver, request) is accepted, offset


def test_a_replay_is_refused_for_as_long_as_the_window_would_pass_it():
    text, clock = new_swarm_key(), Clock()
    receiver = SwarmKeyAuthorizer(SwarmKey(text), clock=clock)
    request = signed(SwarmKeyAuthorizer(SwarmKey(text), clock=Clock(NOW + WINDOW - 1)))  # (a clock ahead)
    assert validates(receiver, request)
    for step in (WINDOW, 2 * WINDOW - 2):  # the window passes it until NOW + 2 WINDOW - 1
        clock.now = NOW + step
        assert not validates(receiver, request), step
    clock.now = NOW + 10 * WINDOW  # long after: the window refuses it, and its nonce is forgotten
    assert not validates(receiver, request)
    assert validates(receiver, signed(SwarmKeyAuthorizer(SwarmKey(text), clock=clock)))
    assert len(receiver._nonces) == 1


def test_a_member_accepts_only_a_members_answer_to_its_own_request():
    text = new_swarm_key()
    alice, bob = SwarmKeyAuthorizer(SwarmKey(text)), SwarmKeyAuthorizer(SwarmKey(text))
    outsider = SwarmKeyAuthorizer(SwarmKey(new_swarm_key()))
    request, other_request = signed(alice), signed(alice)

    def answer(authorizer: SwarmKeyAuthorizer | None, to) -> dht_pb2.StoreResponse:
        response = dht_pb2.StoreResponse(store_ok=[True], peer=dht_pb2.NodeInfo(node_id=b"b" * 20))
        if authorizer is not None:
            asyncio.run(authorizer.sign_response(response, to))
        return response

    def accepted(response, to) -> bool:
        return asyncio.run(alice.validate_response(copy(response), to))

    assert accepted(answer(bob, request), request)
    assert not accepted(answer(outsider, request), request)
    assert not accepted(answer(None, request), request)  # (a node without an authorizer)
    assert not accepted(answer(bob, other_request), request)  # an answer to another request
    lying = answer(bob, request)
    lying.store_ok[0] = False
    assert not accepted(lying, request)
    # a proof made with the request's sub-key is no answer's proof
    crossed = answer(None, request)
    crossed.auth.nonce = request.auth.nonce
    crossed.auth.signature = _message_mac(SwarmKey(text).derive(DHT_REQUEST), crossed)
    assert not accepted(crossed, request)
