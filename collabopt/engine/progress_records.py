"""The swarm's progress records and how a peer counts them: the arithmetic of :mod:`collabopt.engine.progress`.

Each training peer stores hivemind's ``LocalTrainingProgress`` under ``<run_id>_progress``, subkey its Ed25519 key
(:mod:`collabopt.engine.record_signing`; :class:`ProgressSchema`): hivemind's fields, so that a plain hivemind node
decodes them too.
:func:`count_progress` turns the records fetched into :class:`SwarmProgress`, a peer's view of the swarm; the other
functions prepare the records first (no extrapolation of idle peers, this peer's own count as it is now, capped
claims). Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from hivemind.dht.schema import SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils.timed_storage import ValueWithExpiration
from pydantic.v1 import BaseModel

from collabopt.engine.record_signing import BytesWithOwner, Ed25519SignatureValidator
from collabopt.robust import cap_progress_claims

__all__ = ["FetchPeriods", "LocalTrainingProgress", "ProgressSchema", "SwarmProgress", "capped_records",
           "count_progress", "newest_time_per_peer", "progress_validators", "records_not_older_than",
           "with_own_progress"]

logger = logging.getLogger(__name__)


class ProgressSchema(BaseModel):
    """``<run_id>_progress``: each peer's ``LocalTrainingProgress`` (None once it left) under a subkey that names its
    Ed25519 key. hivemind's ``TrainingProgressSchema`` has the same field under an RSA owner."""

    progress: dict[BytesWithOwner, LocalTrainingProgress | None]


def progress_validators(prefix: str, seed: bytes | None = None) -> list:
    """What a peer's DHT checks ``<prefix>_progress`` with: :class:`ProgressSchema`, and signed by the owner its subkey
    names; the last one signs this peer's records (the key of the 32-byte ``seed``; None: this process's key)."""
    return [SchemaValidator(ProgressSchema, prefix=prefix), Ed25519SignatureValidator(seed)]


@dataclasses.dataclass
class SwarmProgress:
    """A peer's view of the swarm: the epoch, the samples counted toward it, and when to look again (DHT times)."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int
    num_clients: int
    eta_next_epoch: float
    next_fetch_time: float


@dataclasses.dataclass(frozen=True)
class FetchPeriods:
    """How often a peer fetches the records (seconds): ``default`` while it finds none; otherwise its ETA to the next
    epoch, shortened for the peers that may join meanwhile (``drift_peers`` or ``drift_rate`` of the swarm), within
    ``[minimum, maximum]``."""

    minimum: float
    maximum: float
    default: float
    drift_peers: float
    drift_rate: float


def count_progress(records: Any, *, local: Any, target_batch_size: int, rate: float, eps: float,
                   periods: FetchPeriods, now: float, name: str = "", loglevel: int = logging.DEBUG) -> SwarmProgress:
    """The swarm's progress in ``records`` (subkey -> ``ValueWithExpiration`` of a record dict, or None), counted as
    hivemind 1.1.12's tracker counts it, so that peers of either count alike.

    The epoch is the largest of ``local.epoch`` and the training peers' records; samples are summed over the records
    at that epoch, the rates over all records (peers behind catch up soon). The ETA extrapolates each record from its
    ``time`` at its rate. With no record, this peer's own count and ``rate`` give the ETA."""
    if not isinstance(records, dict) or not records:
        logger.log(loglevel, f"Found no active peers: {records}")
        eta = max(0, target_batch_size - local.samples_accumulated) / rate
        return SwarmProgress(local.epoch, local.samples_accumulated, target_batch_size, num_peers=0, num_clients=0,
                             eta_next_epoch=now + eta, next_fetch_time=now + periods.default)
    peers = [LocalTrainingProgress.parse_obj(record.value) for record in records.values() if record.value is not None]
    num_peers = len(peers)
    epoch = max([local.epoch] + [peer.epoch for peer in peers if not peer.client_mode])
    samples, estimated, total_rate = 0, 0.0, eps
    for peer in peers:
        total_rate += peer.samples_per_second
        if peer.epoch == epoch:
            samples += peer.samples_accumulated
            estimated += peer.samples_accumulated + max(0.0, now - peer.time) * peer.samples_per_second
    eta = max(0, target_batch_size - estimated) / total_rate
    expected_max_peers = max(num_peers + periods.drift_peers, num_peers * (1 + periods.drift_rate))
    to_next_fetch = float(min(max(eta * num_peers / expected_max_peers, periods.minimum), periods.maximum))
    logger.log(loglevel, f"{name} accumulated {samples} samples for epoch #{epoch} from {num_peers} peers. "
                         f"ETA {eta:.2f} sec (refresh in {to_next_fetch:.2f} sec)")
    return SwarmProgress(epoch, samples, target_batch_size, num_peers=num_peers,
                         num_clients=sum(peer.client_mode for peer in peers), eta_next_epoch=now + eta,
                         next_fetch_time=now + to_next_fetch)


