"""The synchronous mode's round: at each global epoch's boundary the peers average their accumulated gradients,
step, and average their parameters. :class:`SyncLoop` decides each boundary once (:meth:`SyncLoop.end_epoch`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import torch

from collabopt.engine import protocol
from collabopt.engine.compat import dht_time
from collabopt.engine.gradient_rounds import GradientRounds, can_accumulate_in_place
from collabopt.engine.lineage_check import (
    SyncState,
    follow_round_decision,
    hint_state_group,
    lineage_metadata,
    out_of_sync,
    serve_below_the_others,
    takes_part_in_lineage_check,
    vote_for_parameters,
)
from collabopt.engine.loop import PeerLoop
from collabopt.engine.sync_download import download_state
from collabopt.interface import RoundOutcome

logger = logging.getLogger(__name__)


class SyncLoop(PeerLoop):
    """The synchronous mode: gradient rounds, then parameter ("state") rounds, with the lineage check and
    collabopt's state download (:func:`~collabopt.engine.sync_download.download_state`)."""

    last_round: RoundOutcome | None = None  # the outcome of this peer's last boundary
    _joined_epoch: int | None = None  # the epoch whose round under way this peer joined (protocol.sync_step)
    boundary_epoch = 0  # the epoch of the boundary in progress (or the last one)

    def __init__(self, **kwargs: Any):
        self.sync_state = SyncState()
        self._exact_check_due = True  # once an epoch, a fresh view of the swarm must show this peer's epoch exactly
        super().__init__(**kwargs)
        self.sync_state.checks_lineage = takes_part_in_lineage_check(self)
        if self.state_averager.votes is not None and not self.sync_state.checks_lineage and not self.auxiliary:
            logger.warning("collabopt: with these options (use_local_updates, delay_optimizer_step, "
                           "delay_grad_averaging or delay_state_averaging) a peer casts no vote for the state it "
                           "serves, so downloads are not verified against the swarm's majority (docs/faults.md)")

    def _make_gradient_averager(self, factory: Any, **kwargs: Any) -> Any:
        """collabopt's gradient rounds (:mod:`collabopt.engine.gradient_rounds`), its PowerSGD rounds for hivemind's
        ``PowerSGDGradientAverager`` (:mod:`collabopt.engine.powersgd_rounds`), or any other averager of the user's,
        an instance of its class."""
        averager = super()._make_gradient_averager(factory or GradientRounds, **kwargs)
        if isinstance(averager, GradientRounds) and can_accumulate_in_place(self, averager):
            averager.accumulate_in_place()
        return averager

    # ---- the local step

    def step_decision(self) -> protocol.StepDecision:
        """Whether this step downloads first: :func:`collabopt.engine.protocol.sync_step` on what this peer knows
        now. Its state moves on with the decision (the round under way it joined, the epoch's exact check)."""
        resync, tracker = self.sync_state.resync, self.tracker
        check_due = self._exact_check_due
        decision = protocol.sync_step(protocol.SyncStepEvidence(
            view=protocol.SwarmView(self.local_epoch, tracker.global_epoch),
            resync_due=resync is not None and time.monotonic() >= resync.next_try,
            fresh_view=check_due and tracker.fetched_global_progress_this_epoch.is_set(),
            joined_epoch=self._joined_epoch, last_round=self.last_round,
            accumulated_toward_round=(self.delay_grad_averaging and self.grad_averager is not None
                                      and self.grad_averager.local_samples_accumulated > 0)))
        self._joined_epoch = decision.joined_epoch
        self._exact_check_due = check_due and not decision.view_checked
        return decision

    def should_download(self) -> bool:
        return self.step_decision().download

    def schedule_rounds(self) -> None:
        """Start matchmaking for the gradient round once the epoch's end is within a ``matchmaking_time``."""
        if self.grad_averager is None or self.tracker.estimated_next_update_time - dht_time() > self.matchmaking_time:
            return
        control = self.scheduled_grads
        if control is None or control.triggered or control.done():
            logger.log(self.status_loglevel, "collabopt: gradient round scheduled (epoch %d)", self.local_epoch)
            self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout, **self._gather())

    def _gather(self) -> dict[str, Any]:
        """What this peer tells its gradient round's group: its epoch (only members at their group's epoch contribute:
        :func:`collabopt.engine.protocol.sync_contributes`) and, for the lineage check, its parameters' lineage."""
        return dict(gather=lineage_metadata(self) if self.sync_state.checks_lineage else {"epoch": self.local_epoch})

    # ---- the boundary

    def end_epoch(self) -> RoundOutcome | None:
        """The boundary, decided once: a peer behind the swarm downloads; otherwise the gradient round, the
        optimizer step and the parameter round, whose outcome is :attr:`last_round` (and returned; None: its round
        ends in the background). A peer the gradient round shows behind does not step: it downloads instead."""
        epoch = self.boundary_epoch = self.local_epoch
        num_peers = self.tracker.global_progress.num_peers
        # one epoch behind is behind only where this boundary has a gradient round the others ran without it: with
        # delay_grad_averaging and auxiliary peers they announce the epoch as they start it; with use_local_updates
        # (no gradient round) a boundary with nothing to wait for ends at once, and the peer that ended first is
        # ahead by design
        joins_round_ahead = self.delay_grad_averaging or self.auxiliary or self.grad_averager is None
        behind = protocol.sync_boundary(protocol.SwarmView(epoch, self.tracker.global_epoch, num_peers),
                                        joins_round_ahead=joins_round_ahead)
        if behind is not None:
            logger.log(self.status_loglevel, "collabopt: the swarm is at epoch %d, this peer at %d: downloading its "
                       "state", self.tracker.global_epoch, epoch)
            self.last_round = behind
            self.load_state_from_peers()
            return behind
        if self.sync_state.before_averaging is not None and self.grad_averager is not None:
            self.sync_state.before_averaging()  # the non-finite guard's last look at the accumulation
        logger.log(self.status_loglevel, "collabopt: epoch %d ends", epoch)
        with self.tracker.pause_updates(), self.state_averager.closed_for_downloads():
            in_background = None
            if self.grad_averager is None:  # use_local_updates: parameters are averaged, gradients never
                decision = protocol.sync_round(protocol.SyncRoundEvidence(epoch, num_peers, averages_gradients=False))
            else:
                if self.delay_optimizer_step:
                    self.state_averager.step(wait_for_delayed_updates=True)
                decision, in_background = self._gradient_round(epoch, num_peers)
            outcome = decision.outcome if decision is not None else None
            download_epoch = decision.download_epoch if decision is not None else None
            if download_epoch is None:  # (it steps)
                outcome = self._step(epoch, num_peers, outcome, in_background)
        if outcome is not None:  # (a round in the background sets it when it ends)
            self.last_round = outcome
        if download_epoch is not None:  # behind its gradient round (protocol.sync_round)
            logger.warning("collabopt: epoch %d ends without a step: %s", epoch, outcome.detail)
            # (outside the boundary's locks: the tracker fetches, others download; its group's peers may not serve
            # the epoch they step to yet: a download of an older state is tried again)
            self.load_state_from_peers(round_epoch=download_epoch)
            self._exact_check_due = True  # (it may have gone on at its own epoch: its next fresh view shows it)
        return outcome

    def _step(self, epoch: int, num_peers: int, outcome: RoundOutcome | None, in_background: Any
              ) -> RoundOutcome | None:
        """The boundary's optimizer step (and epoch) and parameter round, after its gradient round's ``outcome``."""
        next_epoch = max(epoch + 1, self.tracker.global_epoch)
        hint = self.state_averager.group_size_hint
        average_state = (num_peers > 1 and next_epoch % self.average_state_every == 0
                         and not self.state_averager.averaging_in_progress
                         and protocol.averages_parameters(outcome, hint[1] if hint and hint[0] == epoch else None))
        optimizer_step = not self.auxiliary and self.grad_averager is not None
        delay_averaging = self.delay_state_averaging and not self.auxiliary
        parameter_round = (self.state_averager.schedule_parameter_round(self.averaging_timeout)
                           if average_state and not delay_averaging else None)
        # (a parameter round still running from an earlier boundary may write its result during this one too)
        self.sync_state.parameter_round_due = average_state or self.state_averager.averaging_in_progress
        try:
            self.state_averager.step(
                increment_epoch=True, wait_for_trigger=in_background, optimizer_step=optimizer_step,
                delay_optimizer_step=self.delay_optimizer_step and optimizer_step, averaging_round=average_state,
                delay_averaging=delay_averaging, averaging_control=parameter_round,
                averaging_opts=dict(timeout=self.averaging_timeout) if average_state else None)
        except BaseException:
            if parameter_round is not None:
                parameter_round.cancel()
            raise
        finally:
            self.sync_state.parameter_round_due = False
        averaged = self._parameter_round_ended(parameter_round) if parameter_round is not None else None
        if outcome is not None:
            outcome = dataclasses.replace(outcome, parameters_averaged=averaged)
        self.tracker.update_epoch(new_epoch=self.local_epoch)
        if parameter_round is None or averaged is not None:  # (else the round writes them in the background)
            vote_for_parameters(self)
        self._exact_check_due = True
        self.reset_accumulation()
        if out_of_sync(self):
            serve_below_the_others(self)
        logger.log(self.status_loglevel, "collabopt: now at epoch %d", self.local_epoch)
        return outcome

    def _parameter_round_ended(self, control: Any) -> bool | None:
        """Whether the boundary's parameter round (the step has returned) averaged: True, False (it failed), or None
        where its all-reduce outlived the step's wait and goes on in the background (it still writes its result).
        A round the step gave up on before its all-reduce began is cancelled."""
        if not control.done():
            if control.began_allreduce:
                logger.log(self.status_loglevel, "collabopt: the parameter round's all-reduce outlived its wait: it "
                           "ends in the background")
                return None
            control.cancel()
        if control.done() and not control.cancelled() and control.exception() is None:
            return True
        error = "given up" if control.cancelled() else repr(control.exception())
        logger.log(self.status_loglevel, "collabopt: the parameter round failed (%s): this peer keeps its parameters",
                   error)
        return False

    def _gradient_round(self, epoch: int, num_peers: int) -> tuple[protocol.SyncDecision | None, Any]:
        """Average the epoch's gradients and load them into the optimizer. Returns the boundary's decision, or with
        ``delay_grad_averaging`` None and the function the delayed optimizer step awaits first."""
        control, self.scheduled_grads = self.scheduled_grads, None
        if control is not None and (control.triggered or control.done()):
            control = None  # (a round already used or failed: none this boundary)
        elif num_peers > 1:
            try:
                control = self.grad_averager.step(
                    control=control, reset_accumulators=self.delay_grad_averaging, wait=False,
                    **({} if control is not None else dict(timeout=self.averaging_timeout, **self._gather())))
            except Exception as e:  # (the averager could not start the round)
                logger.warning("collabopt: the gradient round could not start (%r): this peer steps with its own "
                               "gradients", e)
                if control is not None and not control.done():
                    self.tag_along(control)
                control = None
        elif control is not None:  # alone: nobody to average with
            control.cancel()
            control = None
        if control is None:
            logger.log(self.status_loglevel, "collabopt: no gradient round (%d peer(s) in the swarm): this peer steps "
                       "with its own gradients", num_peers)
            hint_state_group(self, None)
            self._load_local_gradients()
            return self._judge(epoch, num_peers, None), None
        if self.delay_grad_averaging:
            return None, functools.partial(self._average_in_background, control, epoch, num_peers)
        group = self._await_gradients(control)
        hint_state_group(self, control)
        return self._judge(epoch, num_peers, group), None

    def _judge(self, epoch: int, num_peers: int, group: Any, in_background: bool = False) -> protocol.SyncDecision:
        """The boundary's decision (:func:`collabopt.engine.protocol.sync_round`) from what its gradient round
        gathered (None: no round, or it failed); the lineage check's decision is followed (a download planned, the
        peer apart). Where it does not step, :meth:`end_epoch` downloads instead."""
        checks = self.sync_state.checks_lineage
        decision = protocol.sync_round(protocol.SyncRoundEvidence(
            epoch, num_peers, group=group, me=self.dht.peer_id, checks_lineage=checks,
            resync_pending=self.sync_state.resync is not None, step_pending=not (in_background or self.auxiliary)))
        if checks:
            follow_round_decision(self, decision)
        return decision

    def _await_gradients(self, control: Any) -> Any:
        """The round's group, with the averaged gradients loaded into the optimizer; None if the round failed, and
        this peer's own gradients loaded instead."""
        finished, group = self._round_result(control)
        if finished:
            self._load_averaged_gradients()
        else:
            self._load_local_gradients()
        return group

    def _average_in_background(self, control: Any, epoch: int, num_peers: int) -> None:
        """``delay_grad_averaging``: the round ends while the next epoch accumulates; a failed round steps with the
        gradients this peer handed to it, which its buffers still hold. See docs/decisions.md, "A failed gradient
        round steps with this peer's gradients"."""
        finished, group = self._round_result(control)
        if not finished:
            # a user's hivemind averager may still be writing its all-reduce's result into the buffers, under this
            # lock: let it finish first (collabopt's rounds never write the buffers of a failed round)
            with self.grad_averager.get_tensors():
                pass
        self._load_averaged_gradients()
        self.last_round = self._judge(epoch, num_peers, group, in_background=True).outcome  # (no lineage check)

    def _round_result(self, control: Any) -> tuple[bool, Any]:
        """Wait for the gradient round: whether it finished, and what its group gathered (None if it failed)."""
        try:
            group = control.result(self.averaging_timeout)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            logger.log(self.status_loglevel, "collabopt: the gradient round failed (%r): this peer steps with its "
                       "own gradients", e)
            return False, None
        logger.log(self.status_loglevel, "collabopt: gradients averaged with %d peers", len(group or ()))
        return True, group

    @torch.no_grad()
    def _load_averaged_gradients(self) -> None:
        """The round's buffers become the optimizer's gradients (offloaded: they are its gradients already)."""
        if not self.offload_optimizer:
            with self.grad_averager.get_tensors() as averaged:
                for param, gradient in zip(self.optimized_parameters(), averaged, strict=True):
                    if param.grad is None:
                        param.grad = gradient.clone()
                    else:
                        param.grad.copy_(gradient, non_blocking=True)
        self.grad_averager.notify_used_averaged_gradients()

    @torch.no_grad()
    def _load_local_gradients(self) -> None:
        """This peer's own mean gradient of the epoch into the optimizer. Straight from the accumulators where they
        and the optimizer's parameters are apart from the round's (host) buffers: on a GPU, a trip through the
        buffers moved the gradients to the host and back at every boundary a peer stepped alone."""
        averager = self.grad_averager
        if self.offload_optimizer or getattr(averager, "accumulates_in_place", False):  # (a user's averager: False)
            averager.load_accumulators_into_averager_()  # (offloaded: the buffers are the optimizer's gradients)
            self._load_averaged_gradients()
            return
        times = averager.local_times_accumulated
        scale = 1.0 / times if times else 0.0
        for param, accumulated in zip(self.optimized_parameters(), averager._grad_accumulators(), strict=True):
            if param.grad is None:
                param.grad = accumulated * scale
            else:
                if param.grad is not accumulated:  # (reuse_grad_buffers: the accumulators are param.grad)
                    param.grad.copy_(accumulated)
                param.grad.mul_(scale)
        averager.notify_used_averaged_gradients()

    def load_state_from_peers(self, round_epoch: int = -1) -> None:
        download_state(self, round_epoch=round_epoch)

