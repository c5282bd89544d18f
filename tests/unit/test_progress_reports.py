"""Whether a peer stores its progress record: judged on the samples its steps count, whatever reports the throttled
reporter wakes to (``SwarmProgressTracker.stores_record``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from hivemind.utils.performance_ema import PerformanceEMA

from collabopt.engine import progress


def reporting_tracker():
    """A tracker's reporting side as its __init__ leaves it, minus the DHT and the threads; a report period of 60 s."""
    tracker = object.__new__(progress.SwarmProgressTracker)
    threading.Thread.__init__(tracker)
    tracker.min_refresh_period = 60.0
    tracker._report_lock = threading.RLock()
    tracker.should_report_progress = progress._GatedEvent(tracker._may_report)
    tracker.performance_ema = PerformanceEMA(alpha=0.1)
    tracker._get_local_progress = lambda epoch, samples: SimpleNamespace(epoch=epoch, samples_accumulated=samples)
    tracker.local_progress = tracker._get_local_progress(0, 0)
    tracker.global_progress = SimpleNamespace(epoch=0, samples_accumulated=0)
    return tracker


def test_a_peer_whose_epochs_are_shorter_than_the_report_period_keeps_storing_its_record():
    """Only the changes of epoch wake the reporter, each with no samples yet (the counts between are held back
    for the period): the peer still stores its record, as it counts samples at every step. In the HF late-join check
    (0.5 s epochs) it stopped storing after two epochs: the other peer never counted it and both stepped alone."""
    tracker = reporting_tracker()
    event = tracker.should_report_progress
    try:
        for epoch in range(1, 6):
            tracker.global_progress.epoch = epoch
            event.clear()
            tracker.report_local_progress(epoch, 0)  # the epoch change goes out at once ...
            assert event.is_set() and tracker.local_progress.samples_accumulated == 0  # ... with no samples
            for samples in (32, 64, 96):
                event.clear()
                tracker.report_local_progress(epoch, samples)
                assert not event.is_set()  # held back: the reporter never sees a count
            assert tracker.stores_record(), epoch
    finally:
        if tracker._flush is not None:
            tracker._flush.cancel()


def test_a_peer_that_counts_no_samples_for_two_epochs_stores_no_record():
    """An auxiliary peer, or one that downloads the swarm's state, is not training: the swarm should not count it."""
    tracker = reporting_tracker()
    assert not tracker.stores_record()  # nothing counted yet
    tracker.global_progress.epoch = 3
    tracker.report_local_progress(3, 16)
    assert tracker.stores_record()
    tracker.global_progress.epoch = 4  # the swarm moved on; this peer counted nothing since
    tracker.report_local_progress(4, 0)
    assert tracker.stores_record()  # one epoch without samples: still stored (hivemind's rule)
    tracker.global_progress.epoch = 5
    tracker.report_local_progress(5, 0)
    assert not tracker.stores_record()
