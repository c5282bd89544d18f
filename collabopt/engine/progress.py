"""The swarm's progress toward ``target_batch_size``: collabopt's progress service, composed from hivemind's DHT.

Every training peer stores a signed record of its epoch and samples in the DHT (hivemind's ``LocalTrainingProgress``
under ``<run_id>_progress``, subkey its Ed25519 key: :func:`~collabopt.engine.progress_records.progress_validators`)
and fetches the others'; the swarm's epoch ends when their samples reach the target.
:class:`SwarmProgressTracker` publishes and fetches them in a thread of its own; it throttles the stores, fetches
outside the lock that a peer's step takes, stops extrapolating peers that went idle, and shuts down cleanly. How the
records are counted is :mod:`collabopt.engine.progress_records`.
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

from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.performance_ema import PerformanceEMA
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.engine import progress_records as counting
from collabopt.engine.replicas import ReplicaRecords

logger = logging.getLogger(__name__)


def forget_stale_progress(tracker: Any, local_epoch: int) -> None:
    """After a state download, drop the tracker's view of an epoch this peer has left, and fetch the swarm's now.

    The view fetched before the download has an ETA that passed meanwhile, which makes the peer begin the next
    boundary at once, with no samples. See docs/decisions.md, "A fresh view of the swarm at a new epoch and after a
    download"."""
    with tracker.pause_updates():
        if tracker.global_progress.epoch > local_epoch:
            return  # news: the swarm moved on during the download (the caller downloads again)
        fetch_progress_anew(tracker, epoch=local_epoch, samples_accumulated=0)


def fetch_progress_anew(tracker: Any, **changes: Any) -> None:
    """Drop the ETA of the tracker's view of the swarm (with ``changes`` to that view) and make it fetch the swarm's
    progress now. Call under ``tracker.pause_updates()``."""
    tracker.global_progress = dataclasses.replace(tracker.global_progress, eta_next_epoch=float("inf"),
                                                  next_fetch_time=get_dht_time(), **changes)
    tracker.global_state_updated.set()  # the fetcher re-reads next_fetch_time: it fetches now


