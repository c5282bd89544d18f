"""Peers that start together with different models: each publishes its model's schema, and those not running the
swarm's model stop before their first round.

A late joiner finds another model in the state it downloads (:mod:`collabopt.model_check`). Peers that start
together have nothing to download: each would train alone (no group forms across schemas) and exit 0. So every peer
stores a signed record of its model under ``<run_id>_models`` (subkey: its progress records' key): the shape and
dtype of each of its tensors (parameters, then extra tensors) in order, as a table of distinct entries and an index
per tensor, and a digest of that list. Names are not part of it: averaging is by position, and a peer built from
``params=`` has none.

**The rule** (:func:`swarm_model`), computed alike by every peer from the same records: the peers counted are this
peer and the training peers with a progress record and a model record. The swarm's model is the digest held by the
most of them; on a tie, the one whose holders include the earliest ``started`` (the DHT time a peer's loop was
built: the peer that came first defines the swarm); then the smallest digest. A peer whose digest is not the
swarm's raises :class:`~collabopt.errors.ModelMismatchError` naming the first differing tensor and both shapes.

**When** (:meth:`ModelCheck.before_contribution`, called by each local step before it schedules a round): until its
first round, a peer looks at the records about once a second, and decides only when every peer with a progress
record has a model record too (a peer that started a moment later would otherwise be missed). Once the epoch's end
is within a ``matchmaking_time`` (where both modes schedule their round) it looks a last time, waiting for the
records, and decides on what it found. After that, or once its epoch moved (a round or a download), it never
checks again: a peer that took part in rounds is not stopped by records that come later. Its own record is renewed
while it trains, for the peers that start later.

**Hostile records.** Records are signed by their owner's key and checked against their schema and size; a record
whose table does not give its digest is ignored. Each key counts once, so one hostile record cannot outvote two
honest peers. A party that stores as many signed records as there are honest peers still in their first epoch, and
claims an earlier ``started``, stops them before their first round (keys are free without a ``swarm_key``); it
cannot stop a peer that has taken part in a round.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from hivemind.dht.schema import SchemaValidator
from hivemind.utils import MSGPackSerializer, get_dht_time
from pydantic.v1 import BaseModel, StrictFloat, conint, conlist, constr

from collabopt.engine.record_signing import BytesWithOwner
from collabopt.engine.records import MAX_RECORD_BYTES, RecordSizeValidator
from collabopt.engine.replicas import RIDE_ALONG
from collabopt.errors import ModelMismatchError
from collabopt.model_check import describe

logger = logging.getLogger(__name__)

POLL_PERIOD = 1.0  # seconds between two looks at the records before the last one
LAST_LOOK_TIMEOUT = 5.0  # seconds the last look waits for the records at most
VALUE_BUDGET = 3000  # bytes of a record's value (the subkey and signature take ~160 of MAX_RECORD_BYTES)
_MAX_SHAPES, _MAX_ORDER = 512, 4096


class ModelRecord(BaseModel):
    """A peer's model as it publishes it: ``shapes[order[i]]`` is tensor ``i``'s shape and dtype (``order`` may stop
    before ``count`` where the list does not fit a record), ``digest`` that of the whole list."""

    started: StrictFloat
    count: conint(strict=True, ge=0, le=10 ** 6)  # type: ignore[valid-type]
    digest: constr(strict=True, regex=r"^[0-9a-f]{32}$")  # type: ignore[valid-type]
    shapes: conlist(constr(strict=True, max_length=160), max_items=_MAX_SHAPES)  # type: ignore[valid-type]
    order: conlist(conint(strict=True, ge=0, lt=_MAX_SHAPES), max_items=_MAX_ORDER)  # type: ignore[valid-type]


class ModelsSchema(BaseModel):
    models: dict[BytesWithOwner, ModelRecord | None]


def schema_of(tensors: Sequence[Any]) -> list[str]:
    """Each tensor's shape and dtype, as the error writes them (``"(64, 16) torch.float32"``)."""
    return [describe(tensor) for tensor in tensors]


def digest_of(schema: Sequence[str]) -> str:
    return hashlib.sha256("\n".join([str(len(schema)), *schema]).encode()).hexdigest()[:32]


