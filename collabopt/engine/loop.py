"""One peer's training loop, composed from hivemind's parts: the progress tracker (the swarm's samples and epoch),
the state averager (parameters, optimizer statistics, epoch; it serves downloads) and the gradient averager.

A local step accumulates its samples and reports them; once the swarm's samples reach the target, the mode's round
ends the global epoch (:meth:`PeerLoop.end_epoch`): :class:`~collabopt.engine.sync_round.SyncLoop` or
:class:`~collabopt.engine.diloco_round.DiLoCoLoop`. The loop does not subclass ``hivemind.Optimizer``; its
arguments are that class's, so that users' hivemind options keep their meaning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import CompressionBase, NoCompression
from hivemind.optim.grad_averager import GradientAverager

from collabopt.engine import protocol
from collabopt.engine.download_votes import DownloadVotes
from collabopt.engine.downloads import StateDownloads
from collabopt.engine.model_records import ModelCheck
from collabopt.engine.progress import make_progress_tracker
from collabopt.engine.state import ConsistentStateAverager, averages_parameters_in_place
from collabopt.engine.state_service import StateService

logger = logging.getLogger(__name__)


class PeerLoop:
    """The services of one peer and its local step; the round that ends a global epoch is the subclass's.

    Built in the process's main thread (hivemind's averagers install signal handlers).
    """

    model_check: ModelCheck | None = None  # this peer's model record, and the check before its first round
    averages_parameters = True  # the mode has parameter rounds (DiLoCo: none)

    def __init__(self, *, dht: Any, run_id: str, target_batch_size: int, optimizer: Any, params: Any = None,
                 scheduler: Any = None, batch_size_per_step: int | None = None, matchmaking_time: float = 15.0,
                 averaging_timeout: float = 60.0, allreduce_timeout: float | None = None,
                 next_chunk_timeout: float | None = None, load_state_timeout: float = 600.0,
                 reuse_grad_buffers: bool = False, offload_optimizer: bool | None = None,
                 delay_optimizer_step: bool | None = None, delay_grad_averaging: bool = False,
                 delay_state_averaging: bool = True, average_state_every: int = 1, use_local_updates: bool = False,
                 client_mode: bool | None = None, auxiliary: bool = False,
                 grad_compression: CompressionBase = NoCompression(), grad_averager_factory: Any = None,
                 state_averaging_compression: CompressionBase = NoCompression(),
                 load_state_compression: CompressionBase = NoCompression(),
                 average_opt_statistics: Sequence[str] = (), extra_tensors: Sequence[torch.Tensor] = (),
                 averager_opts: dict | None = None, tracker_opts: dict | None = None,
                 performance_ema_alpha: float = 0.1, shutdown_timeout: float = 5.0, verbose: bool = False):
        self._parent_pid = os.getpid()
        # (batch_size_per_step is accepted as hivemind.Optimizer's, and unused: each step gives its batch size)
        self.dht, self.run_id, self.target_batch_size = dht, run_id, target_batch_size
        self.client_mode = dht.client_mode if client_mode is None else client_mode
        self.auxiliary = auxiliary
        self.offload_optimizer = (params is not None and not use_local_updates) if offload_optimizer is None \
            else offload_optimizer
        self.delay_grad_averaging = delay_grad_averaging
        self.delay_optimizer_step = delay_grad_averaging if delay_optimizer_step is None else delay_optimizer_step
        self.delay_state_averaging, self.average_state_every = delay_state_averaging, average_state_every
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.allreduce_timeout = averaging_timeout if allreduce_timeout is None else allreduce_timeout
        self.next_chunk_timeout = matchmaking_time if next_chunk_timeout is None else next_chunk_timeout
        self.load_state_timeout, self.shutdown_timeout = load_state_timeout, shutdown_timeout
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        _check_arguments(self, optimizer, params, use_local_updates, reuse_grad_buffers, grad_averager_factory)
        self.scheduled_grads: Any = None  # the gradient (DiLoCo: pseudo-gradient) round scheduled for this epoch

        self.tracker = self._make_progress_tracker(
            target_batch_size, performance_ema_alpha=performance_ema_alpha, **(tracker_opts or {}))
        self.state_averager = self._make_state_averager(
            optimizer=optimizer, params=params, scheduler=scheduler,
            delta_rule_averaging=use_local_updates and delay_state_averaging,
            compression=state_averaging_compression, state_compression=load_state_compression,
            average_opt_statistics=average_opt_statistics, performance_ema_alpha=performance_ema_alpha,
            extra_tensors=extra_tensors, **(averager_opts or {}))
        self.grad_averager = None if use_local_updates else self._make_gradient_averager(
            grad_averager_factory, reuse_grad_buffers=reuse_grad_buffers, compression=grad_compression)
        if self.state_averager.verify_downloads:  # this peer's votes are signed with its progress records' key
            self.state_averager.votes = DownloadVotes(dht, self.tracker.dht, run_id, self.tracker.local_public_key)
            self.state_averager.votes.serves = not self.client_mode  # (a client can answer no challenge)
        # serving this peer's state and downloading the swarm's: collabopt's state service (engine/state_service.py)
        self.state_service = StateService(dht, self.state_averager)
        self.state_downloads = StateDownloads(self.state_service, self.state_averager)
        self.model_check = ModelCheck(self)

    # ---- building the services

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> Any:
        return make_progress_tracker(self, target_batch_size, **kwargs)

    def _make_state_averager(self, **kwargs: Any) -> Any:
        if "reuse_tensors" not in kwargs and averages_parameters_in_place(self, kwargs):
            kwargs["reuse_tensors"] = True
        return ConsistentStateAverager(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer, status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout, client_mode=self.client_mode, auxiliary=self.auxiliary,
            parameter_rounds=self.averages_parameters, **kwargs)

    def _make_gradient_averager(self, factory: Any, **kwargs: Any) -> Any:
        averager = (factory or GradientAverager)(
            dht=self.dht, prefix=f"{self.run_id}_grad_averager", parameters=self.state_averager.main_parameters,
            min_matchmaking_time=self.matchmaking_time, allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)
        if self.offload_optimizer:  # the offloaded optimizer steps on the round's buffers themselves
            with averager.get_tensors() as buffers:
                for param, buffer in zip(self.optimized_parameters(), buffers, strict=True):
                    param.grad = buffer
        return averager

    # ---- the local step

    def step(self, batch_size: int | None = None) -> bool:
        """One local step of ``batch_size`` samples, whose gradients are in the parameters' ``.grad`` (``None``: an
        auxiliary peer's turn, which only takes part in rounds). Returns whether the step's samples count
        (:func:`~collabopt.engine.protocol.step_accepted`): False where it downloaded the swarm's state first and
        dropped them, where the boundary it ended applied no update (it was behind and downloaded instead:
        :func:`~collabopt.engine.protocol.boundary_accepted`), and for an auxiliary peer's turn."""
        self.state_averager.step(apply_delayed_updates=True)  # a delayed update that finished is applied now
        if self.state_averager.votes is not None:
            self.state_averager.votes.keep_alive()
        if not self.auxiliary:
            if batch_size is None:
                raise ValueError("a training peer's step needs its batch size")
            decision = self.step_decision()
            if decision.download:
                logger.log(self.status_loglevel, "collabopt: this peer is behind the swarm: downloading its state")
                self.load_state_from_peers()
                return protocol.step_accepted(decision, behind_after=self.local_epoch < self.tracker.global_epoch)
            self._accumulate(batch_size)
        if self.model_check is not None:  # a peer of another model than the swarm's stops before its first round
            self.model_check.before_contribution()
        self.schedule_rounds()
        if self.tracker.ready_to_update_epoch and not protocol.boundary_accepted(self.end_epoch()):
            return False
        return not self.auxiliary

    def _accumulate(self, batch_size: int) -> None:
        if self.grad_averager is not None:
            self.grad_averager.accumulate_grads_(batch_size)
            self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
            return
        # use_local_updates: the optimizer steps at every local step; rounds average parameters only
        self.tracker.report_local_progress(self.local_epoch, self.tracker.local_progress.samples_accumulated
                                           + batch_size)
        self.state_averager.step(increment_epoch=False, optimizer_step=True,
                                 delay_optimizer_step=self.delay_optimizer_step)

    def step_decision(self) -> protocol.StepDecision:
        """Whether this peer must download the swarm's state before its step counts, and why (the mode's rule, in
        :mod:`collabopt.engine.protocol`)."""
        raise NotImplementedError

    def schedule_rounds(self) -> None:
        """Schedule the coming round's matchmaking, where the epoch is about to end (the mode's rule)."""
        raise NotImplementedError

    def end_epoch(self) -> Any:
        """The round that ends this peer's global epoch (the mode's); the synchronous mode returns its outcome."""
        raise NotImplementedError

    def load_state_from_peers(self) -> None:
        """Download the swarm's state (the mode's rule of what it keeps)."""
        raise NotImplementedError

    # ---- shared by the rounds

    def tag_along(self, control: Any) -> None:
        """Take part with nothing (zeros, weight 0) in a round whose group may have formed already: leaving it would
        make its members match again, and wait. Waits until the round ends.

        collabopt's rounds send zeros of their own: the shared buffers are the epoch's accumulation (accumulated in
        place) or the offloaded optimizer's gradients, which a failed round still steps with. A user's hivemind
        averager sends its buffers, so they are zeroed for it (weight 0 does not keep NaN out of the others' average:
        0 * NaN is NaN, and the buffers may hold one)."""
        if not control.triggered:
            own_zeros = getattr(control, "tag_along", None)
            if callable(own_zeros):  # (collabopt.engine.gradient_rounds.GradientRound)
                own_zeros()
            else:
                if self.grad_averager is not None:  # (only gradient rounds are scheduled ahead)
                    with torch.no_grad(), self.grad_averager.get_tensors() as buffers:
                        for buffer in buffers:
                            buffer.zero_()
                control.weight = 0
                control.allow_allreduce()
        if not control.done():
            try:
                control.result(self.averaging_timeout)
            except Exception as e:
                logger.log(self.status_loglevel, "collabopt: a round this peer took part in with nothing failed: %r",
                           e)
                if not control.done():
                    control.cancel()
            except BaseException:  # SIGTERM (collabopt.Terminated) or Ctrl+C: stop waiting, leave the round
                if not control.done():
                    control.cancel()
                raise

    def reset_accumulation(self) -> None:
        """Start the next epoch's accumulation, and serve this peer's state with its epoch as priority."""
        if not self.client_mode:
            self.state_averager.state_sharing_priority = self.local_epoch
        if self.grad_averager is not None and not self.auxiliary:
            self.grad_averager.reset_accumulated_grads_()
            if not self.client_mode:
                self.grad_averager.state_sharing_priority = self.local_epoch

    def optimized_parameters(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps (the model's parameters, or their host copies when offloaded)."""
        return [param for group in self.state_averager.optimizer.param_groups for param in group["params"]]

    # ---- what the peer holds

    @property
    def local_epoch(self) -> int:
        return self.state_averager.local_epoch

    @property
    def use_gradient_averaging(self) -> bool:
        return self.grad_averager is not None

    @property
    def param_groups(self) -> tuple[dict, ...]:
        """The optimizer's groups over the model's parameters (not their offloaded copies)."""
        groups, start = [], 0
        main = self.state_averager.main_parameters
        for group in self.state_averager.optimizer.param_groups:
            size = len(group["params"])
            groups.append(dict(group, params=main[start:start + size]))
            start += size
        return tuple(groups)

    def is_alive(self) -> bool:
        return self.state_averager.is_alive()

    def shutdown(self) -> None:
        """Leave the swarm: the progress record goes, a round in matchmaking is left, one under way is finished with
        nothing (its members need this peer's parts), then the averagers stop."""
        self.tracker.shutdown(self.shutdown_timeout)
        self.state_averager.step(wait_for_delayed_updates=True)
        control, self.scheduled_grads = self.scheduled_grads, None
        if control is not None and not control.done():
            if control.stage == AveragingStage.LOOKING_FOR_GROUP:
                control.cancel()
            else:
                self.tag_along(control)
        if getattr(self, "state_service", None) is not None:
            self.state_service.close()
        self.state_averager.shutdown()
        if self.grad_averager is not None:
            self.grad_averager.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_parent_pid", None) == os.getpid() and hasattr(self, "grad_averager") and self.is_alive():
            self.shutdown()


def _check_arguments(loop: PeerLoop, optimizer: Any, params: Any, use_local_updates: bool,
                     reuse_grad_buffers: bool, grad_averager_factory: Any) -> None:
    """The combinations the loop cannot run (collabopt's config says so earlier, in users' words)."""
    if loop.delay_grad_averaging and not loop.delay_optimizer_step:
        raise ValueError("delay_grad_averaging needs delay_optimizer_step")
    if loop.client_mode and loop.auxiliary:
        raise ValueError("client-mode peers cannot be auxiliary peers")
    if params is None and (loop.offload_optimizer or loop.delay_optimizer_step):
        raise ValueError("offload_optimizer and delayed steps need optimizer=<factory> and params=")
    if params is not None and not callable(optimizer):
        raise ValueError("with params=, optimizer must be a factory: callable(param_groups) -> torch optimizer")
    if use_local_updates and (reuse_grad_buffers or loop.delay_grad_averaging or grad_averager_factory is not None):
        raise ValueError("use_local_updates accumulates no gradients: drop reuse_grad_buffers, delay_grad_averaging "
                         "and grad_averager_factory")