def _record_time(record: Any) -> float | None:
    """The ``time`` of a progress record (a ``ValueWithExpiration`` of a dict); None for anything else (a goodbye, a
    record the count skips)."""
    value = getattr(record, "value", None)
    stamp = value.get("time") if isinstance(value, dict) else None
    return stamp if isinstance(stamp, float) else None


def newest_time_per_peer(records: dict) -> tuple[float, ...]:
    """The ``time`` of each peer's newest record (by the record's ``peer_id``). A peer restarted with its identity
    stores its record under a new key (records are signed with a key made per process), and the dead process's
    record stays until it expires: counted apart, it made the peer look present twice (docs/decisions.md, "Group
    size hint"). Only the times are merged: the records themselves all count, as a record's ``peer_id`` is not bound
    to its signer."""
    newest: dict[Any, float] = {}
    for key, record in records.items():
        stamp = _record_time(record)
        if stamp is not None:
            peer = record.value.get("peer_id")
            peer = peer if isinstance(peer, (bytes, str)) else key
            newest[peer] = max(stamp, newest.get(peer, stamp))
    return tuple(newest.values())


def records_not_older_than(records: dict, oldest: float) -> dict:
    """The records with each ``time`` at least ``oldest`` (copies where it was older): a record is extrapolated from
    ``oldest`` at most. Anything else is kept as it was (the count skips what it cannot read)."""
    kept = {}
    for key, record in records.items():
        stamp = _record_time(record)
        if stamp is not None and stamp < oldest:
            record = ValueWithExpiration(dict(record.value, time=oldest), record.expiration_time)
        kept[key] = record
    return kept


def with_own_progress(records: dict, own_key: bytes, local: Any, now: float) -> dict:
    """The records, with this peer's own (under ``own_key``, where the DHT had one) replaced by ``local`` (its
    ``LocalTrainingProgress`` now) at time ``now``; without a stored record none is made up (a peer far behind
    stores none)."""
    if own_key not in records or getattr(records[own_key], "value", None) is None:
        return records
    return {**records, own_key: ValueWithExpiration(dict(local.dict(), time=now), records[own_key].expiration_time)}


def capped_records(records: dict, local_epoch: int, own_peer_id: bytes) -> dict:
    """The records as :func:`collabopt.robust.cap_progress_claims` lets them count. A record the schema does not
    read counts nothing (the count would refuse it too): none is let through uncapped."""
    readable: dict[Any, tuple[Any, dict]] = {}
    for key, record in records.items():
        with contextlib.suppress(Exception):  # (a goodbye, None, or a malformed record)
            readable[key] = (record, LocalTrainingProgress.parse_obj(record.value).dict())
    kept = cap_progress_claims([value for _, value in readable.values()], local_epoch, own_peer_id)
    return {key: ValueWithExpiration(value, record.expiration_time)
            for (key, (record, _)), value in zip(readable.items(), kept, strict=True) if value is not None}
