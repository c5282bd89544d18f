"""A finished peer serves its final state while live peers are behind it (collabopt.engine.final_state)."""

from types import SimpleNamespace

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.engine import final_state
from collabopt.engine.final_state import grace_decision, peers_behind, serve_final_state

NOW = 1000.0


@pytest.mark.parametrize(("records", "behind"), [
    ([], 0),
    ([(12, NOW)], 0),  # at the final epoch
    ([(13, NOW)], 0),  # ahead
    ([(11, NOW - 1)], 1),  # one epoch behind, live
    ([(11, NOW - 36)], 0),  # its record is older than live_within: it stopped training
    ([(11, NOW), (3, NOW - 2), (12, NOW)], 2),
])
def test_live_peers_behind_the_final_epoch_are_counted(records, behind):
    assert peers_behind(records, final_epoch=12, now=NOW, live_within=35.0) == behind


@pytest.mark.parametrize(("behind", "elapsed", "ends"), [
    (0, 0.0, "no live peer is behind epoch"),  # nobody to wait for: leave at once
    (1, 0.0, None),
    (1, 34.9, None),
    (1, 35.0, "1 peer(s) still behind after 35 s (the bound) at epoch"),
])
def test_the_wait_ends_when_no_live_peer_is_behind_or_at_the_bound(behind, elapsed, ends):
    assert grace_decision(behind, elapsed, bound=35.0) == ends


@pytest.mark.parametrize(("behind", "downloads", "elapsed", "ends"), [
    (0, 1, 0.0, None),  # nobody behind, but a download from this peer is open: it stays
    (1, 1, 35.0, None),  # past the bound while a download is open
    (0, 1, 634.9, None),
    (0, 2, 635.0, "2 download(s) still open after 635 s (the bound) at epoch"),  # bound + download_bound
    (1, 0, 35.0, "1 peer(s) still behind after 35 s (the bound) at epoch"),  # the download ended: the bound holds
    (0, 0, 100.0, "no live peer is behind epoch"),
])
def test_an_open_download_holds_the_wait_past_its_bound_up_to_the_download_timeout(behind, downloads, elapsed, ends):
    assert grace_decision(behind, elapsed, bound=35.0, downloads=downloads, download_bound=600.0) == ends


class FakeTracker:
    """A tracker whose DHT holds one other peer's record, which reaches the final epoch at the third look."""

    training_progress_key, local_public_key, min_refresh_period = "run_progress", b"me", 0.0

    def __init__(self, epochs):
        self.epochs, self.looks = list(epochs), 0
        self.dht = SimpleNamespace(get=self.get, peer_id=SimpleNamespace(to_bytes=lambda: b"my-id"))

    def get(self, key, latest):
        assert key == self.training_progress_key and latest
        epoch = self.epochs[min(self.looks, len(self.epochs) - 1)]
        self.looks += 1
        other = ValueWithExpiration(dict(peer_id=b"other", epoch=epoch, time=final_state.get_dht_time()), 0.0)
        own = ValueWithExpiration(dict(peer_id=b"my-id", epoch=12, time=final_state.get_dht_time()), 0.0)
        return ValueWithExpiration({b"other": other, b"me": own, b"gone": ValueWithExpiration(None, 0.0)}, 0.0)


def test_a_finished_peer_waits_until_the_peer_behind_reaches_its_epoch(caplog):
    tracker = FakeTracker([11, 11, 12])
    caplog.set_level("INFO", logger=final_state.__name__)
    reason = serve_final_state(SimpleNamespace(tracker=tracker, local_epoch=12), bound=60.0)
    assert reason == "no live peer is behind epoch 12"
    assert tracker.looks == 3
    assert "1 live peer(s) behind" in caplog.text and "leaves after" in caplog.text


def test_a_finished_peer_with_nobody_behind_leaves_at_once_and_quietly(caplog):
    tracker = FakeTracker([12])
    caplog.set_level("INFO", logger=final_state.__name__)
    assert serve_final_state(SimpleNamespace(tracker=tracker, local_epoch=12), bound=60.0).startswith("no live peer")
    assert tracker.looks == 1 and caplog.text == ""


def test_a_finished_peer_stays_until_the_download_of_its_state_ends(caplog):
    """The peer behind is no longer counted (its record is older than live_within while it downloads a large
    model), but its download from this peer is still open: leaving now would cut it off."""
    tracker = FakeTracker([12])

    class Service:  # the download stays open for the first 3 looks
        looks = 0

        @property
        def open_downloads(self) -> int:
            self.looks += 1
            return int(self.looks <= 3)

    loop = SimpleNamespace(tracker=tracker, local_epoch=12, state_service=Service(), load_state_timeout=600.0)
    caplog.set_level("INFO", logger=final_state.__name__)
    assert serve_final_state(loop, bound=0.0) == "no live peer is behind epoch 12"
    # the records are read for the first log line and once the download ended, not while it is open
    assert tracker.looks == 2
    assert "1 download(s) open" in caplog.text


def test_the_wait_ends_at_its_bound():
    tracker = FakeTracker([11])
    reason = serve_final_state(SimpleNamespace(tracker=tracker, local_epoch=12), bound=0.0, live_within=60.0)
    assert reason == "1 peer(s) still behind after 0 s (the bound) at epoch 12"


def test_a_leaving_peer_waits_until_its_goodbye_is_stored():
    """The DHT shuts down right after the tracker: a goodbye not yet sent left the others counting this peer, and a
    joiner dialed it for its download's deadline."""
    import threading

    from collabopt.engine import progress

    waits = []

    class Goodbye:
        def result(self, timeout):
            waits.append(timeout)

    def store(key, value, subkey, expiration_time, return_future):
        assert (key, value, subkey, return_future) == ("run_progress", None, b"me", True)
        return Goodbye()

    tracker = object.__new__(progress.SwarmProgressTracker)
    tracker._flush = None
    for name in ("shutdown_triggered", "shutdown_complete", "should_report_progress", "global_state_updated"):
        setattr(tracker, name, threading.Event())
    tracker.training_progress_key, tracker.local_public_key, tracker.metadata_expiration = "run_progress", b"me", 60.0
    tracker.dht = SimpleNamespace(store=store)
    tracker.shutdown(timeout=0.01)
    assert waits == [0.01]


def test_a_joiner_announces_itself_before_its_first_download():
    """A peer finishing meanwhile sees a live peer behind it and serves its final state until the joiner has it."""
    from collabopt.catch_up import CatchUp

    calls = []
    peer = SimpleNamespace(num_peers=1, global_epoch=11, local_epoch=0, announce=lambda: calls.append("announce"),
                           load_state_from_peers=lambda: calls.append("download"))
    joiner = SimpleNamespace(_peer=peer, _check_open=lambda: None, _advance_schedule=lambda: None)
    CatchUp.catch_up(joiner)
    assert calls == ["announce", "download"]


def test_a_client_mode_peer_serves_no_state_and_leaves_at_once():
    """Nobody can download from a client: it does not wait for the peers behind."""
    from collabopt.engine.peer import HivemindPeer

    peer = object.__new__(HivemindPeer)
    peer.loop = SimpleNamespace(client_mode=True, tracker=None, local_epoch=12, averaging_timeout=30.0,
                                matchmaking_time=5.0)
    assert peer.serve_final_state() == "a client-mode peer serves no state"