def make_progress_tracker(optimizer: Any, target_batch_size: int, **kwargs: Any) -> Any:
    """A :class:`SwarmProgressTracker` for the loop ``optimizer`` (``kwargs``: the user's ``tracker_opts``).

    It fetches the swarm's progress at least every half ``matchmaking_time`` (hivemind's tracker: every 10 s at most,
    and 3 s while it finds no record): fetches spaced by the ETA are far too long while its estimates warm up, and
    peers then began the first boundary seconds apart, or saw the swarm for the first time an epoch ahead. See
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


class SwarmProgressTracker(threading.Thread):
    """This peer's progress record, published, and the swarm's progress, fetched, each by a task of this thread.

    Its surface is hivemind 1.1.12's ``ProgressTracker``'s (``global_progress``, ``local_progress``,
    ``report_local_progress``, ``pause_updates``, ``update_epoch``, ``ready_to_update_epoch``, ``shutdown``), its
    arguments too (``tracker_opts`` keep their meaning). What it does differently (each in docs/decisions.md under its
    name):

    * **Throttled progress reports.** This peer's record is stored at most once per :meth:`report_period`, at once
      when the epoch changes or the count drops. The gate is the reporter's event itself.
    * **A clean exit of the progress tracker.** The event loop finishes its pending tasks before it closes and the
      shutdown is reported complete.
    * **Fetches outside the lock.** The DHT get runs without ``lock_global_progress``, which a peer's step takes at
      every boundary. Records fetched while a :meth:`pause_updates` section ran are dropped and fetched again.
    * **No extrapolation of idle peers.** A record's count is extrapolated for at most :meth:`extrapolation_limit`
      seconds (:meth:`_parse_swarm_progress_data`).
    * **Records on their replicas.** Its DHT is a :class:`~collabopt.engine.replicas.ReplicaRecords`: stores and
      fetches go to the key's nearest nodes, not to every node (each answers with every peer's record).
    * **Capped claims** (``cap_claims``, with ``aggregation="centered_clip"``): no record's samples or epoch alone ends
      an epoch or moves the swarm ahead (:func:`collabopt.robust.cap_progress_claims`).
    * **This peer's own samples as they are now.** A fetched view counts this peer's progress as it is when the view
      is installed, not as its last stored record, which lags by up to a :meth:`report_period`."""

    _pauses = 0  # pause_updates() sections ended so far: a fetch that straddles one is dropped
    cap_claims = False  # aggregation="centered_clip": records counted as collabopt.robust.cap_progress_claims says
    record_times: tuple[float, ...] = ()  # the DHT time of each training peer's record in the last fetch
    _next_report = -float("inf")  # time.monotonic() before which a step's report waits
    _counted_epoch = -float("inf")  # the swarm's epoch (this peer's view) when a step last counted samples here
    _gated = False  # set while report_local_progress runs for a report that may wait
    _flush: threading.Timer | None = None  # pending: sends a held-back count when its period ends
    _flush_lock = threading.RLock()

    def __init__(self, dht: Any, prefix: str, target_batch_size: int, *, client_mode: bool | None = None,
                 min_refresh_period: float = 0.5, max_refresh_period: float = 10, default_refresh_period: float = 3,
                 expected_drift_peers: float = 3, expected_drift_rate: float = 0.2, performance_ema_alpha: float = 0.1,
                 metadata_expiration: float = 60.0, status_loglevel: int = logging.DEBUG, private_key: Any = None,
                 cap_claims: bool = False, daemon: bool = True, start: bool):
        super().__init__(name=f"{type(self).__name__}({prefix})", daemon=daemon)
        self.dht, self.prefix = ReplicaRecords(dht), prefix
        self.client_mode = dht.client_mode if client_mode is None else client_mode
        self.training_progress_key = f"{prefix}_progress"
        self.target_batch_size, self.cap_claims = target_batch_size, cap_claims
        self.min_refresh_period, self.max_refresh_period = min_refresh_period, max_refresh_period
        self.default_refresh_period = default_refresh_period
        self.expected_drift_peers, self.expected_drift_rate = expected_drift_peers, expected_drift_rate
        self.status_loglevel, self.metadata_expiration = status_loglevel, metadata_expiration
        self.performance_ema = PerformanceEMA(alpha=performance_ema_alpha)

        validators = counting.progress_validators(prefix, seed=private_key)  # (None: this process's key)
        self.local_public_key = validators[-1].local_public_key  # the subkey of this peer's records
        dht.add_validators(validators)

        self._report_lock = threading.RLock()  # a report and the installing of a view do not interleave
        self.lock_global_progress, self.global_state_updated = threading.Lock(), threading.Event()
        self.should_report_progress = _GatedEvent(self._may_report)
        self.fetched_global_progress_this_epoch = threading.Event()
        self.shutdown_triggered, self.shutdown_complete = threading.Event(), threading.Event()
        self.local_progress = self._get_local_progress(local_epoch=0, samples_accumulated=0)
        found = self.dht.get(self.training_progress_key, latest=True)
        self.global_progress = self._parse_swarm_progress_data(found.value if found is not None else None)
        if start:
            self.start()

    # ---- the swarm as this peer sees it

    @property
    def global_epoch(self) -> int:
        return self.global_progress.epoch

    @property
    def ready_to_update_epoch(self) -> bool:
        """Whether this peer may end its epoch now: the swarm is ahead, or has the target's samples (counted or
        expected by now)."""
        return (self.global_epoch > self.local_progress.epoch
                or self.global_progress.samples_accumulated >= self.target_batch_size
                or get_dht_time() >= self.global_progress.eta_next_epoch)

    @property
    def estimated_next_update_time(self) -> float:
        """The DHT time at which this peer should end its epoch (now, if it may already)."""
        return get_dht_time() if self.ready_to_update_epoch else self.global_progress.eta_next_epoch

    # ---- this peer's progress

    def report_period(self) -> float:
        """Seconds between two stores of this peer's record (a change of epoch goes out at once)."""
        return self.min_refresh_period

    def _get_local_progress(self, local_epoch: int, samples_accumulated: int) -> Any:
        """This peer's record, built at every step: without pydantic's validation of values that have the record's
        types already (the peers that fetch the record validate it). See docs/decisions.md, "Progress records built
        without validation"."""
        rate, now = self.performance_ema.samples_per_second, get_dht_time()
        fields = dict(peer_id=self.dht.peer_id.to_bytes(), epoch=local_epoch, samples_accumulated=samples_accumulated,
                      samples_per_second=rate, time=now, client_mode=self.client_mode)
        if not (type(local_epoch) is int and type(samples_accumulated) is int and min(local_epoch,
                samples_accumulated) >= 0 and type(rate) is float and rate >= 0 and type(now) is float
                and type(self.client_mode) is bool):  # what the validation may refuse: validate (and raise)
            return counting.LocalTrainingProgress(**fields)
        return counting.LocalTrainingProgress.construct(**fields)

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
        threading.Event.set(self.should_report_progress)

    def report_local_progress(self, local_epoch: int, samples_accumulated: int,
                              update_global_samples: bool = True) -> None:
        """Set this peer's epoch and samples toward it, and have them published (at once if the epoch changed or the
        count dropped, else within a :meth:`report_period`)."""
        previous = self.local_progress
        urgent = local_epoch != previous.epoch or samples_accumulated < previous.samples_accumulated
        with self._report_lock:
            self._gated = not urgent
            try:
                self._record_local_progress(local_epoch, samples_accumulated, update_global_samples)
            finally:
                self._gated = False

    def _record_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool) -> None:
        """The new samples count in the swarm's view at once (where this peer is at the swarm's epoch) and in this
        peer's throughput; a count that dropped restarts the throughput's timer."""
        extra_samples = samples_accumulated - self.local_progress.samples_accumulated
        if samples_accumulated > 0:
            self._counted_epoch = self.global_progress.epoch  # (see stores_record)
        if update_global_samples and local_epoch == self.local_progress.epoch == self.global_progress.epoch:
            self.global_progress.samples_accumulated += extra_samples  # (may drop: a count reset)
        if extra_samples > 0:
            self.performance_ema.update(task_size=extra_samples)
        else:
            self.performance_ema.reset_timer()
        self.local_progress = self._get_local_progress(local_epoch, samples_accumulated)
        self.should_report_progress.set()

    @contextlib.contextmanager
    def pause_updates(self) -> Iterator[None]:
        """No view of the swarm is installed (and this peer's throughput is not timed) within: a boundary."""
        with self.lock_global_progress, self.performance_ema.pause():
            try:
                yield
            finally:
                self._pauses += 1  # (still under lock_global_progress)

    def update_epoch(self, new_epoch: int | None = None) -> int:
        """Enter ``new_epoch`` (default: the next), with no samples; call under :meth:`pause_updates`.

        Entering an epoch ahead of the swarm's view starts that view afresh (no samples, no ETA). Where the view
        already was at the new epoch (a peer entered it first), its ETA is dropped and the swarm's progress fetched
        now: the ETA could pass while this peer was busy in its boundary, and the peer then began the epoch's global
        step at once. See docs/decisions.md, "A fresh view of the swarm at a new epoch and after a download"."""
        assert self.lock_global_progress.locked(), "update_epoch needs pause_updates()"
        joins = new_epoch is not None and new_epoch <= self.global_progress.epoch
        new_epoch = self.local_progress.epoch + 1 if new_epoch is None else new_epoch
        if new_epoch > self.global_progress.epoch:
            self.global_progress.epoch = new_epoch
            self.global_progress.samples_accumulated = 0
            self.global_progress.eta_next_epoch = float("inf")
        self.report_local_progress(new_epoch, samples_accumulated=0)
        self.fetched_global_progress_this_epoch.clear()
        if joins:
            fetch_progress_anew(self)
        return new_epoch

    # ---- the thread: publish and fetch

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

    async def _progress_reporter(self) -> None:
        """Store this peer's record when a report lets it (:meth:`_may_report`), and at least every half
        ``metadata_expiration``, while :meth:`stores_record` says so."""
        loop = asyncio.get_event_loop()
        last_report_time, store = -float("inf"), None
        try:
            while not self.shutdown_triggered.is_set():
                wait = max(0.0, last_report_time - get_dht_time() + self.metadata_expiration / 2)
                await loop.run_in_executor(None, self.should_report_progress.wait, wait)
                self.should_report_progress.clear()
                local_progress, last_report_time = self.local_progress, get_dht_time()
                if self.stores_record():
                    store = asyncio.ensure_future(asyncio.wait_for(self.dht.store(
                        key=self.training_progress_key, subkey=self.local_public_key, value=local_progress.dict(),
                        expiration_time=last_report_time + self.metadata_expiration, return_future=True),
                        timeout=self.metadata_expiration))
        finally:
            logger.log(self.status_loglevel, f"No longer reporting progress for {self.prefix}")
            if store is not None:
                store.cancel()

    def stores_record(self) -> bool:
        """Whether this peer's record is stored: not when no step counted samples here for two epochs (an auxiliary
        peer, or one that downloads the swarm's state). Judged on every step's count, not on the record the reporter
        wakes to as hivemind judges it: where epochs are shorter than a report period, only the changes of epoch, with
        no samples yet, wake it, so a training peer stored no record after two epochs, the others did not count it and
        each stepped alone (docs/decisions.md, "Throttled progress reports")."""
        return self._counted_epoch >= self.global_epoch - 1

    async def _progress_fetcher(self) -> None:
        """Fetch the swarm's records whenever the view's ``next_fetch_time`` comes (or at once when an update is
        signalled), outside ``lock_global_progress``: the lock is taken only to install the new view. Holding it
        while awaiting the DHT (as hivemind's tracker does) made a peer's step, which takes it at every boundary, wait
        for the DHT's timeout when a replica did not answer. A view fetched while a :meth:`pause_updates` section ran
        is dropped and fetched again. See docs/decisions.md, "Fetches outside the lock"."""
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
            logger.log(self.status_loglevel, f"No longer fetching {self.training_progress_key}")

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

    # ---- counting the records

    def extrapolation_limit(self) -> float:
        """Seconds past its record's time for which a peer's samples are extrapolated (see
        :meth:`_parse_swarm_progress_data`): a peer that steps stores its record at least once per
        :meth:`report_period` (peers of a run share it); ``min_refresh_period`` more for the store's latency."""
        return self.report_period() + self.min_refresh_period

    def _parse_swarm_progress_data(self, records: Any) -> counting.SwarmProgress:
        """The swarm's progress in the ``records`` fetched (:func:`~collabopt.engine.progress_records.count_progress`),
        this peer's own record as it is now, each peer's samples extrapolated for at most
        :meth:`extrapolation_limit` seconds past its record's time, and the claims capped where ``cap_claims``.

        Without the limit a peer that stopped stepping still counted as training until its record expired; a peer
        that steps stores its record within the limit. See docs/decisions.md, "No extrapolation of idle peers"."""
        now = get_dht_time()
        if isinstance(records, dict):
            records = counting.with_own_progress(records, self.local_public_key, self.local_progress, now)
            self.record_times = counting.newest_time_per_peer(records)
            records = counting.records_not_older_than(records, now - self.extrapolation_limit())
            if self.cap_claims:
                records = counting.capped_records(records, self.local_progress.epoch, self.dht.peer_id.to_bytes())
        periods = counting.FetchPeriods(self.min_refresh_period, self.max_refresh_period, self.default_refresh_period,
                                        self.expected_drift_peers, self.expected_drift_rate)
        return counting.count_progress(records, local=self.local_progress, target_batch_size=self.target_batch_size,
                                       rate=self.performance_ema.samples_per_second, eps=self.performance_ema.eps,
                                       periods=periods, now=now, name=self.prefix, loglevel=self.status_loglevel)

    # ---- leaving

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop publishing and fetching (waiting at most ``timeout`` s for the thread), and store a goodbye (``None``)
        for this peer's record, waiting as long again: one not yet sent when the DHT shut down left it counted."""
        with self._flush_lock:
            if self._flush is not None:
                self._flush.cancel()
        self.shutdown_triggered.set()
        self.should_report_progress.set()
        self.global_state_updated.set()
        self.shutdown_complete.wait(timeout)
        with contextlib.suppress(Exception):  # (not in time, or no DHT: the record expires)
            self.dht.store(self.training_progress_key, value=None, subkey=self.local_public_key,
                           expiration_time=get_dht_time() + self.metadata_expiration, return_future=True
                           ).result(timeout)

    def __del__(self) -> None:
        if getattr(self, "_started", None) is not None and self.is_alive():
            self.shutdown()
