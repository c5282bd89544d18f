"""The checkpoint of a :class:`~collabopt.optimizer.CollaborativeOptimizer`: ``state_dict()`` and
``load_state_dict()`` in the one format of :func:`collabopt.interface.pack_state` (the model's parameters are saved
separately). Loading waits for background work first, so that no round lands on the loaded state.

:class:`Checkpointing` is a part of :class:`~collabopt.optimizer.CollaborativeOptimizer`, which sets the attributes
annotated below.
"""

from __future__ import annotations

from typing import Any

import torch

from collabopt.config import CollabConfig
from collabopt.diloco import DiLoCo
from collabopt.guard import NonFiniteGuard, all_finite
from collabopt.interface import check_state, pack_state
from collabopt.scheduling import CollaborativeScheduler


class Checkpointing:
    """``state_dict()`` / ``load_state_dict()`` of :class:`~collabopt.optimizer.CollaborativeOptimizer`."""

    config: CollabConfig
    diloco: DiLoCo | None
    scheduler: CollaborativeScheduler | None
    samples_reported: int
    _peer: Any
    _guard: NonFiniteGuard | None
    optimizer: torch.optim.Optimizer  # (PeerViews)
    local_epoch: int  # (PeerViews)
    _check_open: Any  # (SwarmOptimizerBase)
    _check_diloco_parameters: Any  # (NonFiniteHandling)
    _advance_schedule: Any  # (CollaborativeOptimizer)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer statistics, scheduler state and local epoch (save the model's parameters separately)."""
        self._check_open()
        self._check_diloco_parameters(epoch_changed=True)  # (DiLoCo: now, not on the guard's schedule)
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        return pack_state(self.optimizer.state_dict(), scheduler, self.local_epoch, self.samples_reported)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Load the model's parameters before calling this."""
        self._check_open()
        state = check_state(state)
        if self.diloco is not None and self._guard is not None and not all_finite(self._peer.parameters):
            raise ValueError("collabopt: the model's parameters are not finite (NaN/inf): in DiLoCo mode loaded "
                             "parameters become the anchor this peer serves to the swarm; load a finite checkpoint")
        # DiLoCo: a round in flight is not applied onto the loaded parameters (they become the anchor)
        self._peer.finish_background_work(apply=self.diloco is None)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.config.offload_optimizer:  # the offloaded copy must hold the (restored) model parameters
            with torch.no_grad():
                opt_params = [p for group in self.optimizer.param_groups for p in group["params"]]
                for main, offloaded in zip(self._peer.parameters, opt_params, strict=True):
                    offloaded.copy_(main)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.samples_reported = int(state.get("samples_reported", 0))
        self._peer.restore_epoch(int(state["local_epoch"]))
        self._advance_schedule()
