"""collabopt's Ed25519 record signatures (collabopt/engine/record_signing.py): which records are refused, which pass
untouched, and that the validator pickles (hivemind sends validators to its DHT's process)."""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.optim.progress_tracker import TrainingProgressSchema
from hivemind.utils import MSGPackSerializer

from collabopt.engine import record_signing
from collabopt.engine.progress_records import progress_validators
from collabopt.engine.record_signing import Ed25519SignatureValidator
from collabopt.engine.records import metrics_validators

KEY_ID = DHTID.generate(source="run_metrics").to_bytes()
ALICE, MALLORY = os.urandom(32), os.urandom(32)


def owner(seed: bytes) -> bytes:
    return Ed25519SignatureValidator(seed).local_public_key


def signed_by(seed: bytes, subkey: bytes, value: bytes = b"v", expiration: float = 1e10, key: bytes = KEY_ID) -> bytes:
    """``value`` with a signature by ``seed``'s key, whatever owner ``subkey`` names."""
    payload = MSGPackSerializer.dumps(dataclasses.astuple(DHTRecord(key, subkey, value, expiration)))
    signature = base64.b64encode(Ed25519PrivateKey.from_private_bytes(seed).sign(payload))
    return value + record_signing.SIGNATURE_FORMAT.replace(b"_value_", signature)


def marker(text: bytes) -> bytes:
    return record_signing.OWNER_FORMAT.replace(b"_key_", text)


BAD_OWNERS = {
    "not base64": marker(b"not-a-key!"),
    "31 bytes": marker(base64.b64encode(b"k" * 31)),
    "33 bytes": marker(base64.b64encode(b"k" * 33)),
    "not canonical base64": marker(base64.b64encode(b"k" * 32)[:-2] + b"B="),
    "of 10 kB": marker(b"A" * 10_000),
}


def alias(seed: bytes) -> bytes:
    """``seed``'s owner marker with a spare bit of its base64 set: the same 32 bytes, not their canonical text."""
    text = owner(seed)[len(b"[ed25519:"):-1]
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    other = text[:42] + bytes([alphabet[alphabet.index(text[42]) ^ 1]]) + b"="
    assert other != text and base64.b64decode(other) == base64.b64decode(text)
    return marker(other)


