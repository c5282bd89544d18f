"""The synchronous mode's round: every global epoch, the peers average their accumulated gradients, step, and
average their parameters. :class:`SyncOptimizer` is ``hivemind.Optimizer`` with collabopt's averagers, progress
tracker, lineage check and state download."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import hivemind
import torch
from hivemind.optim.optimizer import logger as hivemind_logger

from collabopt.engine.averaging import GradientAveragerThatTellsGaps, can_accumulate_in_place
from collabopt.engine.compat import dht_time
from collabopt.engine.lineage_check import (
    SyncState,
    finished_group,
    hint_state_group,
    judge_lineage,
    out_of_sync,
    serve_below_the_others,
)
from collabopt.engine.progress import make_progress_tracker
from collabopt.engine.state import ConsistentStateAverager, averages_parameters_in_place
from collabopt.engine.sync_download import download_state
from collabopt.interface import RoundOutcome


class SyncOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` with a progress tracker that shuts down cleanly (see :func:`make_progress_tracker`), a
    state averager that serves consistent states (:class:`ConsistentStateAverager`) and a state download that does not
    relabel an older state as the swarm's epoch (:func:`download_state`); its averagers survive a member killed
    mid-round (:class:`~collabopt.engine.averaging.ShieldedReducers`)."""

    last_round: RoundOutcome | None = None  # the outcome of this peer's last boundary
    boundary_epoch = 0  # the epoch of the boundary in progress (or the last one)

    def __init__(self, **kwargs: Any):
        self.sync_state = SyncState()
        super().__init__(**kwargs)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> Any:
        return make_progress_tracker(self, target_batch_size, **kwargs)

    def _make_state_averager(self: Any, **kwargs: Any) -> Any:
        if "reuse_tensors" not in kwargs and averages_parameters_in_place(self, kwargs):
            kwargs["reuse_tensors"] = True
        return ConsistentStateAverager(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)

    def _make_gradient_averager(self: Any, factory: Any, **kwargs: Any) -> Any:
        averager = hivemind.Optimizer._make_gradient_averager(self, factory, **kwargs)
        if isinstance(averager, GradientAveragerThatTellsGaps):  # (in the background, the next epoch accumulates)
            averager.keeps_accumulation = not self.delay_grad_averaging
            if can_accumulate_in_place(self, averager):
                averager.accumulate_in_place()
        return averager

    def _update_global_epoch(self: Any, grad_scaler: Any) -> None:
        self.boundary_epoch = self.local_epoch
        if self.local_epoch < self.tracker.global_epoch - 1:
            # the swarm is 2+ epochs ahead (a peer back from a cut link): its gradients and parameters are stale,
            # download instead of joining the swarm's rounds with them. See docs/decisions.md, "A peer two or more
            # epochs behind downloads"
            logging.getLogger(__name__).log(
                self.status_loglevel, "collabopt: the swarm is at epoch %d, this peer at %d: downloading its state",
                self.tracker.global_epoch, self.local_epoch)
            self.last_round = RoundOutcome(False, "behind", num_peers=self.tracker.global_progress.num_peers,
                                           resync=True, epoch=self.local_epoch)
            self.load_state_from_peers()
            return
        before_averaging = self.sync_state.before_averaging
        if before_averaging is not None and self.use_gradient_averaging:
            before_averaging()  # the non-finite guard's last look at the accumulation (CollaborativeOptimizer)
        skips = _skips_state_round(self)
        if skips:
            # the boundary of an epoch whose state this peer downloaded: the others' state groups may be closed (a
            # round now would meet their next epoch's), and its parameters are the swarm's, so it skips this epoch's
            # parameter averaging. See docs/decisions.md, "The state round skipped after a download (pre-scheduling)"
            logging.getLogger(__name__).log(
                self.status_loglevel, "collabopt: no parameter averaging at the end of epoch %d (its state was "
                "downloaded)", self.local_epoch)
        every = self.average_state_every
        if skips:
            self.average_state_every = sys.maxsize
        try:  # (judge_lineage may turn this epoch's parameter averaging off too)
            hivemind.Optimizer._update_global_epoch(self, grad_scaler)
        finally:
            self.average_state_every = every
        if skips:
            self.sync_state.skipped_epoch, self.sync_state.skipped_at = self.local_epoch - 1, dht_time()
        if out_of_sync(self):
            serve_below_the_others(self)  # hivemind just declared this peer's state at its new epoch
        if not self.use_gradient_averaging:  # (use_local_updates: only parameters are averaged; hivemind keeps how)
            num_peers = self.tracker.global_progress.num_peers
            self.last_round = RoundOutcome(True, "averaged" if num_peers > 1 else "alone", num_peers=num_peers,
                                           epoch=self.boundary_epoch)

    def _average_gradients_and_load_into_optimizer(self: Any, maybe_step_control: Any) -> None:
        if self.delay_grad_averaging and maybe_step_control is not None:
            _average_gradients_in_background(self, maybe_step_control)
        else:
            hivemind.Optimizer._average_gradients_and_load_into_optimizer(self, maybe_step_control)
        hint_state_group(self, maybe_step_control)
        verdict = judge_lineage(self, maybe_step_control) if self.sync_state.checks_lineage else None
        self.last_round = round_outcome(self.boundary_epoch, self.tracker.global_progress.num_peers,
                                        finished_group(maybe_step_control), verdict)

    def _should_load_state_from_peers(self: Any) -> bool:
        resync = self.sync_state.resync
        if resync is not None and time.monotonic() >= resync.next_try:
            return True  # step() downloads, then starts over (this step's gradients came from the other lineage)
        return hivemind.Optimizer._should_load_state_from_peers(self)

    def _tag_along_with_zero_weight(self: Any, control: Any) -> None:
        if control is self.scheduled_grads and self.grad_averager is not None and not control.triggered:
            # weight 0 does not keep NaN out of the others' average (0 * NaN is NaN), and the buffers may hold one:
            # a refused non-finite result, or a dropped accumulation's round whose every member had weight 0 (0/0)
            with torch.no_grad(), self.grad_averager.get_tensors() as buffers:
                for buffer in buffers:
                    buffer.zero_()
        hivemind.Optimizer._tag_along_with_zero_weight(self, control)

    def _maybe_schedule_state_averaging(self: Any) -> None:
        if _skips_state_round(self):  # (a round scheduled and then cancelled can leave the averager stuck)
            return
        if self.sync_state.skipped_epoch == self.local_epoch - 1 and not _swarm_moved_on(self):
            # without the round it skipped, this peer ended that boundary before the others: a state round scheduled
            # now would join their group still in progress (groups are matched by time, not epoch) and hold it open
            return
        hivemind.Optimizer._maybe_schedule_state_averaging(self)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        download_state(self, **kwargs)


