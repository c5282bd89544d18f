"""collabopt's progress tracker fetches the swarm's records without holding the lock a step takes at each epoch
boundary (``pause_updates``), and drops records fetched while a paused section ran."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from hivemind.utils.performance_ema import PerformanceEMA
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.engine import progress


class SlowDHT:
    """A DHT whose gets return only when the test releases them (a replica that does not answer)."""

    def __init__(self) -> None:
        self.started, self.release = threading.Semaphore(0), threading.Semaphore(0)
        self.gets = 0

    def get(self, key: str, latest: bool, return_future: bool):
        self.gets += 1
        number = self.gets

        async def answer():
            self.started.release()
            while not self.release.acquire(blocking=False):
                await asyncio.sleep(0.005)
            return ValueWithExpiration(f"records #{number}", float("inf"))
        return answer()


def tracker_without_network(dht: SlowDHT):
    """A tracker as its __init__ leaves it, minus the DHT and the threads; each parse records its records."""
    tracker = object.__new__(progress.SwarmProgressTracker)
    threading.Thread.__init__(tracker)
    tracker.dht, tracker.training_progress_key, tracker.status_loglevel = dht, "run_progress", 10
    tracker.lock_global_progress, tracker.global_state_updated = threading.Lock(), threading.Event()
    tracker.fetched_global_progress_this_epoch, tracker.shutdown_triggered = threading.Event(), threading.Event()
    tracker.global_progress = SimpleNamespace(next_fetch_time=0.0, applied=None)
    tracker.performance_ema = PerformanceEMA(alpha=0.1)
    tracker._report_lock, tracker.local_public_key = threading.RLock(), b"[ed25519:me]"
    tracker._parse_swarm_progress_data = lambda metadata: SimpleNamespace(next_fetch_time=0.0, applied=metadata)
    return tracker


def test_a_slow_fetch_does_not_hold_the_epoch_lock_and_one_that_straddles_a_paused_section_is_dropped():
    dht = SlowDHT()
    tracker = tracker_without_network(dht)
    loop = asyncio.new_event_loop()
    fetcher = threading.Thread(target=loop.run_until_complete, args=(tracker._progress_fetcher(),), daemon=True)
    fetcher.start()
    try:
        assert dht.started.acquire(timeout=10)  # get #1 is in flight, and stays so
        # the lock a step's pause_updates() takes is free (hivemind 1.1.12 holds it until the get answers)
        assert tracker.lock_global_progress.acquire(timeout=2.0)
        tracker.lock_global_progress.release()
        with tracker.pause_updates():  # a boundary: an epoch change, a state download, a DiLoCo count reset
            pass
        dht.release.release()  # get #1 answers with records that may predate that section: dropped, fetched again
        assert dht.started.acquire(timeout=10)
        assert tracker.global_progress.applied is None
        dht.release.release()  # get #2 answers with no section run meanwhile: applied
        assert tracker.fetched_global_progress_this_epoch.wait(timeout=10)
        assert tracker.global_progress.applied == "records #2"
    finally:
        tracker.shutdown_triggered.set()
        for _ in range(3):
            dht.release.release()
        fetcher.join(timeout=10)
        pending = asyncio.all_tasks(loop)  # hivemind's shutdown watcher, a getter cut short
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5))
        loop.close()
    assert not fetcher.is_alive()


def tracker_at(global_epoch: int, eta: float):
    from hivemind.optim.progress_tracker import GlobalTrainingProgress

    tracker = tracker_without_network(SlowDHT())
    tracker.global_progress = GlobalTrainingProgress(epoch=global_epoch, samples_accumulated=40, target_batch_size=100,
                                                     num_peers=3, num_clients=0, eta_next_epoch=eta,
                                                     next_fetch_time=float("inf"))
    tracker.local_progress = SimpleNamespace(epoch=2, samples_accumulated=30)
    tracker.report_local_progress = lambda *args, **kwargs: None  # (stores this peer's record: no DHT here)
    return tracker


def test_entering_an_epoch_the_swarm_entered_first_drops_its_stale_eta_and_fetches_now():
    from hivemind.utils import get_dht_time

    passed = get_dht_time() - 1.0  # extrapolated at the last fetch before this peer's boundary: passed meanwhile
    tracker = tracker_at(global_epoch=3, eta=passed)
    with tracker.pause_updates():
        assert tracker.update_epoch(3) == 3
    assert tracker.global_progress.eta_next_epoch == float("inf")  # not ready at once, with no samples of its own
    assert tracker.global_progress.samples_accumulated == 40  # the swarm's samples of epoch 3 still count
    assert tracker.global_progress.next_fetch_time <= get_dht_time() and tracker.global_state_updated.is_set()

    # first to enter: hivemind's own reset (an ETA from nobody's progress yet); no fetch forced
    tracker = tracker_at(global_epoch=2, eta=passed)
    with tracker.pause_updates():
        tracker.update_epoch(3)
    assert (tracker.global_progress.epoch, tracker.global_progress.samples_accumulated) == (3, 0)
    assert tracker.global_progress.next_fetch_time == float("inf") and not tracker.global_state_updated.is_set()


def parsing_tracker(epoch: int = 3):
    """A tracker that parses records with hivemind's arithmetic (min_refresh_period 0.5 s: records of stepping
    peers are at most 0.5 s old, plus the store's latency)."""
    from hivemind.utils.performance_ema import PerformanceEMA

    tracker = tracker_without_network(SlowDHT())
    del tracker._parse_swarm_progress_data  # the class's own
    tracker.prefix, tracker.target_batch_size = "run", 512
    tracker.min_refresh_period, tracker.max_refresh_period = 0.5, 1.0
    tracker.expected_drift_peers, tracker.expected_drift_rate, tracker.default_refresh_period = 3, 0.2, 3.0
    tracker.local_progress = SimpleNamespace(epoch=epoch, samples_accumulated=0)
    tracker.performance_ema = PerformanceEMA(alpha=0.1)
    return tracker