IDENTITY = b"\x01" + bytes(31)  # the neutral point's encoding: a key of small order
FORGED = b"v" + record_signing.SIGNATURE_FORMAT.replace(b"_value_", base64.b64encode(IDENTITY + bytes(32)))  # R=O, S=0
CASES = {  # name: (key, subkey, value, expiration to validate at), whether valid
    "signed by its owner": ((KEY_ID, owner(ALICE), signed_by(ALICE, owner(ALICE)), 1e10), True),
    "unprotected, unsigned": ((KEY_ID, b"plain", b"v", 1e10), True),
    "unprotected, no subkey": ((KEY_ID, None, b"v", 1e10), True),
    "signed by another key": ((KEY_ID, owner(ALICE), signed_by(MALLORY, owner(ALICE)), 1e10), False),
    "replayed with another expiration": ((KEY_ID, owner(ALICE), signed_by(ALICE, owner(ALICE)), 2e10), False),
    "value changed after signing": ((KEY_ID, owner(ALICE), b"w" + signed_by(ALICE, owner(ALICE))[1:], 1e10), False),
    "no signature": ((KEY_ID, owner(ALICE), b"v", 1e10), False),
    "two signatures": ((KEY_ID, owner(ALICE), signed_by(ALICE, owner(ALICE), signed_by(ALICE, owner(ALICE))),
                        1e10), False),
    "a signature that is not base64": ((KEY_ID, owner(ALICE), b"v[signature:!!]", 1e10), False),
    "key and subkey name two owners": ((KEY_ID + owner(MALLORY), owner(ALICE),
                                        signed_by(ALICE, owner(ALICE), key=KEY_ID + owner(MALLORY)), 1e10), False),
    "two owners in the subkey": ((KEY_ID, owner(ALICE) + owner(MALLORY),
                                  signed_by(ALICE, owner(ALICE) + owner(MALLORY)), 1e10), False),
    **{f"owner {name}": ((KEY_ID, bad, signed_by(ALICE, bad), 1e10), False) for name, bad in BAD_OWNERS.items()},
    "its owner's key in base64 that is not canonical": ((KEY_ID, alias(ALICE), signed_by(ALICE, alias(ALICE)), 1e10),
                                                        False),
    "a key of small order, with a signature made without a key": ((KEY_ID, marker(base64.b64encode(IDENTITY)), FORGED,
                                                                   1e10), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_which_records_are_valid(name):
    (key, subkey, value, expiration), valid = CASES[name]
    assert Ed25519SignatureValidator().validate(DHTRecord(key, subkey, value, expiration)) is valid


def test_it_signs_only_its_own_records_and_strips_the_signature():
    alice = Ed25519SignatureValidator(ALICE)
    mine = DHTRecord(KEY_ID, owner(ALICE), b"v", 1e10)
    signed = dataclasses.replace(mine, value=alice.sign_value(mine))
    assert signed.value == signed_by(ALICE, owner(ALICE))  # (Ed25519 signatures are deterministic)
    assert Ed25519SignatureValidator(MALLORY).validate(signed) and alice.strip_value(signed) == b"v"
    for other in (DHTRecord(KEY_ID, owner(MALLORY), b"v", 1e10), DHTRecord(KEY_ID, b"plain", b"v", 1e10),
                  DHTRecord(KEY_ID, None, b"v", 1e10)):
        assert alice.sign_value(other) == b"v"


def test_one_key_per_process_and_a_3x_smaller_record_than_rsa():
    assert Ed25519SignatureValidator().local_public_key == Ed25519SignatureValidator().local_public_key
    assert Ed25519SignatureValidator(ALICE).local_public_key != Ed25519SignatureValidator().local_public_key
    mine = DHTRecord(KEY_ID, MSGPackSerializer.dumps(owner(ALICE)), b"v" * 130, 1e10)
    rsa = RSASignatureValidator()
    theirs = DHTRecord(KEY_ID, MSGPackSerializer.dumps(rsa.local_public_key), b"v" * 130, 1e10)
    size = len(mine.subkey) + len(Ed25519SignatureValidator(ALICE).sign_value(mine))
    assert size < 300 and 3 * size < len(theirs.subkey) + len(rsa.sign_value(theirs))


def test_hivemind_rsa_records_pass_untouched_and_neither_validator_claims_the_others():
    rsa = RSASignatureValidator()
    theirs = DHTRecord(KEY_ID, rsa.local_public_key, b"v", 1e10)
    theirs = dataclasses.replace(theirs, value=rsa.sign_value(theirs))
    unsigned_rsa = DHTRecord(KEY_ID, rsa.local_public_key, b"v", 1e10)
    ours = Ed25519SignatureValidator(ALICE)
    assert ours.validate(theirs) and ours.validate(unsigned_rsa)  # (hivemind's to judge, where it runs)
    assert ours.sign_value(unsigned_rsa) == b"v" and ours.strip_value(theirs) == theirs.value
    mine = DHTRecord(KEY_ID, owner(ALICE), signed_by(ALICE, owner(ALICE)), 1e10)
    assert rsa.validate(mine) and rsa.strip_value(mine) == b"v"  # (hivemind strips the signature: see below)
    both = CompositeValidator([rsa, ours])  # a DHT with both: each record judged by its own validator
    assert both.validate(mine) and both.validate(theirs) and not both.validate(unsigned_rsa)
    assert both.strip_value(mine) == b"v" and both.strip_value(theirs) == b"v"


def test_a_plain_hivemind_node_decodes_a_progress_record_of_ours():
    """A plain hivemind peer's node may store one of our progress records before its tracker adds its validators;
    its reads strip the value with hivemind's validators and decode it: they must not fail (a read that failed never
    ended, and its state download hung)."""
    key_id = DHTID.generate(source="run_progress").to_bytes()
    progress = dict(peer_id=b"\x00\x24" + b"p" * 36, epoch=3, samples_accumulated=10, samples_per_second=5.0,
                    time=1e9, client_mode=False)
    record = DHTRecord(key_id, MSGPackSerializer.dumps(owner(ALICE)), MSGPackSerializer.dumps(progress), 1e10)
    signed = dataclasses.replace(record, value=Ed25519SignatureValidator(ALICE).sign_value(record))
    hivemind_peer = CompositeValidator([SchemaValidator(TrainingProgressSchema, prefix="run"), RSASignatureValidator()])
    assert MSGPackSerializer.loads(hivemind_peer.strip_value(signed)) == progress
    assert not hivemind_peer.validate(signed)  # (its schema wants an RSA owner: it stores ours only before it has one)
    assert CompositeValidator(progress_validators("run")).validate(signed)


def test_it_pickles_with_its_key_and_merges_into_one():
    alice = Ed25519SignatureValidator(ALICE)
    alice.sign_value(DHTRecord(KEY_ID, owner(ALICE), b"v", 1e10))  # (the key is built: it must not travel)
    copy = pickle.loads(pickle.dumps(alice))
    record = DHTRecord(KEY_ID, owner(ALICE), b"v", 1e10)
    assert copy.local_public_key == alice.local_public_key and copy.sign_value(record) == alice.sign_value(record)
    composite = CompositeValidator(progress_validators("run", seed=ALICE) + metrics_validators("run"))
    assert [type(v).__name__ for v in composite._validators].count("Ed25519SignatureValidator") == 1
    assert pickle.loads(pickle.dumps(composite)).sign_value(record) == alice.sign_value(record)


def test_a_peers_validators_refuse_a_malformed_owner_without_raising():
    for bad in BAD_OWNERS.values():
        record = DHTRecord(KEY_ID, MSGPackSerializer.dumps(bad), b"v" + b"[signature:c2ln]", 1e10)
        assert CompositeValidator(metrics_validators("run")).validate(record) is False