def round_outcome(epoch: int, num_peers: int, group: Any, verdict: tuple[str, str] | None) -> RoundOutcome:
    """The one verdict of a synchronous boundary, from what its gradient round gathered (``group``, None if the
    round failed) and what the lineage check concluded (``verdict``: reason and detail, see
    :func:`~collabopt.engine.lineage_check.judge_lineage`). The epoch's update is applied in every case; a peer
    whose parameters are not its group's re-synchronizes."""
    if not isinstance(group, dict) or len(group) < 2:
        return RoundOutcome(True, "alone" if num_peers <= 1 else "no group", num_peers=num_peers, epoch=epoch)
    reason, detail = verdict or ("averaged", "")
    return RoundOutcome(True, reason, len(group), num_peers=num_peers, resync=reason != "averaged", epoch=epoch,
                        detail=detail)


def _average_gradients_in_background(optimizer: Any, control: Any) -> None:
    """hivemind 1.1.12's ``_average_gradients_and_load_into_optimizer`` for ``delay_grad_averaging``, but a failed
    round steps with the gradients this peer handed to it, which the round's buffers still hold (hivemind's fallback
    reloaded the accumulators, by then the next epoch's). See docs/decisions.md, "A failed gradient round steps with
    this peer's gradients"."""
    try:
        group_info = control.result(optimizer.averaging_timeout)
        hivemind_logger.log(optimizer.status_loglevel, f"Averaged gradients with {len(group_info)} peers")
    except BaseException as e:
        hivemind_logger.log(optimizer.status_loglevel, f"Averaging gradients failed with {e!r}")
        hivemind_logger.log(optimizer.status_loglevel, "Proceeding with local gradients")
        with optimizer.grad_averager.get_tensors():
            pass  # an all-reduce still writing them holds this lock: let it finish first
    optimizer._load_averaged_gradients_into_optimizer_()


