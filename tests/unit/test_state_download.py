"""Downloading the swarm's state (engine.sync_download.download_state) on a stand-in optimizer: the peer downloads
again while the state it got is older than the swarm's epoch, and relabels it (hivemind's rule) only as a last
resort. The downloads themselves run in the swarm tests (late joiners, churn restarts, cut links)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from types import SimpleNamespace

import pytest

from collabopt import Terminated
from collabopt.engine import sync_download
from collabopt.engine.lineage_check import SyncState


@dataclasses.dataclass(frozen=True)
class Progress:  # the fields of hivemind's GlobalTrainingProgress that the download reads or replaces
    epoch: int
    samples_accumulated: int = 0
    eta_next_epoch: float = 0.0
    next_fetch_time: float = 0.0
    num_peers: int = 3


class StandIn:
    """A SyncLoop as download_state sees it; each download serves the next epoch of ``served`` (None: nothing)."""

    def __init__(self, local_epoch: int, swarm_epoch: int, served: list[int], averaging_timeout: float = 5.0):
        self.served, self.downloads = list(served), 0
        self.state_averager = SimpleNamespace(local_epoch=local_epoch, step=lambda **kw: None,
                                              state_sharing_priority=None)
        self.state_downloads = SimpleNamespace(download=self._serve, handed_on=False, prefer_sources=lambda peers: None)
        self.tracker = SimpleNamespace(
            global_progress=_Mutable(Progress(epoch=swarm_epoch)), pause_updates=contextlib.nullcontext,
            global_state_updated=threading.Event(), reported=[],
            report_local_progress=lambda local_epoch, samples_accumulated: self.tracker.reported.append(local_epoch))
        self.tracker.global_epoch = swarm_epoch
        self.averaging_timeout, self.load_state_timeout = averaging_timeout, 1.0
        self.scheduled_grads = None
        self.grad_averager, self.use_gradient_averaging = None, False
        self.client_mode, self.status_loglevel = False, logging.INFO
        self.sync_state = SyncState()

    def reset_accumulation(self) -> None:
        self.state_averager.state_sharing_priority = self.local_epoch

    def _serve(self, timeout: float) -> bool:
        """The next epoch of ``served``; None: every peer declined (each was ending an epoch)."""
        self.downloads += 1
        epoch = self.served.pop(0) if self.served else None
        self.state_downloads.handed_on = epoch is not None
        if epoch is not None:
            self.state_averager.local_epoch = epoch
        return self.state_downloads.handed_on

    @property
    def local_epoch(self) -> int:
        return self.state_averager.local_epoch


class _Mutable:
    """hivemind's progress dataclass is frozen, but its next_fetch_time is set in place: a thin mutable wrapper."""

    def __init__(self, progress: Progress):
        object.__setattr__(self, "_p", progress)

    def __getattr__(self, name: str):
        return getattr(self._p, name)

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, "_p", dataclasses.replace(self._p, **{name: value}))


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    import time
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    # forget_stale_progress replaces the tracker's progress with dataclasses.replace: give it the dataclass
    monkeypatch.setattr(sync_download, "forget_stale_progress", lambda tracker, epoch: None)


def test_a_state_one_epoch_old_is_downloaded_again_not_relabelled():
    optimizer = StandIn(local_epoch=0, swarm_epoch=5, served=[4, 5])  # the first peer to serve had not passed 4 -> 5
    sync_download.download_state(optimizer)
    assert optimizer.downloads == 2
    assert optimizer.local_epoch == 5
    assert optimizer.tracker.reported == [4, 5] and optimizer.state_averager.state_sharing_priority == 5
    assert optimizer.tracker.global_state_updated.is_set()  # it asked for a fresh view of the swarm in between


def test_a_download_every_peer_declined_is_tried_again_and_says_so(caplog):
    optimizer = StandIn(local_epoch=0, swarm_epoch=5, served=[None, None, 5])
    with caplog.at_level(logging.INFO, logger="collabopt.engine.sync_download"):
        sync_download.download_state(optimizer)
    assert (optimizer.downloads, optimizer.local_epoch) == (3, 5)
    assert caplog.text.count("no peer sent its state now") == 2 and "the state downloaded is" not in caplog.text


def test_a_peer_behind_its_gradient_round_downloads_until_it_holds_its_groups_epoch_or_newer():
    """Its round showed its group at epoch 5 before its progress records did (they say 4, its own epoch): a state
    of epoch 4 (its group's peers were ending their boundary, serving nothing new yet) is not a catch-up."""
    optimizer = StandIn(local_epoch=4, swarm_epoch=4, served=[None, 4, 6])
    sync_download.download_state(optimizer, round_epoch=5)
    assert (optimizer.downloads, optimizer.local_epoch) == (3, 6)
    optimizer = StandIn(local_epoch=4, swarm_epoch=4, served=[None, 4, 6])
    sync_download.download_state(optimizer)  # (without it: the first answer looked current)
    assert (optimizer.downloads, optimizer.local_epoch) == (1, 4)


def test_a_peer_behind_its_gradient_round_is_never_relabelled_to_its_groups_epoch(monkeypatch):
    """Nobody served the epoch its group steps to (5) in time: it goes on at the epoch it holds (4, as the records
    say) with the parameters of that epoch, not as epoch 5 without the group's update; relabelling stays the last
    resort where the records themselves show the swarm one epoch ahead."""
    import time
    clock = iter(range(0, 1000, 2))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    optimizer = StandIn(local_epoch=4, swarm_epoch=4, served=[4] * 100, averaging_timeout=5.0)
    sync_download.download_state(optimizer, round_epoch=5)
    assert optimizer.downloads >= 2 and optimizer.local_epoch == 4
    optimizer = StandIn(local_epoch=4, swarm_epoch=5, served=[4] * 100, averaging_timeout=5.0)
    sync_download.download_state(optimizer, round_epoch=6)
    assert optimizer.local_epoch == 5


