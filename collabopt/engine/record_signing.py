"""Signed DHT records of collabopt's own: each peer's records sit under a subkey that names its Ed25519 key
(``[ed25519:<base64 of the 32-byte public key>]``), and their values end with its signature
(``[signature:<base64 of the 64-byte signature>]``).

Rules, and why:

* :class:`Ed25519SignatureValidator` keeps the semantics of hivemind's ``RSASignatureValidator``: a record whose key
  or subkey names an owner must carry exactly one signature, by that owner, over the msgpack of (key, subkey, value
  without the signature, expiration); key and subkey naming two owners, an owner that is not a 32-byte key (in
  canonical base64) and a missing or bad signature are refused (never raised). Records that name no Ed25519 owner
  pass untouched, hivemind's RSA-marked ones (``[owner:...]``) included: the owner markers differ, so neither
  validator claims the other's records.
* The signature marker is hivemind's own (``[signature:...]``), so that a plain hivemind node strips it before it
  decodes a value: a node that stored a record of ours (one that came before its own validators) decodes it on its
  next read. Under a marker of our own that read would fail to decode the value and never end, holding its progress
  tracker's lock: the node's state download would hang. This validator strips only records that name an Ed25519
  owner, and runs before hivemind's (a higher priority) where a DHT has both.
* Why not RSA: hivemind's key is a 391-byte ssh-rsa text and its signature 344 bytes of base64, so a 130-byte
  progress record signed with RSA takes 877 bytes, and every read of the progress key answers with every peer's
  record. Ed25519's markers take 54 and 100 bytes: 286 bytes a record. See docs/decisions.md, "Records signed with
  Ed25519".
* One key per process (as hivemind's ``RSAPrivateKey.process_wide()``): every record of a peer names the same owner.
  The validator keeps the raw 32-byte seed and rebuilds the key where it is needed: hivemind pickles validators into
  its DHT's process, and a ``cryptography`` key does not pickle.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import os
import re
import threading
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.dht.schema import conbytes
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

OWNER_FORMAT = b"[ed25519:_key_]"
SIGNATURE_FORMAT = b"[signature:_value_]"  # hivemind's (see the module's rules)
OWNER_REGEX = re.escape(OWNER_FORMAT).replace(b"_key_", rb"(.+?)")
_OWNER_RE = re.compile(OWNER_REGEX)
_SIGNATURE_RE = re.compile(re.escape(SIGNATURE_FORMAT).replace(b"_value_", rb"(.+?)"))

BytesWithOwner = conbytes(regex=b".*" + OWNER_REGEX + b".*")  # a subkey that names an owner (pydantic schemas)

_process_seed: tuple[int, bytes] | None = None  # (pid, seed): a forked child makes a key of its own
_seed_lock = threading.Lock()


def process_wide_seed() -> bytes:
    """The 32-byte seed of this process's key, made on first use."""
    global _process_seed
    with _seed_lock:
        if _process_seed is None or _process_seed[0] != os.getpid():
            _process_seed = (os.getpid(), os.urandom(32))
        return _process_seed[1]


def owner_marker(public_key: bytes) -> bytes:
    """The marker that names the owner of the raw 32-byte ``public_key``."""
    return OWNER_FORMAT.replace(b"_key_", base64.b64encode(public_key))


def owners_in(data: bytes) -> list[bytes]:
    """The owners (base64 of their keys, as in the markers) that ``data`` names."""
    return _OWNER_RE.findall(data)


def _decode(text: bytes, length: int) -> bytes | None:
    """The ``length`` bytes that ``text`` is the canonical base64 of, or None."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == length and base64.b64encode(raw) == text else None


_P = 2**255 - 19  # the field of Curve25519
_ORDER_8_Y = int.from_bytes(bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"), "little")
_SMALL_ORDER_Y = frozenset({0, 1, _P - 1, _ORDER_8_Y, _P - _ORDER_8_Y})  # y of the 8 points with 8P = O


def _weak(raw: bytes) -> bool:
    """Whether the 32-byte key ``raw`` is a non-canonical encoding (y >= p) or one of the 8 points of small order.
    Under such a key the signature (R = O, S = 0) verifies for any message (OpenSSL refuses neither), so it names no
    owner: anyone could write under it."""
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    return y >= _P or y in _SMALL_ORDER_Y


def _public_key(owner: bytes) -> Ed25519PublicKey | None:
    """The key an owner marker names, or None: not 44 characters (checked before the cache, which keeps what it is
    given), not the canonical base64 of 32 bytes, or a weak key (:func:`_weak`)."""
    return _cached_public_key(owner) if len(owner) == 44 else None


@functools.lru_cache(maxsize=4096)
def _cached_public_key(owner: bytes) -> Ed25519PublicKey | None:
    raw = _decode(owner, 32)
    if raw is None or _weak(raw):
        return None
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return None


def _serialized(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps(dataclasses.astuple(record))


class Ed25519SignatureValidator(RecordValidatorBase):
    """Protects records whose key or subkey names an Ed25519 owner (see the module's rules), and signs this process's
    records (those under :attr:`local_public_key`, or under the key of ``seed``). Several instances merge into one
    (the first one's key signs)."""

    def __init__(self, seed: bytes | None = None):
        self._seed = process_wide_seed() if seed is None else bytes(seed)
        self._private_key: Ed25519PrivateKey | None = None
        public_key = self._signing_key().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.local_public_key = owner_marker(public_key)  # the subkey of this process's records

    def _signing_key(self) -> Ed25519PrivateKey:
        if self._private_key is None:
            self._private_key = Ed25519PrivateKey.from_private_bytes(self._seed)
        return self._private_key

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _private_key=None)  # (rebuilt from the seed on first use)

    def validate(self, record: DHTRecord) -> bool:
        owners = owners_in(record.key) + (owners_in(record.subkey) if record.subkey is not None else [])
        if not owners:
            return True  # not protected
        if len(set(owners)) > 1:
            return False
        public_key = _public_key(owners[0])
        signatures = _SIGNATURE_RE.findall(record.value)
        if public_key is None or len(signatures) != 1:
            return False
        signature = _decode(signatures[0], 64)
        if signature is None:
            return False
        try:
            public_key.verify(signature, _serialized(dataclasses.replace(record, value=self.strip_value(record))))
        except InvalidSignature:
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.local_public_key not in record.key and self.local_public_key not in (record.subkey or b""):
            return record.value
        signature = base64.b64encode(self._signing_key().sign(_serialized(record)))
        return record.value + SIGNATURE_FORMAT.replace(b"_value_", signature)

    def strip_value(self, record: DHTRecord) -> bytes:
        if not owners_in(record.key) and not owners_in(record.subkey or b""):
            return record.value  # not ours: another validator's signature, if any, stays
        return _SIGNATURE_RE.sub(b"", record.value)

    @property
    def priority(self) -> int:
        return 11  # before the validators that parse the value (higher runs first), and before hivemind's RSA one

    def merge_with(self, other: Any) -> bool:
        return isinstance(other, Ed25519SignatureValidator)