def _skips_state_round(optimizer: Any) -> bool:
    """Whether ``optimizer`` (pre-scheduling its state rounds, averaging gradients) ends its current epoch without
    one: the epoch's state came from a download (see :meth:`SyncOptimizer._update_global_epoch`)."""
    return (optimizer.sync_state.preschedules_state and optimizer.use_gradient_averaging
            and optimizer.sync_state.downloaded_epoch == optimizer.local_epoch)


def _swarm_moved_on(optimizer: Any) -> bool:
    """Whether the others have ended the boundary ``optimizer`` left without its state round: the progress records
    of every peer, fetched since, show its epoch, or a ``matchmaking_time`` has passed since (their groups closed
    by then; a killed peer's old record stays for a minute). See docs/decisions.md, "The state round skipped after a
    download (pre-scheduling)"."""
    tracker = optimizer.tracker
    if dht_time() >= optimizer.sync_state.skipped_at + optimizer.matchmaking_time:
        return True
    return (getattr(tracker, "lowest_epoch", None) is not None and tracker.lowest_epoch[1] >= optimizer.local_epoch
            and tracker.lowest_epoch[0] >= optimizer.local_epoch)


# Pre-scheduling the parameter-averaging ("state") round: when on, the round is scheduled from the first epoch, its
# group open until hivemind's estimate of its start plus a slack (half the matchmaking_time, at most
# STATE_ROUND_SLACK seconds), as hivemind 1.1.12 never pre-schedules it. OFF: restarted peers in the churn test ended
# apart with it on, and with it off the group size hint (ConsistentStateAverager._size_next_group) removes the idle
# matchmaking_time it saved. See docs/decisions.md, "Pre-scheduling the parameter-averaging round (off)".
PRESCHEDULE_STATE_ROUND = False
STATE_ROUND_SLACK = 1.0


def preschedule_state_rounds(optimizer: Any) -> None:
    """Make ``optimizer`` (a ``hivemind.Optimizer``) pre-schedule its state rounds from the first epoch, each group
    open until the round's estimated start plus a slack (see the comment above).

    A client-mode peer's round is scheduled a ``matchmaking_time`` later: it never leads a group, and a leader takes
    a peer only if the peer's round ends no earlier than its own. See docs/decisions.md, "Pre-scheduling the
    parameter-averaging round (off)"."""
    averager, tracker = optimizer.state_averager, optimizer.tracker
    optimizer.sync_state.preschedules_state = True  # SyncOptimizer._update_global_epoch relies on it
    slack = min(STATE_ROUND_SLACK, 0.5 * optimizer.matchmaking_time)
    if optimizer.client_mode:
        slack += optimizer.matchmaking_time
    optimizer.delay_before_state_averaging.update(task_size=1, interval=0.0)
    schedule_step = averager.schedule_step

    def schedule_at_the_estimate(scheduled_time: float | None = None, **kwargs: Any) -> Any:
        if scheduled_time is None:  # what _maybe_schedule_state_averaging estimates, plus the slack
            scheduled_time = (tracker.estimated_next_update_time
                              + optimizer.delay_before_state_averaging.ema_seconds_per_sample
                              + averager.delay_before_averaging.ema_seconds_per_sample + slack)
            if kwargs.get("timeout") is not None:  # hivemind asserts it lies before the round's deadline
                scheduled_time = min(scheduled_time, dht_time() + kwargs["timeout"] - 0.01)
        return schedule_step(scheduled_time=scheduled_time, **kwargs)

    averager.schedule_step = schedule_at_the_estimate
