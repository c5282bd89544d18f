"""DiLoCo mode's round: the loop's optimizer is the outer one, and a round (:meth:`collabopt.diloco.DiLoCo.run_round`)
ends the global epoch."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from hivemind.utils import get_dht_time

from collabopt import diloco as diloco_module
from collabopt.engine import protocol
from collabopt.engine.loop import PeerLoop
from collabopt.engine.progress import SwarmProgressTracker
from collabopt.errors import ModelMismatchError
from collabopt.lineage import valid_fingerprint

logger = logging.getLogger(__name__)


class ThrottledProgressTracker(SwarmProgressTracker):
    """A DiLoCo peer's tracker: it stores its progress record at most once per
    :func:`collabopt.diloco.report_period` (a quarter of the last round, at most ``max_refresh_period``, 30 s by
    default here: rounds are hundreds of steps long; one store per ``min_refresh_period`` cost B6's peers 64 kB/s
    instead of 23, ~10% of their round's all-reduce)."""

    _epoch_began: float | None = None  # when this peer's current epoch (round) began, DHT time
    _last_round: float | None = None  # how long its last whole round took, seconds
    _created: float | None = None  # when the tracker was made, DHT time (Thread has its own _started)

    def __init__(self, *args: Any, max_fetch_period: float = float("inf"), **kwargs: Any):
        self.max_fetch_period = max_fetch_period  # (set before __init__ counts the records found)
        self._created = get_dht_time()
        super().__init__(*args, **kwargs)

    def report_period(self) -> float:
        """A quarter of the last whole round; before one, of the time this round has lasted so far (since this peer
        began it, or started), which the round is at least as long as: storing every ``min_refresh_period`` until
        the second boundary made a peer's first rounds cost three times its later ones (B6)."""
        began = self._epoch_began if self._epoch_began is not None else self._created
        length = self._last_round
        if length is None and began is not None:
            length = max(0.0, get_dht_time() - began)
        return diloco_module.report_period(length, self.min_refresh_period, self.max_refresh_period)

    def _parse_swarm_progress_data(self, metadata: Any) -> Any:
        """It fetches the swarm's progress at least every :meth:`fetch_period` (``max_refresh_period`` also caps the
        report period). See docs/decisions.md, "DiLoCo: no round alone on an old
        view"."""
        progress = super()._parse_swarm_progress_data(metadata)
        progress.next_fetch_time = min(progress.next_fetch_time, get_dht_time() + self.fetch_period())
        return progress

    def fetch_period(self) -> float:
        """The longest wait between two fetches: ``max_fetch_period`` (the ETA-based period while the throughput
        estimates warm up left peers counting only their own samples), or its :meth:`report_period` if longer, since
        the others' records change no faster than that (each peer's own period, from rounds of about the same
        length). Each fetch gets every peer's signed record from several nodes: at every half ``matchmaking_time``
        that was about a third of a compressed round's bytes (B6). Near the round's end the ETA-based period is the
        shorter one."""
        return max(self.max_fetch_period, self.report_period())

    def report_local_progress(self, local_epoch: int, samples_accumulated: int,
                              update_global_samples: bool = True) -> None:
        previous = self.local_progress
        if local_epoch != previous.epoch:
            now = get_dht_time()
            if self._epoch_began is not None and local_epoch == previous.epoch + 1:
                self._last_round = now - self._epoch_began
            self._epoch_began = now
        super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)


