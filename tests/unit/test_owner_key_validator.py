"""A record naming an owner that is not a public key is refused (an answer of False), not an error in the storing
node's handler (hivemind's RSASignatureValidator raises on it)."""

from __future__ import annotations

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from collabopt.engine.records import OwnerKeyValidator, metrics_validators

KEY_ID = DHTID.generate(source="run_metrics").to_bytes()
NOT_A_KEY = b"[owner:not-a-key]"
SIGNATURE = RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", b"c2lnbmF0dXJl")


def owner(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def test_an_owner_that_is_not_a_key_is_refused():
    validator = OwnerKeyValidator()
    assert not validator.validate(DHTRecord(KEY_ID, NOT_A_KEY, b"v" + SIGNATURE, 1e10))
    assert not validator.validate(DHTRecord(KEY_ID + NOT_A_KEY, b"s", b"v", 1e10))
    assert validator.validate(DHTRecord(KEY_ID, owner(RSAPrivateKey()), b"v", 1e10))  # (the signature: not here)
    assert validator.validate(DHTRecord(KEY_ID, b"plain", b"v", 1e10))
    assert validator.merge_with(OwnerKeyValidator())


def test_a_peers_validators_answer_false_where_hivemind_alone_raises():
    record = DHTRecord(KEY_ID, NOT_A_KEY, b"v" + SIGNATURE, 1e10)
    with pytest.raises(ValueError):
        CompositeValidator([RSASignatureValidator()]).validate(record)
    assert CompositeValidator(metrics_validators("run")).validate(record) is False
