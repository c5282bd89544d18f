"""The swarm's progress toward ``target_batch_size``: hivemind's progress tracker, as collabopt's peers use it.

Every peer stores a signed record of its epoch and samples in the DHT and fetches the others'; the swarm's epoch ends
when their samples reach the target. :class:`SwarmProgressTracker` throttles the stores, fetches outside the lock
that a peer's step takes, stops extrapolating peers that went idle, and shuts down cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.engine.replicas import ReplicaRecords
from collabopt.robust import cap_progress_claims


def forget_stale_progress(tracker: Any, local_epoch: int) -> None:
    """After a state download, drop the tracker's view of an epoch this peer has left, and fetch the swarm's now.

    hivemind 1.1.12 keeps the view fetched before the download, whose passed ETA makes the peer begin the next
    boundary at once, with no samples. See docs/decisions.md, "A fresh view of the swarm at a new epoch and after a
    download"."""
    with tracker.pause_updates():
        if tracker.global_progress.epoch > local_epoch:
            return  # news: the swarm moved on during the download (hivemind downloads again)
        fetch_progress_anew(tracker, epoch=local_epoch, samples_accumulated=0)


def fetch_progress_anew(tracker: Any, **changes: Any) -> None:
    """Drop the ETA of the tracker's view of the swarm (with ``changes`` to that view) and make it fetch the swarm's
    progress now. Call under ``tracker.pause_updates()``."""
    tracker.global_progress = dataclasses.replace(tracker.global_progress, eta_next_epoch=float("inf"),
                                                  next_fetch_time=get_dht_time(), **changes)
    tracker.global_state_updated.set()  # the fetcher re-reads next_fetch_time: it fetches now


def _record_time(record: Any) -> float | None:
    """The ``time`` of a progress record (a ``ValueWithExpiration`` of a dict); None for anything else (a goodbye, a
    record hivemind's parser skips)."""
    value = getattr(record, "value", None)
    stamp = value.get("time") if isinstance(value, dict) else None
    return stamp if isinstance(stamp, float) else None


def _newest_time_per_peer(metadata: dict) -> tuple[float, ...]:
    """The ``time`` of each peer's newest record (by the record's ``peer_id``). A peer restarted with its identity
    stores its record under a new key (hivemind signs with a key made per process), and the dead process's record
    stays until it expires: counted apart, it made the peer look present twice (docs/decisions.md, "Group size
    hint"). Only the times are merged: the records themselves count as hivemind counts them, as a record's
    ``peer_id`` is not bound to its signer."""
    newest: dict[Any, float] = {}
    for key, record in metadata.items():
        stamp = _record_time(record)
        if stamp is not None:
            peer = record.value.get("peer_id")
            peer = peer if isinstance(peer, (bytes, str)) else key
            newest[peer] = max(stamp, newest.get(peer, stamp))
    return tuple(newest.values())


def _record_not_older_than(record: Any, oldest: float) -> Any:
    """A progress record whose ``time`` is at least ``oldest``: as it was, or a copy with ``time = oldest``; anything
    else as it was (hivemind's parser skips what it cannot read)."""
    stamp = _record_time(record)
    if stamp is None or stamp >= oldest:
        return record
    return ValueWithExpiration(dict(record.value, time=oldest), record.expiration_time)


def make_progress_tracker(optimizer: Any, target_batch_size: int, **kwargs: Any) -> Any:
    """``hivemind.Optimizer._make_progress_tracker``, building a :class:`SwarmProgressTracker` (a
    subclass of ``hivemind.Optimizer`` gets it with ``_make_progress_tracker = make_progress_tracker``).

    It fetches the swarm's progress at least every half ``matchmaking_time`` (hivemind: every 10 s at most, and 3 s
    while it finds no record): hivemind spaces fetches by its ETA, far too long while its estimates warm up, and peers
    then began the first boundary seconds apart, or saw the swarm for the first time an epoch ahead. See
    docs/decisions.md, "Progress fetched every half matchmaking_time"."""
    kwargs.setdefault("max_refresh_period", max(kwargs.get("min_refresh_period", 0.5), optimizer.matchmaking_time / 2))
    kwargs.setdefault("default_refresh_period", min(3.0, kwargs["max_refresh_period"]))  # (while no record is found)
    return SwarmProgressTracker(dht=optimizer.dht, prefix=optimizer.run_id, target_batch_size=target_batch_size,
                                     client_mode=optimizer.client_mode, status_loglevel=optimizer.status_loglevel,
                                     start=True, **kwargs)