class DiLoCoLoop(PeerLoop):
    """The DiLoCo mode: the loop's (offloaded) optimizer is the outer one, whose parameters are the anchor; a round
    (:meth:`collabopt.diloco.DiLoCo.run_round`) ends the global epoch. Also the :class:`collabopt.diloco.RoundSwarm`
    the round runs on."""

    averages_parameters = False  # (its rounds are the pseudo-gradients')

    def __init__(self, *, diloco: Any, **kwargs: Any):
        self.diloco = diloco
        self._in_flight: Any = None  # overlap: the ScheduledRound whose all-reduce is running
        self._sharing_paused = False  # overlap: state sharing is off while a round is in flight
        super().__init__(**kwargs)
        self.anchors = tuple(p for group in self.state_averager.optimizer.param_groups for p in group["params"])
        self.parameters = tuple(self.state_averager.main_parameters)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> Any:
        kwargs.setdefault("max_fetch_period", max(kwargs.get("min_refresh_period", 0.5), self.matchmaking_time / 2))
        kwargs.setdefault("max_refresh_period", diloco_module.MAX_REPORT_PERIOD)
        return ThrottledProgressTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                        client_mode=self.client_mode, status_loglevel=self.status_loglevel,
                                        start=True, **kwargs)

    # ---- RoundSwarm

    @property
    def peer_id(self) -> Any:
        return self.dht.peer_id

    @property
    def num_peers(self) -> int:
        return self.tracker.global_progress.num_peers

    def buffers(self) -> Any:
        return self.grad_averager.get_tensors()

    def average(self, weight: float) -> protocol.DiLoCoRoundEvidence:
        control = self._hand_over(weight, self.diloco.round_metadata(self))
        try:
            return self.grad_averager.report(control.result())
        finally:
            if not control.done():
                control.cancel()

    def _hand_over(self, weight: float, metadata: dict[str, Any]) -> Any:
        """Hand the pseudo-gradients and ``weight`` to the round scheduled for this epoch (a new one if none is
        waiting for them); returns the round."""
        control, self.scheduled_grads = self.scheduled_grads, None
        if control is None or control.triggered or control.done():
            control = self.grad_averager.schedule(timeout=self.averaging_timeout, gather=metadata)
        self.grad_averager.run(control, weight)
        return control

    def skip_averaging(self) -> None:
        self._leave_scheduled_round()

    def _leave_scheduled_round(self) -> None:
        """Leave the round scheduled for this epoch: cancelled while matchmaking; once its group is assembled, take
        part with nothing (zeros, weight 0) and wait for it (its members would otherwise wait for this peer). A
        failure of that round is logged, and training goes on; SIGTERM and Ctrl+C leave the round and end it."""
        control, self.scheduled_grads = self.scheduled_grads, None
        if control is None or control.done():
            return
        if control.group is None or control.triggered:
            control.cancel()
            return
        control.tag_along()
        try:
            control.result()
        except Exception as e:  # (the round this peer brought nothing to failed: training goes on)
            logger.log(self.status_loglevel, "collabopt: a round this peer took part in with nothing failed: %r", e)
            if not control.done():
                control.cancel()
        except BaseException:  # SIGTERM (collabopt.Terminated) or Ctrl+C: stop waiting, leave the round
            control.cancel()
            raise

    def outer_step(self, increment_epoch: bool = True) -> None:
        # the outer optimizer steps on the anchor (its .grad are the averaged buffers, see
        # _make_gradient_averager with offload_optimizer), then the anchor is copied into the model
        self.state_averager.step(increment_epoch=increment_epoch, optimizer_step=True)

    # ---- the loop, DiLoCo's way

    def step_decision(self) -> Any:
        # the anchor of a peer one epoch behind is stale: catch up at once (hivemind tolerates one epoch), unless
        # (overlap_rounds) the others started the round it trained toward: their epoch moved when they did
        return diloco_module.step_decision(self.diloco, self.local_epoch, self.tracker.global_epoch)

    def should_download(self) -> bool:
        return self.step_decision().download

    def schedule_rounds(self) -> None:
        """Start matchmaking for the round once the epoch's end is within a ``matchmaking_time``, with this peer's
        round metadata (epoch, anchor fingerprint) for its group."""
        soon = self.tracker.estimated_next_update_time - get_dht_time() <= self.matchmaking_time
        if self.num_peers <= 1 or not soon or self.should_download():
            return  # (a peer that must download first would bring a stale anchor to the others' round)
        self.land(wait=False)
        if self._in_flight is not None:
            return  # the anchor (whose fingerprint the group gathers) moves when it lands: schedule after
        if self.scheduled_grads is None or self.scheduled_grads.triggered or self.scheduled_grads.done():
            self.scheduled_grads = self.grad_averager.schedule(timeout=self.averaging_timeout,
                                                               gather=self.diloco.round_metadata(self))

    def end_epoch(self) -> None:
        self.land(wait=True)  # one round in flight at most
        if self.num_peers <= 1:  # a round alone forks the anchor: never decided on an old view of the swarm
            self._refresh_swarm_view(timeout=self.matchmaking_time)
        if self.should_download():
            # its round could not be applied (its anchor is stale: the swarm is past its epoch, read after
            # this step began, or its group's anchor differed): the next step downloads, then rounds go on
            if not self.diloco.needs_sync:
                logger.log(self.status_loglevel, f"collabopt: the swarm is at epoch {self.tracker.global_epoch}, "
                           f"this peer at {self.local_epoch}: no round; it downloads the swarm's state first")
            return
        if self.diloco.overlap and self.num_peers > 1:
            with self.tracker.pause_updates():
                self._start_overlapped_round()
                self._share_state()
                self.grad_averager.reset_accumulated_grads_()
            return
        # closed for downloads until the round lands (as the synchronous mode's boundary): a state served while the
        # round waits for its group or takes its outer step is this epoch's anchor, which the round is about to
        # replace; its downloader, too late for that group, would meet the next round's with an old anchor
        with self.tracker.pause_updates(), self.state_averager.closed_for_downloads():
            outcome = self.diloco.run_round(self)
            self._settle(outcome.applied)
            if outcome.applied:
                self.tracker.update_epoch(new_epoch=self.local_epoch)
            else:  # keep the pseudo-gradient: count samples toward the next round from zero
                self.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
                self.tracker.global_progress.samples_accumulated = 0
                self.tracker.global_progress.eta_next_epoch = float("inf")
            self._share_state()
            self.grad_averager.reset_accumulated_grads_()
            logger.log(self.status_loglevel, f"DiLoCo round at epoch {self.local_epoch}: {outcome}")
        if not outcome.applied:
            self._fetch_progress_now()

    def _share_state(self) -> None:
        """Serve this peer's state with its epoch as priority; a peer whose anchor disagreed with its group's
        serves it with a lower priority (downloads prefer the group's). Where downloads are verified, vote for it
        (unless a round is in flight: its epoch is the next one, its anchor still the last one's)."""
        if not self.client_mode:
            self.state_averager.state_sharing_priority = self.local_epoch - (0.5 if self.diloco.needs_sync
                                                                             else 0.0)
        votes = self.state_averager.votes if self._in_flight is None else None
        anchor = diloco_module.fingerprint(self.anchors) if votes is not None else None
        if votes is not None and valid_fingerprint(anchor):
            votes.vote(self.local_epoch, anchor)  # (collabopt.engine.download_votes)

    def load_state_from_peers(self) -> None:
        """Download the swarm's anchor, outer optimizer state and epoch, keeping this peer's progress since its
        own anchor (parameters = downloaded anchor + progress)."""
        self.land(wait=True)
        self._leave_scheduled_round()
        self.state_averager.step(wait_for_delayed_updates=True)
        with self.tracker.pause_updates():
            progress, since = self.diloco.progress_to_keep(self)
            epoch, anchor = self.local_epoch, diloco_module.fingerprint(self.anchors)
            try:
                # (False: nobody served it, or its state was refused)
                downloaded = self.state_downloads.download(timeout=self.load_state_timeout)
            except ModelMismatchError:  # (collabopt.model_check) this peer's model is not the swarm's
                raise
            except Exception as e:  # nobody could serve it now: the next step tries again
                logger.warning("collabopt: downloading the swarm's state failed: %r", e)
                downloaded = False
            moved = self.local_epoch != epoch or diloco_module.fingerprint(self.anchors) != anchor
            # (True: the download did not tell whether a round this peer lost results of was applied)
            self.diloco.needs_sync = bool(self.diloco.restore_after_download(self, progress, since, downloaded, moved))
            if moved:
                self.diloco.resyncs += 1
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            self._share_state()
            self.grad_averager.reset_accumulated_grads_()

    @torch.no_grad()
    def reanchor(self, source: Any = None) -> None:
        with self.state_averager.lock_averaged_tensors:  # the anchor is the state this peer serves
            for anchor, value in zip(self.anchors, source or self.parameters, strict=True):
                anchor.copy_(value.detach().to(device=anchor.device, dtype=anchor.dtype))

    # ---- overlap (overlap_rounds=True): the round's all-reduce runs while inner steps go on

    def step(self, batch_size: int | None = None) -> bool:
        self.land(wait=False)
        return super().step(batch_size)

    def land(self, wait: bool, apply: bool = True) -> None:
        """Apply the result of the round in flight if it arrived (or, with ``wait``, once it arrives); with
        ``apply=False`` wait for it and drop it."""
        control = self._in_flight
        if control is None or (not wait and not control.done()):
            return
        self._in_flight = None
        try:
            result: Any = self.grad_averager.report(control.result())
        except Exception as e:
            result = e
            if not control.done():
                control.cancel()
        if not apply:
            self.diloco.pending = None
            self._settle(False)
            self._resume_sharing()
            return
        outcome = self.diloco.land_round(self, result)
        self._settle(outcome.applied)
        self._resume_sharing()  # (only now: before the outer step, the old anchor would be served as the new epoch's)
        self._share_state()
        if not outcome.applied:
            self._fetch_progress_now()
        logger.log(self.status_loglevel, f"DiLoCo round landed at epoch {self.local_epoch}: {outcome}")

    def _settle(self, applied: bool) -> None:
        """The round's decision reaches the rounds' own state: with ``pseudo_gradient_compression`` the error feedback
        keeps what the round's payload left out only where the round was applied
        (:meth:`collabopt.engine.diloco_averaging.SparsePseudoGradientRounds.settle`)."""
        settle = getattr(self.grad_averager, "settle", None)
        if settle is not None:
            settle(applied)

    def settle_delivered(self, applied: bool) -> None:
        """RoundSwarm: the round this peer did not apply after its pseudo-gradient may have reached the others was
        decided (``applied``: by them; :meth:`collabopt.diloco.DiLoCo.restore_after_download`): with
        ``pseudo_gradient_compression`` the error feedback keeps that round's remainder only if it was applied
        (:meth:`collabopt.engine.diloco_averaging.SparsePseudoGradientRounds.settle_delivered`)."""
        settle = getattr(self.grad_averager, "settle_delivered", None)
        if settle is not None:
            settle(applied)

    def _resume_sharing(self) -> None:
        """Serve this peer's state again once its epoch and anchor agree (sharing paused while a round was in
        flight: :meth:`_start_overlapped_round`)."""
        if self._sharing_paused:
            self._sharing_paused = False
            self.state_averager.allow_state_sharing = True

    def _start_overlapped_round(self) -> None:
        """Start the all-reduce of this round in the background and move to the next epoch at once."""
        weight = self.diloco.start_round(self)
        self._in_flight = self._hand_over(weight, self.diloco.pending.metadata)
        self.state_averager.step(increment_epoch=True)
        self.tracker.update_epoch(new_epoch=self.local_epoch)
        if self.state_averager.allow_state_sharing:
            # until it lands, this peer's epoch is the next one but its anchor the last one: a peer that
            # downloaded them would hold an anchor the swarm no longer has at that epoch
            self._sharing_paused = True
            self.state_averager.allow_state_sharing = False

    def _refresh_swarm_view(self, timeout: float) -> None:
        """Fetch the swarm's progress now and wait (at most ``timeout`` seconds) until the tracker holds it."""
        tracker = self.tracker
        with tracker.pause_updates():  # (a fetch in flight now is dropped and made again: see the tracker)
            tracker.global_progress.next_fetch_time = get_dht_time()
            view = tracker.global_progress
        tracker.global_state_updated.set()
        deadline = time.monotonic() + timeout
        while tracker.global_progress is view and time.monotonic() < deadline:
            time.sleep(0.01)

    def _fetch_progress_now(self) -> None:
        """Did the others apply the round this peer could not? (then it is behind and downloads; hivemind would
        look up to 10 s later)"""
        self.tracker.global_progress.next_fetch_time = get_dht_time()
        self.tracker.global_state_updated.set()

    def shutdown(self) -> None:
        self.land(wait=True)  # the others' round needs this peer's part
        self._leave_scheduled_round()
        super().shutdown()