def make_record(schema: Sequence[str], started: float, budget: int = VALUE_BUDGET) -> dict[str, Any]:
    """This peer's record: the table and order of ``schema``, cut to the tensors that fit ``budget`` bytes."""
    listed = len(schema)
    while True:
        shapes: list[str] = []
        for entry in schema[:listed]:
            if entry not in shapes:
                shapes.append(entry)
        record = dict(started=float(started), count=len(schema), digest=digest_of(schema),
                      shapes=shapes, order=[shapes.index(entry) for entry in schema[:listed]])
        if (len(MSGPackSerializer.dumps(record)) <= budget and len(shapes) <= _MAX_SHAPES
                and listed <= _MAX_ORDER) or listed == 0:
            return record
        listed //= 2


def read_record(value: Any) -> tuple[str, float, list[str], int] | None:
    """``(digest, started, listed schema, count)`` of a record, or None for one to ignore: malformed, an index out of
    its table, or a complete list whose digest is another."""
    try:
        record = ModelRecord.parse_obj(value)
    except Exception:
        return None
    if any(index >= len(record.shapes) for index in record.order) or len(record.order) > record.count:
        return None
    listed = [record.shapes[index] for index in record.order]
    if len(listed) == record.count and digest_of(listed) != record.digest:
        return None
    return record.digest, record.started, listed, record.count


def swarm_model(holders: dict[Any, tuple[str, float]]) -> str | None:
    """The swarm's digest among ``holders`` (key -> ``(digest, started)``): the most holders, then the earliest
    ``started`` among them, then the smallest digest. None without holders."""
    groups: dict[str, list[float]] = {}
    for digest, started in holders.values():
        groups.setdefault(digest, []).append(started)
    if not groups:
        return None
    return min(groups, key=lambda digest: (-len(groups[digest]), min(groups[digest]), digest))


def first_difference(mine: Sequence[str], theirs: Sequence[str], their_count: int, names: Sequence[str] | None,
                     source: str) -> ModelMismatchError:
    """The error for the first position where ``mine`` and ``theirs`` (the swarm's, listed up to ``their_count``
    tensors or fewer) differ: a missing tensor is ``"none"``, one past the swarm's listed part is unknown."""
    index = 0
    while index < min(len(mine), len(theirs)) and mine[index] == theirs[index]:
        index += 1
    local = mine[index] if index < len(mine) else "none"
    if index < len(theirs):
        swarm = theirs[index]
    else:
        swarm = "none" if index >= their_count else "not listed in its record (too many tensors for one)"
    name = names[index] if names is not None and index < len(names) and names[index] else None
    return ModelMismatchError(index, name, local, swarm, source)


