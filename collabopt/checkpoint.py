"""The checkpoint of a :class:`~collabopt.optimizer.CollaborativeOptimizer`: ``state_dict()`` and
``load_state_dict()`` in the one format of :func:`collabopt.interface.pack_state` (the model's parameters are saved
separately). Loading waits for background work first, so that no round lands on the loaded state.

With ``pseudo_gradient_compression`` on, the checkpoint also holds this peer's error-feedback buffer (under
``"error_feedback"``) and loading restores it: what the compression has not sent yet is the peer's own and is lost
otherwise. A state download never carries it (joiners start from zeros); a checkpoint without one (dense DiLoCo, or
taken before the option was on) restores zeros, and says so in the log.

:class:`Checkpointing` is a part of :class:`~collabopt.optimizer.CollaborativeOptimizer`, which sets the attributes
annotated below.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from collabopt.config import CollabConfig
from collabopt.diloco import DiLoCo
from collabopt.errors import ConfigurationError
from collabopt.guard import NonFiniteGuard, all_finite
from collabopt.interface import check_state, pack_state
from collabopt.scheduling import CollaborativeScheduler

logger = logging.getLogger(__name__)
ERROR_FEEDBACK_KEY = "error_feedback"


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
        """Optimizer statistics, scheduler state, local epoch and (``pseudo_gradient_compression``) the
        error-feedback buffer. Save the model's parameters separately."""
        self._check_open()
        self._check_diloco_parameters(epoch_changed=True)  # (DiLoCo: now, not on the guard's schedule)
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        state = pack_state(self.optimizer.state_dict(), scheduler, self.local_epoch, self.samples_reported)
        feedback = self._error_feedback()
        if feedback is not None:
            state[ERROR_FEEDBACK_KEY] = feedback.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Load the model's parameters before calling this."""
        self._check_open()
        state = check_state(state)
        if self.diloco is not None and self._guard is not None and not all_finite(self._peer.parameters):
            raise ValueError("collabopt: the model's parameters are not finite (NaN/inf): in DiLoCo mode loaded "
                             "parameters become the anchor this peer serves to the swarm; load a finite checkpoint")
        # DiLoCo: a round in flight is not applied onto the loaded parameters (they become the anchor)
        self._peer.finish_background_work(apply=self.diloco is None)
        self._load_error_feedback(state)  # (first: a buffer that does not fit changes nothing)
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

    def _error_feedback(self) -> Any:
        """This peer's :class:`~collabopt.error_feedback.ErrorFeedback` (compressed DiLoCo), else None."""
        return getattr(getattr(getattr(self._peer, "loop", None), "grad_averager", None), "error_feedback", None)

    def _load_error_feedback(self, state: dict[str, Any]) -> None:
        """Restore the checkpoint's error-feedback buffer, checked against the model (zeros where it holds none)."""
        feedback, saved = self._error_feedback(), state.get(ERROR_FEEDBACK_KEY)
        if feedback is None:
            if saved is not None:
                logger.info("collabopt: the checkpoint's error-feedback buffer is not used: "
                            "pseudo_gradient_compression is off")
            return
        if saved is None:
            feedback.reset()
            logger.warning("collabopt: the checkpoint holds no error-feedback buffer (saved without "
                           "pseudo_gradient_compression): this peer's buffer starts from zeros")
            return
        names = getattr(getattr(getattr(self._peer, "loop", None), "state_averager", None), "model_names", None)
        try:
            feedback.load_state_dict(saved, names=names)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigurationError(
                "state", f"its error-feedback buffer does not fit this model: {e}",
                f"load the checkpoint this model saved, or drop state[{ERROR_FEEDBACK_KEY!r}] to start the buffer "
                "from zeros") from e