def test_a_state_as_new_as_the_swarms_is_downloaded_once():
    optimizer = StandIn(local_epoch=0, swarm_epoch=5, served=[5])
    sync_download.download_state(optimizer)
    assert (optimizer.downloads, optimizer.local_epoch) == (1, 5)


def test_when_nobody_serves_the_swarms_epoch_in_time_hiveminds_relabelling_is_the_last_resort(caplog, monkeypatch):
    import time
    clock = iter(range(0, 1000, 2))  # each look at the clock: 2 s later
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    optimizer = StandIn(local_epoch=0, swarm_epoch=5, served=[4] * 100, averaging_timeout=5.0)
    with caplog.at_level(logging.WARNING, logger="collabopt.engine.sync_download"):
        sync_download.download_state(optimizer)
    assert 2 <= optimizer.downloads <= 4
    assert optimizer.local_epoch == 5 and optimizer.state_averager.state_sharing_priority == 5
    assert "no peer served the swarm's epoch 5" in caplog.text


def test_a_state_two_epochs_old_is_not_relabelled(monkeypatch):
    """hivemind relabels only one epoch: a peer further behind keeps its epoch (and downloads again at its next
    step)."""
    import time
    clock = iter(range(0, 1000, 2))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    optimizer = StandIn(local_epoch=0, swarm_epoch=5, served=[3] * 100, averaging_timeout=5.0)
    sync_download.download_state(optimizer)
    assert optimizer.local_epoch == 3


def test_only_a_gradient_averager_that_installs_a_download_downloads(monkeypatch):
    """hivemind's GradientAverager installs nothing it downloads (a whole unverified state for nothing); PowerSGD's
    installs its Q matrices."""
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

    from collabopt.engine.gradient_rounds import GradientRounds

    def instance(cls):
        averager = cls.__new__(cls)
        averager._parent_pid = -1
        return averager

    assert not sync_download.installs_a_download(None)
    assert not sync_download.installs_a_download(instance(GradientAverager))
    assert not sync_download.installs_a_download(GradientRounds.__new__(GradientRounds))  # (collabopt's: no state)
    assert sync_download.installs_a_download(instance(PowerSGDGradientAverager))


@pytest.mark.parametrize("interrupt", [Terminated, KeyboardInterrupt])
def test_sigterm_and_ctrl_c_end_a_download_at_once_and_ordinary_errors_are_retried(interrupt, caplog):
    """Only ordinary errors are retried (each logged, 1 s apart): SIGTERM (collabopt.Terminated, a SystemExit) and
    Ctrl+C end the download's wait."""
    optimizer = StandIn(local_epoch=0, swarm_epoch=5, served=[5])
    serve, raised = optimizer.state_downloads.download, [ConnectionError("dial backoff"), interrupt()]

    def flaky(timeout: float) -> None:
        if raised:
            optimizer.downloads += 1
            raise raised.pop(0)
        serve(timeout)

    optimizer.state_downloads.download = flaky
    with caplog.at_level(logging.WARNING, logger="collabopt.engine.sync_download"), pytest.raises(interrupt):
        sync_download.download_state(optimizer)
    assert optimizer.downloads == 2 and optimizer.local_epoch == 0  # tried again after the error, not after it
    assert caplog.text.count("downloading the swarm's state failed") == 1 and "dial backoff" in caplog.text


def test_retries_of_a_failing_download_are_bounded_and_each_says_why(monkeypatch, caplog):
    """A download that keeps failing is tried DOWNLOAD_ATTEMPTS times, each failure logged with its reason; then the
    peer goes on (its next step downloads again while it is behind) instead of retrying for ever."""
    optimizer = StandIn(local_epoch=0, swarm_epoch=5, served=[], averaging_timeout=0.0)
    monkeypatch.setattr(sync_download.time, "sleep", lambda seconds: None)

    def failing(timeout: float) -> bool:
        optimizer.downloads += 1
        raise ConnectionError(f"dial backoff {optimizer.downloads}")

    optimizer.state_downloads.download = failing
    with caplog.at_level(logging.WARNING, logger="collabopt.engine.sync_download"):
        sync_download.download_state(optimizer)
    assert optimizer.downloads == sync_download.DOWNLOAD_ATTEMPTS and optimizer.local_epoch == 0
    assert all(f"dial backoff {n}" in caplog.text for n in range(1, sync_download.DOWNLOAD_ATTEMPTS + 1))
    assert f"failed {sync_download.DOWNLOAD_ATTEMPTS} times" in caplog.text


def test_sigterm_while_a_download_waits_for_a_round_it_tags_along_leaves_the_round():
    """A scheduled gradient round the download leaves: it waits for it with nothing to bring; SIGTERM there ends the
    wait (the round is cancelled) instead of being logged as the round's failure."""
    from collabopt.engine.loop import PeerLoop

    class Round:
        triggered, cancelled, weight = True, False, None

        def done(self) -> bool:
            return self.cancelled

        def result(self, timeout: float) -> None:
            raise Terminated()

        def cancel(self) -> None:
            self.cancelled = True

    optimizer = StandIn(local_epoch=0, swarm_epoch=5, served=[5])
    optimizer.scheduled_grads = control = Round()
    optimizer.tag_along = lambda round_: PeerLoop.tag_along(optimizer, round_)
    with pytest.raises(Terminated):
        sync_download.download_state(optimizer)
    assert control.cancelled and optimizer.downloads == 0