def record(age: float, samples: int, rate: float, epoch: int = 3):
    from hivemind.utils import get_dht_time

    return ValueWithExpiration(dict(peer_id=b"peer", epoch=epoch, samples_accumulated=samples,
                                    samples_per_second=rate, time=get_dht_time() - age, client_mode=False),
                               float("inf"))


def test_a_peer_that_stopped_stepping_is_not_extrapolated_into_a_full_epoch():
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils import get_dht_time

    # the suite run: R's record (epoch 3, 0 samples, 320 samples/s) was 2 s old while R downloaded a state; hivemind
    # extrapolated it to 640 of 512 samples, ETA 0, and the peer that had just entered epoch 3 began its global step
    stale = {b"r": record(age=2.0, samples=0, rate=320.0), b"b": record(age=0.05, samples=0, rate=320.0)}
    hivemind_view = ProgressTracker._parse_swarm_progress_data(parsing_tracker(), stale)
    assert hivemind_view.eta_next_epoch <= get_dht_time()
    progress = parsing_tracker()._parse_swarm_progress_data(stale)
    # R counts for at most 1 s (0.5 s report period + 0.5 s): 320 + 16 samples of 512, 0.27 s more at 640/s
    assert progress.eta_next_epoch - get_dht_time() > 0.2
    assert progress.num_peers == 2 and progress.epoch == 3

    # records of peers that step (at most a report period old) are extrapolated as hivemind does
    fresh = {b"r": record(age=0.4, samples=100, rate=320.0), b"b": record(age=0.1, samples=50, rate=320.0)}
    ours = parsing_tracker()._parse_swarm_progress_data(fresh)
    theirs = ProgressTracker._parse_swarm_progress_data(parsing_tracker(), fresh)
    assert abs(ours.eta_next_epoch - theirs.eta_next_epoch) < 0.05
    assert ours.samples_accumulated == theirs.samples_accumulated == 150


def test_the_progress_record_built_at_every_step_is_the_one_hivemind_validates():
    from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
    from hivemind.p2p import PeerID

    tracker = tracker_without_network(SlowDHT())
    tracker.dht = SimpleNamespace(peer_id=PeerID(b"peer"))
    tracker.client_mode = False
    tracker.performance_ema.update(task_size=32)
    fast = tracker._get_local_progress(3, 96)
    validated = ProgressTracker._get_local_progress(tracker, 3, 96)
    assert isinstance(fast, LocalTrainingProgress)
    assert fast.dict().keys() == validated.dict().keys()
    assert {k: type(v) for k, v in fast.dict().items()} == {k: type(v) for k, v in validated.dict().items()}
    assert LocalTrainingProgress.parse_obj(fast.dict()).samples_accumulated == 96  # what the others fetch parses
    for epoch, samples in ((-1, 0), (0, -5)):  # what the validation refuses still raises
        try:
            tracker._get_local_progress(epoch, samples)
        except ValueError:
            continue
        raise AssertionError(f"epoch {epoch}, samples {samples} were accepted")


def test_a_view_counts_this_peers_own_samples_as_they_are_now_not_as_its_last_stored_record():
    """The CI failure of session 29 (a solo peer ended an epoch a step late): its stored record lagged its count by
    the report period, and hivemind adds only samples reported after a view is installed."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
    from hivemind.utils import get_dht_time

    tracker = parsing_tracker()
    tracker.local_progress = LocalTrainingProgress(peer_id=b"me", epoch=3, samples_accumulated=480,
                                                   samples_per_second=320.0, time=get_dht_time(), client_mode=False)
    own_stale = record(age=0.3, samples=320, rate=320.0)  # stored two steps ago
    found = {tracker.local_public_key: own_stale, b"other": record(age=0.0, samples=16, rate=320.0)}
    hivemind_view = ProgressTracker._parse_swarm_progress_data(parsing_tracker(), found)
    assert hivemind_view.samples_accumulated == 320 + 16  # the 160 samples since the store are lost
    view = tracker._parse_swarm_progress_data(found)
    assert view.samples_accumulated == 480 + 16 and view.num_peers == 2
    assert found[tracker.local_public_key] is own_stale  # (the records fetched are not changed)

    # no record of this peer stored (hivemind's reporter skips a peer two epochs behind): none is made up
    view = tracker._parse_swarm_progress_data({b"other": record(age=0.0, samples=16, rate=320.0)})
    assert view.samples_accumulated == 16 and view.num_peers == 1


def test_a_peer_restarted_with_its_identity_is_one_present_peer_not_two():
    """hivemind signs each process's record with a key of its own: the dead process's record stays beside the new
    one until it expires, and the group size hint counted the peer twice (churn: every parameter round then waited
    out matchmaking_time)."""
    def of(peer: bytes, age: float):
        value = record(age=age, samples=16, rate=320.0)
        return ValueWithExpiration(dict(value.value, peer_id=peer), value.expiration_time)

    from hivemind.utils import get_dht_time

    tracker = parsing_tracker()
    tracker._parse_swarm_progress_data({b"key1": of(b"a", 20.0), b"key2": of(b"a", 0.1), b"key3": of(b"b", 0.2)})
    assert len(tracker.record_times) == 2
    assert all(get_dht_time() - stamp < 1.0 for stamp in tracker.record_times)  # peer a's newest record counts
