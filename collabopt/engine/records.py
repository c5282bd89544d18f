"""The run's records on the DHT: their schemas, the validators peers store them with, and a reader that checks
every record on its own.

Each peer keeps two records under the run's keys, each under a subkey that names the peer's Ed25519 key and signed
with it (:mod:`collabopt.engine.record_signing`): its progress (hivemind's ``LocalTrainingProgress``, under
``<run_id>_progress``) and its metrics (:mod:`collabopt.metrics`, under ``<run_id>_metrics``); with
``aggregation="centered_clip"`` a third, its vote for the parameters it holds (:mod:`collabopt.engine.download_votes`,
under ``<run_id>_fingerprints``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer
from pydantic.v1 import StrictBool, StrictFloat, confloat, conint, conlist, constr, create_model

from collabopt.engine.record_signing import BytesWithOwner, Ed25519SignatureValidator, owners_in


def reader_validators() -> list:
    """Validators for a DHT that serves a run's records without training (the demo's bootstrap DHT): it refuses to
    store a record under a peer's key that this peer did not sign.

    Readers do not need them: :func:`read_run_records` checks every record itself.
    """
    return [Ed25519SignatureValidator()]


MAX_RECORD_BYTES = 4096  # a progress record takes ~0.3 kB signed, a metrics record ~0.6 kB: bigger ones are refused
_MAX_ENTRIES_PER_SOURCE = 2048  # records read from one DHT node per key (the rest are counted as oversized)
_K_NEAREST = 16  # DHT nodes asked for a key (hivemind stores each record on the 5 nearest)


@functools.lru_cache(maxsize=1)
def _record_models() -> dict[str, Any]:
    """The pydantic (v1, as hivemind uses) models of the per-peer records, built on first use (they import hivemind).

    ``PeerMetrics`` is a peer's metrics record (see :mod:`collabopt.metrics`): strict types and bounded strings, and
    finite numbers only (hivemind's schema check compares the parsed value with the stored one, and NaN != NaN).
    """

    count = (conint(strict=True, ge=0), ...)
    name = (constr(strict=True, max_length=64), ...)
    metrics = create_model(
        "PeerMetrics", __module__=__name__,
        peer_id=name_of(128),
        time=(StrictFloat, ...),
        interval=(confloat(strict=True, gt=0.0, le=3600.0), ...),
        epoch=count, global_epoch=count,
        samples_per_second=(confloat(strict=True, ge=0.0), ...),
        samples_reported=count, samples_skipped=count, nonfinite_steps=count,
        target_batch_size=(conint(strict=True, ge=1), ...),
        loss=(StrictFloat | None, None),
        losses_reported=count, nonfinite_losses=count,
        last_round=(constr(strict=True, max_length=64) | None, None),  # RoundOutcome.summary() of its last round
        client_mode=(StrictBool, ...), relayed=(StrictBool, ...), auxiliary=(StrictBool, ...),
        collabopt_version=name, hivemind_version=name, torch_version=name, python_version=name,
    )
    schema = create_model("MetricsSchema", __module__=__name__,
                          metrics=(dict[BytesWithOwner, metrics | None], ...))
    # a peer's vote: the epoch of the state it serves and its parameters' fingerprint (collabopt.lineage)
    vote = create_model("ParameterVote", __module__=__name__, peer_id=name_of(128), epoch=count,
                        fingerprint=(conlist(StrictFloat, min_items=3, max_items=3), ...))
    votes = create_model("VotesSchema", __module__=__name__,
                         fingerprints=(dict[BytesWithOwner, vote | None], ...))
    return dict(progress=LocalTrainingProgress, metrics=metrics, PeerMetrics=metrics, MetricsSchema=schema,
                fingerprints=vote, ParameterVote=vote, VotesSchema=votes)


def __getattr__(name: str) -> Any:
    """``PeerMetrics``, ``MetricsSchema``, ``ParameterVote`` and ``VotesSchema`` (built on first use): pickle finds
    them here when hivemind sends a peer's validators to its DHT process."""
    if name in ("PeerMetrics", "MetricsSchema", "ParameterVote", "VotesSchema"):
        return _record_models()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def name_of(max_length: int) -> tuple[Any, Any]:
    """A required pydantic field: a string of 1 to ``max_length`` characters."""
    return (constr(strict=True, min_length=1, max_length=max_length), ...)


def metrics_fields() -> list[str]:
    """Names of the fields of a peer's metrics record."""
    return list(_record_models()["metrics"].__fields__)


def metrics_validators(run_id: str) -> list:
    """What a peer's DHT checks records under ``<run_id>_metrics`` with: signed by the Ed25519 key the subkey names,
    and the schema of :func:`metrics_fields` (as the progress tracker does for ``<run_id>_progress``)."""
    return [SchemaValidator(_record_models()["MetricsSchema"], prefix=run_id), Ed25519SignatureValidator()]


def votes_validators(run_id: str) -> list:
    """What a peer's DHT checks votes under ``<run_id>_fingerprints`` with (:mod:`collabopt.engine.download_votes`):
    signed by the key in the subkey, and their schema."""
    return [SchemaValidator(_record_models()["VotesSchema"], prefix=run_id), Ed25519SignatureValidator()]


class RecordSizeValidator(RecordValidatorBase):
    """Refuses records of more than ``max_bytes`` (subkey and signed value) under ``keys``; checked before the
    signature (cheaper). Several instances merge into one."""

    def __init__(self, keys: list[str], max_bytes: int):
        self.key_ids = {DHTID.generate(source=key).to_bytes() for key in keys}
        self.max_bytes = max_bytes

    def validate(self, record: Any) -> bool:
        return record.key not in self.key_ids or len(record.subkey) + len(record.value) <= self.max_bytes

    @property
    def priority(self) -> int:
        return 20  # the signatures' are 11 and 10: higher runs first on validation

    def merge_with(self, other: Any) -> bool:
        if not isinstance(other, RecordSizeValidator) or other.max_bytes != self.max_bytes:
            return False
        self.key_ids |= other.key_ids
        return True


async def _find_raw(keys: list[str], k_nearest: int, _dht: Any, node: Any) -> dict[str, Any]:
    """Runs in the DHT process: every record stored under ``keys`` as the nearest DHT nodes (and this one) hold
    it, unchecked, so that :func:`read_run_records` judges every record on its own (hivemind's get() drops a node's
    whole dictionary for one bad record). See docs/decisions.md, "Run records read raw, each checked on its own"."""
    serializer = node.protocol.serializer
    output: dict[str, Any] = {key: dict(records=[], bad_responses=0, sources=0) for key in keys}
    key_ids = {DHTID.generate(source=key): key for key in keys}

    def add(key: str, source: str, found: Any) -> None:
        if found is None:
            return
        records = output[key]["records"]

        def record(subkey: bytes | None, value: bytes, expiration: float) -> None:
            size = len(subkey or b"") + len(value)
            if size > MAX_RECORD_BYTES:  # refused anyway: only a fingerprint travels back (and fits hivemind's pipes)
                subkey = hashlib.sha256(subkey).digest() if subkey is not None else None
                value = hashlib.sha256(value).digest()
            records.append((source, subkey, value, float(expiration), size))

        value = found.value
        if isinstance(value, DictionaryDHTValue):
            for i, (subkey, entry) in enumerate(value.items()):
                if i >= _MAX_ENTRIES_PER_SOURCE:
                    record(b"", b"x" * (MAX_RECORD_BYTES + 1), entry.expiration_time)  # one more, counted oversized
                    break
                try:
                    subkey_bytes = serializer.dumps(subkey)
                except Exception:
                    subkey_bytes = b""
                record(subkey_bytes, bytes(entry.value), entry.expiration_time)
        elif isinstance(value, bytes):
            record(None, value, found.expiration_time)

    for key_id, key in key_ids.items():
        for storage in (node.protocol.storage, node.protocol.cache):
            add(key, "local", storage.get(key_id))

    nearest = await node.find_nearest_nodes(list(key_ids), k_nearest=k_nearest, exclude_self=True)

    async def ask(key_id: Any, peer_id: Any) -> None:
        key = key_ids[key_id]
        request = dht_pb2.FindRequest(keys=[key_id.to_bytes()], peer=node.protocol.node_info)
        try:
            response = await node.protocol.get_stub(peer_id).rpc_find(request, timeout=node.protocol.wait_timeout)
        except Exception:
            return  # no answer: not a record
        output[key]["sources"] += 1
        try:
            result = response.results[0]
            if result.type == dht_pb2.FOUND_DICTIONARY:
                found = serializer.loads(result.value)
                if not isinstance(found, DictionaryDHTValue):
                    raise TypeError(type(found).__name__)
                add(key, peer_id.to_base58(), _WithExpiration(found, result.expiration_time))
            elif result.type == dht_pb2.FOUND_REGULAR:
                add(key, peer_id.to_base58(), _WithExpiration(bytes(result.value), result.expiration_time))
        except Exception:
            output[key]["bad_responses"] += 1  # an answer that does not decode: a rogue node's

    await asyncio.gather(*(ask(key_id, peer_id) for key_id, peers in nearest.items()
                           for node_id, peer_id in peers.items() if node_id != node.node_id))
    return output


class _WithExpiration:
    def __init__(self, value: Any, expiration_time: float):
        self.value, self.expiration_time = value, expiration_time


@functools.lru_cache(maxsize=1)
def _signature_checker() -> Ed25519SignatureValidator:
    return Ed25519SignatureValidator()


def _check_record(key_id: bytes, subkey: bytes | None, value: bytes, expiration: float, model: Any,
                  size: int | None = None) -> tuple[str, bytes | None, Any]:
    """Judge one raw record (``size``: its size as stored, when ``subkey``/``value`` are fingerprints of a bigger
    one): ``("ok", owner key, parsed record or None for a peer that left)`` or ``(reason, None, None)`` with reason
    ``oversized`` / ``unsigned`` / ``bad_signature`` / ``malformed``."""
    if subkey is None:
        return "malformed", None, None  # one plain value where every peer keeps its own record
    if (size if size is not None else len(subkey) + len(value)) > MAX_RECORD_BYTES:
        return "oversized", None, None
    checker = _signature_checker()
    try:
        subkey_value = MSGPackSerializer.loads(subkey)
    except Exception:
        return "malformed", None, None
    owners = owners_in(subkey_value) if isinstance(subkey_value, bytes) else []
    if len(set(owners)) != 1:
        return "unsigned", None, None  # anyone may write under a subkey that names no key
    record = DHTRecord(key_id, subkey, value, expiration)
    if not checker.validate(record):  # (an owner that is not a key: refused too)
        return "bad_signature", None, None
    try:
        content = MSGPackSerializer.loads(checker.strip_value(record))
    except Exception:
        return "malformed", None, None
    if content is None:
        return "ok", owners[0], None  # what a peer stores when it leaves
    try:
        parsed = model.parse_obj(content)
        if parsed.dict() != content:  # as hivemind's SchemaValidator: no conversions, no extra fields
            raise ValueError("the record needs conversions")
    except Exception:
        return "malformed", None, None
    return "ok", owners[0], parsed


class RunRecords:
    """The records of a run read from the DHT: ``progress`` and ``metrics`` map each peer's key (bytes) to
    ``(record dict or None if it left, expiration time)``, the newest valid record of each peer;
    ``rejected`` holds ``(key, fingerprint, reason)`` of every record that failed its checks."""

    def __init__(self) -> None:
        self.progress: dict[bytes, tuple[dict | None, float]] = {}
        self.metrics: dict[bytes, tuple[dict | None, float]] = {}
        self.fingerprints: dict[bytes, tuple[dict | None, float]] = {}
        self.rejected: list[tuple[str, bytes, str]] = []
        self.sources = 0
        self.bad_responses = 0


def read_run_records(dht: Any, run_id: str, timeout: float = 10.0,
                     kinds: tuple[str, ...] = ("progress", "metrics")) -> RunRecords:
    """Read the progress records (hivemind's fields, written by :mod:`collabopt.engine.progress`) and metrics records
    (:mod:`collabopt.metrics`) of ``run_id`` (or the ``kinds`` named: attributes of :class:`RunRecords`) from the
    nearest DHT nodes, checking each record on its own: signed by the key its subkey names, within
    :data:`MAX_RECORD_BYTES`, matching its schema. Works with any DHT (no validators needed); a record that fails is
    left out and reported in :attr:`RunRecords.rejected`."""
    models = _record_models()
    names = {f"{run_id}_{kind}": kind for kind in kinds}
    result = RunRecords()
    try:
        raw = dht.run_coroutine(functools.partial(_find_raw, list(names), _K_NEAREST),
                                return_future=True).result(timeout=timeout)
    except FutureTimeout:
        return result
    for key, found in raw.items():
        kind = names[key]
        key_id = DHTID.generate(source=key).to_bytes()
        result.sources = max(result.sources, found["sources"])
        result.bad_responses += found["bad_responses"]
        newest = getattr(result, kind)
        seen: set[bytes] = set()
        for _source, subkey, value, expiration, size in found["records"]:
            fingerprint = hashlib.sha256(repr((key, subkey, value, expiration)).encode()).digest()[:16]
            if fingerprint in seen:
                continue  # the same record, held by another node too
            seen.add(fingerprint)
            reason, owner, parsed = _check_record(key_id, subkey, value, expiration, models[kind], size)
            if reason != "ok":
                result.rejected.append((kind, fingerprint, reason))
                continue
            if owner not in newest or newest[owner][1] < expiration:
                newest[owner] = (_plain(parsed.dict()) if parsed is not None else None, expiration)
    return result


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """A record with the peer id as text (progress records hold hivemind's PeerID bytes)."""
    peer_id = record.get("peer_id")
    if isinstance(peer_id, bytes):
        record = dict(record, peer_id=PeerID(peer_id).to_base58())
    return record


def read_progress_records(dht: Any, run_id: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The progress records of the peers of ``run_id`` that are training (hivemind's ``LocalTrainingProgress``, peer
    id as text), each checked on its own (see :func:`read_run_records`)."""
    records = read_run_records(dht, run_id, timeout).progress
    return [record for record, _expiration in records.values() if record is not None]