def _entries(found: Any) -> dict[Any, Any]:
    """The ``subkey -> value`` of a fetched per-peer key (a ``ValueWithExpiration`` of a dictionary), or {}."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return {}
    return {subkey: getattr(entry, "value", None) for subkey, entry in value.items()}


class ModelCheck:
    """This peer's model record, published and renewed, and the check of :func:`swarm_model` before its first
    round (see the module's docstring)."""

    def __init__(self, loop: Any):
        self.loop, self.tracker = loop, loop.tracker
        self.key = f"{loop.run_id}_models"
        averager = loop.state_averager
        self.schema = schema_of([*averager.main_parameters, *getattr(averager, "extra_tensors", ())])
        self.digest, self.started = digest_of(self.schema), get_dht_time()
        self.record = make_record(self.schema, self.started)
        loop.dht.add_validators([SchemaValidator(ModelsSchema, prefix=loop.run_id),
                                 RecordSizeValidator([self.key], MAX_RECORD_BYTES)])
        self.done = False
        self.first_epoch = loop.local_epoch
        self._next_publish = 0.0
        self._next_poll = time.monotonic()  # (the first step looks)
        self._fetch: tuple[Any, Any] | None = None
        self._publish(renewal=False)

    def _publish(self, renewal: bool = True) -> None:
        """Store this peer's record; a renewal may wait a little to leave with another store (half its slack)."""
        now = get_dht_time()
        self._next_publish = time.monotonic() + self.tracker.metadata_expiration / 2
        self.tracker.dht.store(key=self.key, subkey=self.tracker.local_public_key, value=self.record,
                               expiration_time=now + self.tracker.metadata_expiration, return_future=True,
                               may_wait=min(RIDE_ALONG, self.tracker.metadata_expiration / 4) if renewal else 0.0)

    def before_contribution(self) -> None:
        """Called by each local step before it schedules a round: renew this peer's record when due; before its
        first round, raise :class:`~collabopt.errors.ModelMismatchError` where the records say that this peer's
        model is not the swarm's."""
        if time.monotonic() >= self._next_publish:
            self._publish()
        if self.done:
            return
        if self.loop.local_epoch != self.first_epoch:  # a round or a download moved it: it contributes already
            self.done = True
            return
        if self.tracker.estimated_next_update_time - get_dht_time() <= self.loop.matchmaking_time:
            self.done = True  # (set first: a check that raises is not repeated)
            self._last_look()
            return
        self._poll()

    def _start_fetch(self) -> tuple[Any, Any]:
        records = self.tracker.dht
        return (records.get(self.key, latest=True, return_future=True),
                records.get(self.tracker.training_progress_key, latest=True, return_future=True))

    def _poll(self) -> None:
        if self._fetch is None:
            if time.monotonic() >= self._next_poll:
                self._fetch = self._start_fetch()
            return
        if not all(future.done() for future in self._fetch):
            return
        fetch, self._fetch = self._fetch, None
        self._next_poll = time.monotonic() + POLL_PERIOD
        try:
            models, progress = (future.result() for future in fetch)
        except Exception as e:
            logger.debug(f"collabopt: the model records were not read: {e!r}")
            return
        self.judge(models, progress, last=False)

    def _last_look(self) -> None:
        """The look before the first round: waits for the records (a second try where a training peer's model
        record is missing), then decides on what it found."""
        if self._fetch is not None:
            for future in self._fetch:
                future.cancel()
        for attempt in range(2):
            try:
                fetch = self._start_fetch()
                models, progress = (future.result(timeout=LAST_LOOK_TIMEOUT) for future in fetch)
            except Exception as e:  # (a timeout too)
                logger.debug(f"collabopt: the model records were not read: {e!r}")
                return
            if self.judge(models, progress, last=attempt == 1):
                return
            time.sleep(POLL_PERIOD / 2)

    def judge(self, models: Any, progress: Any, last: bool) -> bool:
        """Decide on fetched records (raises :class:`~collabopt.errors.ModelMismatchError`); False where a training
        peer's model record is missing and ``last`` is False (nothing decided)."""
        own = self.tracker.local_public_key
        training = {key for key, value in _entries(progress).items() if value is not None}
        read = {key: read_record(value) for key, value in _entries(models).items() if key != own}
        known = {key: found for key, found in read.items() if found is not None and key in training}
        if not last and training - set(known) - {own}:
            return False
        holders = {key: (found[0], found[1]) for key, found in known.items()}
        holders[own] = (self.digest, self.started)
        swarm = swarm_model(holders)
        if swarm == self.digest:
            return True
        same = [found for found in known.values() if found[0] == swarm]
        _, _, listed, count = max(same, key=lambda found: (len(found[2]) == found[3], len(found[2])))
        source = f"the model of {len(same)} of the {len(holders)} peers that train in this run"
        error = first_difference(self.schema, listed, count, self._names(), source)
        logger.error(f"collabopt: {error}")
        raise error

    def _names(self) -> list[str] | None:
        """The local tensors' names (the model's, where the optimizer was given one; extra tensors numbered)."""
        averager = self.loop.state_averager
        names = getattr(averager, "model_names", None) or [
            name for group in averager.optimizer.param_groups for name in group.get("param_names", ())] or None
        extras = len(self.schema) - len(averager.main_parameters)
        if names is not None and extras:
            names = [*names, *(f"extra tensor {i}" for i in range(extras))]
        return names


__all__ = ["ModelCheck", "ModelRecord", "ModelsSchema", "digest_of", "first_difference", "make_record",
           "read_record", "schema_of", "swarm_model"]