class _GatedEvent(threading.Event):
    """A ``threading.Event`` whose ``set()`` does nothing unless ``allow()`` says so."""

    def __init__(self, allow: Callable[[], bool]):
        super().__init__()
        self._allow = allow

    def set(self) -> None:
        if self._allow():
            super().set()


class SwarmProgressTracker(ProgressTracker):
    """hivemind's tracker, with these changes (each in docs/decisions.md under its name).

    * **Throttled progress reports.** This peer's record is stored at most once per :meth:`report_period`, at once
      when the epoch changes or the count drops (hivemind stores it at every step, though others fetch it less
      often). The gate is the reporter's event itself, which hivemind's reporter thread waits on.
    * **A clean exit of the progress tracker.** The event loop finishes its pending tasks before it closes and the
      shutdown is reported complete (hivemind's stopped with a cancelled store pending: an asyncio warning at exit).
    * **Fetches outside the lock.** The DHT get runs without ``lock_global_progress``, which a peer's step takes at
      every boundary (an unreachable replica held every training thread for the DHT's timeout). Records fetched
      while a :meth:`pause_updates` section ran are dropped and fetched again.
    * **No extrapolation of idle peers.** A record's count is extrapolated for at most :meth:`extrapolation_limit`
      seconds (:meth:`_parse_swarm_progress_data`).
    * **Records on their replicas.** Its DHT is a :class:`~collabopt.engine.replicas.ReplicaRecords`: stores and
      fetches go to the key's nearest nodes, not to every node (each answers with every peer's record).
    * **Capped claims** (``cap_claims``, with ``aggregation="centered_clip"``): no record's samples or epoch alone ends
      an epoch or moves the swarm ahead (:func:`collabopt.robust.cap_progress_claims`).
    * **This peer's own samples as they are now.** A fetched view counts this peer's progress as it is when the view
      is installed, not as its last stored record, which lags by up to a :meth:`report_period`
      (:meth:`_with_own_progress_now`)."""

    _pauses = 0  # pause_updates() sections ended so far: a fetch that straddles one is dropped
    cap_claims = False  # aggregation="centered_clip": records counted as collabopt.robust.cap_progress_claims says

    lowest_epoch: tuple[int, int] | None = None  # (the lowest epoch in the last records fetched, this peer's then)
    record_times: tuple[float, ...] = ()  # the DHT time of each training peer's record in the last fetch
    _next_report = -float("inf")  # time.monotonic() before which a step's report waits
    _gated = False  # set while report_local_progress runs for a report that may wait
    _flush: threading.Timer | None = None  # pending: sends a held-back count when its period ends
    _flush_lock = threading.RLock()

    def __init__(self, *args: Any, dht: Any, cap_claims: bool = False, **kwargs: Any):
        self.cap_claims = cap_claims
        self._report_lock = threading.RLock()  # a report and the installing of a view do not interleave
        super().__init__(*args, dht=ReplicaRecords(dht), **kwargs)

    def report_period(self) -> float:
        """Seconds between two stores of this peer's record (a change of epoch goes out at once)."""
        return self.min_refresh_period

    def _get_local_progress(self, local_epoch: int, samples_accumulated: int) -> Any:
        """hivemind's record of this peer's progress, built at every step: without pydantic's validation of
        values that have the record's types already (the peers that fetch the record validate it). See
        docs/decisions.md, "Progress records built without validation"."""
        rate, now = self.performance_ema.samples_per_second, get_dht_time()
        if not (type(local_epoch) is int and type(samples_accumulated) is int and min(local_epoch,
                samples_accumulated) >= 0 and type(rate) is float and rate >= 0 and type(now) is float
                and type(self.client_mode) is bool):  # what the validation may refuse: validate (and raise)
            return super()._get_local_progress(local_epoch, samples_accumulated)
        return LocalTrainingProgress.construct(
            peer_id=self.dht.peer_id.to_bytes(), epoch=local_epoch, samples_accumulated=samples_accumulated,
            samples_per_second=rate, time=now, client_mode=self.client_mode)

    @property
    def should_report_progress(self) -> threading.Event:
        return self._report_event

    @should_report_progress.setter
    def should_report_progress(self, _event: threading.Event) -> None:  # hivemind's __init__ assigns one
        self._report_event = _GatedEvent(self._may_report)

    def _may_report(self) -> bool:
        now = time.monotonic()
        if self._gated and now < self._next_report:
            self._hold_back(self._next_report - now)
            return False
        self._next_report = now + self.report_period()
        return True

    def _hold_back(self, delay: float) -> None:
        with self._flush_lock:
            if self._flush is None:
                self._flush = threading.Timer(delay, self._report_held_back)
                self._flush.daemon = True
                self._flush.start()

    def _report_held_back(self) -> None:
        with self._flush_lock:
            self._flush = None
            now = time.monotonic()
            if now < self._next_report:  # a change of epoch went out meanwhile: wait for its period
                self._hold_back(self._next_report - now)
                return
            self._next_report = now + self.report_period()
        threading.Event.set(self._report_event)

    def report_local_progress(self, local_epoch: int, samples_accumulated: int,
                              update_global_samples: bool = True) -> None:
        previous = self.local_progress
        urgent = local_epoch != previous.epoch or samples_accumulated < previous.samples_accumulated
        with self._report_lock:
            self._gated = not urgent
            try:
                super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
            finally:
                self._gated = False

    def update_epoch(self, new_epoch: int | None = None) -> int:
        """hivemind's, but where the swarm's view already was at the new epoch (a peer entered it first), its ETA
        is dropped and the swarm's progress fetched now: hivemind's could pass while this peer was busy in its
        boundary, and the peer then began the epoch's global step at once. See docs/decisions.md, "A fresh view of
        the swarm at a new epoch and after a download"."""
        joins = new_epoch is not None and new_epoch <= self.global_progress.epoch
        epoch = super().update_epoch(new_epoch)
        if joins:
            fetch_progress_anew(self)
        return epoch

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        with self._flush_lock:
            if self._flush is not None:
                self._flush.cancel()
        return super().shutdown(*args, **kwargs)

    @contextlib.contextmanager
    def pause_updates(self) -> Iterator[None]:
        with super().pause_updates():
            try:
                yield
            finally:
                self._pauses += 1  # (still under lock_global_progress)

    async def _progress_fetcher(self) -> None:
        """Fetch the swarm's records whenever the view's ``next_fetch_time`` comes (or at once when an update is
        signalled), outside ``lock_global_progress``: the lock is taken only to install the new view. hivemind held
        it while awaiting the DHT, and a peer's step, which takes it at every boundary, then waited for the DHT's
        timeout when a replica did not answer. A view fetched while a :meth:`pause_updates` section ran is dropped
        and fetched again. See docs/decisions.md, "Fetches outside the lock"."""
        loop = asyncio.get_event_loop()
        stopping = loop.run_in_executor(None, self.shutdown_triggered.wait)
        try:
            while not self.shutdown_triggered.is_set():
                if await self._signalled_before_next_fetch(loop):
                    continue
                pauses = self._pauses
                fetch = asyncio.ensure_future(self.dht.get(self.training_progress_key, latest=True,
                                                           return_future=True))
                await asyncio.wait({fetch, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if self.shutdown_triggered.is_set():  # (the DHT may be gone: its answer never comes)
                    fetch.cancel()
                    break
                await self._install_view(await fetch, pauses)
        finally:
            logging.getLogger("hivemind.optim.progress_tracker").log(
                self.status_loglevel, f"No longer fetching {self.training_progress_key}")

    async def _signalled_before_next_fetch(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Wait for the view's ``next_fetch_time``; True (and the signal cleared) if ``global_state_updated`` came
        first: the caller then reads the new ``next_fetch_time``."""
        wait = max(0.0, self.global_progress.next_fetch_time - get_dht_time())
        if await loop.run_in_executor(None, self.global_state_updated.wait, wait):
            self.global_state_updated.clear()
            return True
        return False

    async def _install_view(self, found: Any, pauses: int) -> None:
        """Make the records ``found`` this tracker's view of the swarm, unless a paused section ended after the
        fetch began (``pauses``: the count of ended sections then): the view's ``next_fetch_time`` has passed, so
        the next fetch starts at once. The lock is awaited off the event loop, which the reporter shares."""
        records = found.value if isinstance(found, ValueWithExpiration) else None
        async with enter_asynchronously(self.lock_global_progress):
            if self._pauses == pauses:
                with self._report_lock:  # (held for microseconds by a step's report: not awaited)
                    self.global_progress = self._parse_swarm_progress_data(records)
                self.fetched_global_progress_this_epoch.set()

    def extrapolation_limit(self) -> float:
        """Seconds past its record's time for which a peer's samples are extrapolated (see
        :meth:`_parse_swarm_progress_data`): a peer that steps stores its record at least once per
        :meth:`report_period` (peers of a run share it); ``min_refresh_period`` more for the store's latency."""
        return self.report_period() + self.min_refresh_period

    def _parse_swarm_progress_data(self, metadata: Any) -> Any:
        """hivemind's, but a peer's samples are extrapolated for at most :meth:`extrapolation_limit` seconds past
        its record's time.

        hivemind extrapolates without limit until the record expires, so a peer that stopped stepping still counted
        as training; a peer that steps stores its record within the limit. See docs/decisions.md, "No
        extrapolation of idle peers"."""
        if isinstance(metadata, dict):
            metadata = self._with_own_progress_now(metadata)
            self.record_times = _newest_time_per_peer(metadata)
            oldest = get_dht_time() - self.extrapolation_limit()
            metadata = {key: _record_not_older_than(record, oldest) for key, record in metadata.items()}
        counted = self._capped(metadata) if self.cap_claims and isinstance(metadata, dict) else metadata
        progress = super()._parse_swarm_progress_data(counted)
        epochs = [self.local_progress.epoch]
        for record in metadata.values() if isinstance(metadata, dict) else ():
            with contextlib.suppress(Exception):  # a goodbye (None) or a record hivemind skipped too
                epochs.append(int(record.value["epoch"]))
        self.lowest_epoch = (min(epochs), self.local_progress.epoch)
        return progress

    def _with_own_progress_now(self, metadata: dict) -> dict:
        """The records, with this peer's own (where the DHT had one) replaced by its progress now.

        The stored record lags the peer's count by up to a :meth:`report_period` (stores are throttled, and take a
        round trip). hivemind adds only the samples reported after a view is installed, so the lag was lost from
        the view until the next fetch, and a solo peer that steps faster than it fetches ended its epochs a step
        late. See docs/decisions.md, "A peer counts its own samples as they are now"."""
        own = self._local_public_key
        if own not in metadata or getattr(metadata[own], "value", None) is None:
            return metadata  # no record stored (hivemind's reporter skips a peer far behind): nothing to count
        now = dict(self.local_progress.dict(), time=get_dht_time())
        return {**metadata, own: ValueWithExpiration(now, metadata[own].expiration_time)}

    def _capped(self, metadata: dict) -> dict:
        """The records as :func:`collabopt.robust.cap_progress_claims` lets them count. A record hivemind's schema
        does not read counts nothing (hivemind's parser would refuse it too): none is let through uncapped."""
        readable: dict[Any, tuple[Any, dict]] = {}
        for key, record in metadata.items():
            with contextlib.suppress(Exception):  # (a goodbye, None, or a malformed record)
                readable[key] = (record, LocalTrainingProgress.parse_obj(record.value).dict())
        kept = cap_progress_claims([value for _, value in readable.values()], self.local_progress.epoch,
                                   self.dht.peer_id.to_bytes())
        return {key: ValueWithExpiration(value, record.expiration_time)
                for (key, (record, _)), value in zip(readable.items(), kept, strict=True) if value is not None}

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
            pending = asyncio.all_tasks(loop)
            if pending:  # cancelled already, or a last fetch: both end within a few loop iterations
                loop.run_until_complete(asyncio.wait(pending, timeout=2.0))
            for task in asyncio.all_tasks(loop):
                task.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    loop.run_until_complete(asyncio.wait_for(task, timeout=1.0))
        finally:
            loop.close()
            self.shutdown_complete.set()
