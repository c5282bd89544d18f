"""What the core does about NaN/inf (the checks themselves are :mod:`collabopt.guard`'s): which values the guard
checks in this mode, and what a non-finite step, accumulation or result costs — its samples are dropped and counted
in ``samples_skipped``, non-finite parameters are restored or re-downloaded — so that no NaN/inf ever reaches the
swarm or stays in this peer's parameters.

:class:`NonFiniteHandling` is a part of :class:`~collabopt.optimizer.CollaborativeOptimizer`, which sets the
attributes annotated below.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from collabopt.config import CollabConfig
from collabopt.diloco import DiLoCo
from collabopt.guard import NonFiniteGuard
from collabopt.interface import StepResult

logger = logging.getLogger(__name__)


class NonFiniteHandling:
    """The non-finite guard's side of :class:`~collabopt.optimizer.CollaborativeOptimizer`."""

    config: CollabConfig
    diloco: DiLoCo | None
    samples_reported: int
    _peer: Any
    _guard: NonFiniteGuard | None
    _guard_checks: str | None  # "each step", "accumulation", "parameters" (DiLoCo) or None without a guard
    _samples_skipped: int
    _stepping_samples: int
    _dropped_at_boundary: int
    _checked_version: int
    _grad_units: float | None
    zero_grad: Any  # CollaborativeOptimizer.zero_grad

    def _wire_guard(self) -> None:
        """What the non-finite guard checks in this mode (see :mod:`collabopt.guard`)."""
        if self._guard is None:
            return
        peer, config = self._peer, self.config
        if self.diloco is None and not config.use_local_updates:  # averaged gradients reach the optimizer: it
            # refuses non-finite ones (with a snapshot to undo a non-finite averaging result, where it is synchronous).
            # use_local_updates steps on the local gradients step() has just checked: a second pass over them would
            # cost as much again at every step. DiLoCo's inner steps are not wrapped: its parameters are checked
            # (_check_diloco_parameters)
            self._guard.wrap_optimizer(peer.optimizer, keep_snapshot=(
                False if config.updates_in_background else lambda: peer.parameter_round_due))
        if self.diloco is not None:
            self._guard_checks = "parameters"
        elif config.auxiliary or peer.accumulators() is None:
            self._guard_checks = "each step"
        else:
            self._guard_checks = "accumulation"
            peer.set_before_averaging(self._check_accumulation_at_boundary)

    def _check_accumulation_at_boundary(self) -> None:
        """Called by the peer at a global epoch's boundary, before the accumulated gradients are averaged (they
        include the samples of the step in progress)."""
        if not self._guard.accumulation_finite(self._peer.accumulators()):
            self._dropped_at_boundary = self._drop_accumulation(counted=self._stepping_samples)

    def _drop_accumulation(self, counted: int = 0) -> int:
        """Forget the gradients accumulated toward the next global epoch and their samples (the swarm's count loses
        them at this peer's next progress report); ``counted`` of them are not in ``samples_reported`` yet. Returns
        how many samples they were."""
        lost = self._peer.accumulated_samples
        self._peer.drop_accumulated()
        self.samples_reported -= lost - counted
        self._samples_skipped += lost
        return lost

    def _check_received_parameters(self, epoch_changed: bool) -> None:
        """Parameters that averaging made non-finite are never kept. Checked after a global step, and in the
        background modes after any step that changed the parameters (hivemind applies results at a later step)."""
        if self._guard is None:
            return
        if self.diloco is not None:
            self._check_diloco_parameters(epoch_changed)
            return
        if epoch_changed or self.config.updates_in_background:
            main = self._peer.parameters
            version = sum(p._version for p in main)  # every in-place write bumps a tensor's version counter
            if epoch_changed or version != self._checked_version:
                self._restore_finite_parameters(main)
                version = sum(p._version for p in main)
            self._checked_version = version
        self._guard.release()

    def check_gradients_each_step(self) -> None:
        """Check every step's gradients (DiLoCo: instead of the parameters on the guard's schedule). A node's ranks
        take the same inner steps: a non-finite step must be refused before any rank takes it (rank 0 alone would
        restart from the last round, the other ranks' inner optimizers kept its non-finite statistics)."""
        if self._guard is not None:
            self._guard_checks = "each step"

    def _check_diloco_parameters(self, epoch_changed: bool) -> None:
        """DiLoCo: inner steps apply every step's gradients at once, and a round applies only finite averages. The
        parameters are checked on the guard's schedule (see :mod:`collabopt.guard`) and after a round; if they are
        not finite, this peer restarts from the last round's parameters (:meth:`DiLoCo.restart_from_last_round`)."""
        if self._guard_checks != "parameters":
            return  # (a node's: each step's gradients are checked)
        if (epoch_changed or self._guard.check_due()) and not self._guard.parameters_finite(self._peer.parameters):
            self._peer.restart_from_last_round()

    def _restore_finite_parameters(self, main: list[torch.Tensor]) -> None:
        optimizer_params = [p for group in self._peer.optimizer.param_groups for p in group["params"]]
        others = [main] if any(a is not b for a, b in zip(main, optimizer_params, strict=True)) else []
        if not self._guard.restore_parameters(optimizer_params, *others):
            logger.warning("collabopt: parameters became non-finite at epoch %d and no finite copy of them is kept; "
                           "downloading the swarm's state", self._peer.local_epoch)
            self._peer.load_state_from_peers()

    def _discard_local_progress(self, samples: int, loss: Any) -> StepResult:
        """A step's gradients are not finite (an AMP overflow, or NaN/inf caught by the guard): contribute
        nothing. With ``reuse_grad_buffers``, ``param.grad`` also held the earlier steps of this epoch: they are
        dropped too."""
        skipped = samples
        if self.config.reuse_grad_buffers:
            lost = self._peer.accumulated_samples
            skipped += lost
            self.samples_reported -= lost
            self._peer.drop_accumulated()
            self._grad_units = None
        else:
            self.zero_grad()
        self._samples_skipped += skipped
        return StepResult(skipped=skipped, grads_reset=self.config.reuse_grad_buffers, loss=loss)
