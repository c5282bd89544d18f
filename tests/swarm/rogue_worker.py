"""A rogue process for the rogue-records test: a plain hivemind DHT node (no record validators, keys of its own) that
writes bad records under a run's keys, straight through hivemind's DHT protocol, to every node near the key and to
its own storage.

Usage: ``python tests/swarm/rogue_worker.py config.json`` (``run_id``, ``out``; ``INITIAL_PEERS`` in the
environment). Once the run's peers have published both their records, it writes, under ``<run_id>_progress`` and
under ``<run_id>_metrics`` each (every record under its own subkey, with a well-formed content that claims epoch
1,000,000 unless said otherwise):

====================  =====================================================================  ===============
name                  record                                                                 expected reason
====================  =====================================================================  ===============
garbage               the string "garbage" under the subkey ``b"rogue"``                     unsigned
unsigned              a well-formed record under a subkey that names no key                  unsigned
no_signature          under the rogue's own key, not signed                                  bad_signature
other_peer            under a real peer's subkey, signed with the rogue's key                bad_signature
not_a_key             under ``[ed25519:not-a-key]`` with a made-up signature                 bad_signature
rsa_signed            under the rogue's hivemind RSA key (``[owner:...]``), signed by it     unsigned
wrong_schema          signed by the rogue's own key, ``{"epoch": "lots"}``                   malformed
not_msgpack           signed by the rogue's own key, bytes that do not decode                malformed
oversized             signed by the rogue's own key, a well-formed record with a 100 kB id   oversized
====================  =====================================================================  ===============

and then, once ``<out>.phase2`` exists, one plain value (no subkeys) under ``<run_id>_progress`` (malformed).
``<out>.json``: what it wrote and, per DHT node it wrote to, how many records that node accepted or refused (answered
False), and which it did neither with (``failed``: no answer, or what the store raised).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from collabopt.engine.compat import versions
from collabopt.engine.record_signing import OWNER_FORMAT, SIGNATURE_FORMAT, Ed25519SignatureValidator
from collabopt.engine.records import _find_raw

EPOCH = 1_000_000


async def write_raw(items: list[tuple[str, str, object, bytes, float]], _dht, node) -> dict[str, dict]:
    """In the rogue's DHT process: store each (name, key, subkey or None, value bytes, expiration) as it is, on the
    nodes nearest to the key and locally; per node, how many it accepted or refused (answered False: a validator's
    rejection), and the names of those it did neither with (``failed``, with what happened: no answer, which
    hivemind's ``call_store`` gives on any error, or what the store raised)."""
    results: dict[str, dict] = {}
    for name, key, subkey, value, expiration in items:
        value = value() if callable(value) else value  # big values are made here: hivemind's pipe chokes on them
        key_id = DHTID.generate(source=key)
        node.protocol.storage.store(key_id, value, expiration, subkey=subkey)
        nearest = await node.find_nearest_nodes([key_id], k_nearest=16, exclude_self=True)
        for peer_id in nearest[key_id].values():
            counts = results.setdefault(peer_id.to_base58(), dict(accepted=0, refused=0, failed=[]))
            try:
                ok = await node.protocol.call_store(peer_id, [key_id], [value], [expiration],
                                                    subkeys=[subkey] if subkey is not None else None)
            except Exception as e:  # (not a refusal: the test fails on it)
                counts["failed"].append(f"{name}: {e!r}")
                continue
            if ok is None:  # the node answered with an error (or not at all): not a refusal either
                counts["failed"].append(f"{name}: no answer")
            else:
                counts["accepted" if ok[0] else "refused"] += 1
    return results


def signed(seed: bytes, key_id: bytes, subkey: bytes, value: bytes, expiration: float) -> bytes:
    """``value`` signed as collabopt's Ed25519SignatureValidator signs, with the key of ``seed`` (whatever key the
    subkey names)."""
    record = DHTRecord(key_id, MSGPackSerializer.dumps(subkey), value, expiration)
    signature = Ed25519PrivateKey.from_private_bytes(seed).sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return value + SIGNATURE_FORMAT.replace(b"_value_", base64.b64encode(signature))


def owner_subkey(seed: bytes) -> bytes:
    return Ed25519SignatureValidator(seed).local_public_key


def rsa_signed(key_id: bytes, value: bytes, expiration: float) -> tuple[bytes, bytes]:
    """A subkey that names this process's hivemind RSA key, and ``value`` signed by it as hivemind signs."""
    rsa = RSASignatureValidator()
    record = DHTRecord(key_id, MSGPackSerializer.dumps(rsa.local_public_key), value, expiration)
    return rsa.local_public_key, rsa.sign_value(record)


def claims(kind: str, owner: PeerID, **changes) -> dict:
    """A well-formed record of ``kind`` that claims the swarm is at epoch 1,000,000."""
    now = get_dht_time()
    if kind == "progress":
        record = dict(peer_id=owner.to_bytes(), epoch=EPOCH, samples_accumulated=10**9,
                      samples_per_second=1e9, time=now, client_mode=False)
    else:
        record = dict(peer_id=owner.to_base58(), time=now, interval=2.0, epoch=EPOCH, global_epoch=EPOCH,
                      samples_per_second=1e9, samples_reported=10**9, samples_skipped=0, nonfinite_steps=0,
                      target_batch_size=1, loss=0.0, losses_reported=1, nonfinite_losses=0, client_mode=False,
                      relayed=False, auxiliary=False, **{f"{k}_version": v for k, v in versions().items()})
    record.update(changes)
    return record


def oversized(kind: str, owner: bytes, key: bytes, key_id: bytes, subkey: bytes, expiration: float) -> bytes:
    """A well-formed record of ``kind`` with a 100 kB peer id, signed with ``key``."""
    huge = claims(kind, PeerID(owner), peer_id=(b"x" if kind == "progress" else "x") * 100_000)
    return signed(key, key_id, subkey, MSGPackSerializer.dumps(huge), expiration)


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    out, run_id = cfg["out"], cfg["run_id"]
    logging.getLogger("hivemind.dht.protocol").setLevel(logging.DEBUG)  # why a store failed, in the log
    dht = hivemind.DHT(initial_peers=os.environ["INITIAL_PEERS"].split(","), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       start=True)
    keys = {"progress": f"{run_id}_progress", "metrics": f"{run_id}_metrics"}
    deadline = time.monotonic() + cfg.get("max_seconds", 90)
    real: dict[str, bytes] = {}
    while len(real) < 2 and time.monotonic() < deadline:  # a real peer's subkey under each key
        found = dht.run_coroutine(functools.partial(_find_raw, list(keys.values()), 16))
        for kind, key in keys.items():
            for _source, subkey, *_ in found[key]["records"]:
                subkey = MSGPackSerializer.loads(subkey) if subkey else None
                if isinstance(subkey, bytes) and subkey.startswith(OWNER_FORMAT.split(b"_key_")[0]):
                    real[kind] = subkey
        time.sleep(0.5)
    assert len(real) == 2, "the peers' records did not show up"

    expiration = get_dht_time() + 600  # later than any real record: it wins wherever it is stored
    written, items = [], []
    for kind, key in keys.items():
        key_id = DHTID.generate(source=key).to_bytes()
        own = [os.urandom(32) for _ in range(4)]
        fake_signature = SIGNATURE_FORMAT.replace(b"_value_", b"c2lnbmF0dXJl")
        good = MSGPackSerializer.dumps(claims(kind, dht.peer_id))
        records = [
            ("garbage", b"rogue", MSGPackSerializer.dumps("garbage"), "unsigned"),
            ("unsigned", b"rogue-peer", good, "unsigned"),
            ("no_signature", owner_subkey(own[0]), good, "bad_signature"),
            ("other_peer", real[kind], signed(own[0], key_id, real[kind], good, expiration), "bad_signature"),
            ("not_a_key", OWNER_FORMAT.replace(b"_key_", b"not-a-key"), good + fake_signature, "bad_signature"),
            ("rsa_signed", *rsa_signed(key_id, good, expiration), "unsigned"),
            ("wrong_schema", owner_subkey(own[1]),
             signed(own[1], key_id, owner_subkey(own[1]), MSGPackSerializer.dumps({"epoch": "lots"}), expiration),
             "malformed"),
            ("not_msgpack", owner_subkey(own[2]),
             signed(own[2], key_id, owner_subkey(own[2]), b"\xc1\xc1\xc1", expiration), "malformed"),
        ]
        records.append(("oversized", owner_subkey(own[3]), functools.partial(
            oversized, kind, dht.peer_id.to_bytes(), own[3], key_id, owner_subkey(own[3]), expiration), "oversized"))
        for name, subkey, value, reason in records:
            items.append((f"{kind}/{name}", key, subkey, value, expiration))
            written.append(dict(kind=kind, name=name, reason=reason))
    stores = dht.run_coroutine(functools.partial(write_raw, items))
    result = dict(peer_id=dht.peer_id.to_base58(), written=written, stores=stores, written_at=get_dht_time())
    Path(out + ".json.tmp").write_text(json.dumps(result))
    os.replace(out + ".json.tmp", out + ".json")

    while not Path(out + ".phase2").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    plain = MSGPackSerializer.dumps(claims("progress", dht.peer_id))
    # a plain value replaces a dictionary only with a later expiration than the dictionary's newest record
    plain_item = ("progress/plain", keys["progress"], None, plain, expiration + 300)
    phase2 = dht.run_coroutine(functools.partial(write_raw, [plain_item]))
    result.update(phase2=phase2, phase2_at=get_dht_time())
    Path(out + ".json.tmp").write_text(json.dumps(result))
    os.replace(out + ".json.tmp", out + ".json")
    while not Path(out + ".stop").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
