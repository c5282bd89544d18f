"""What every rank of a node reads without a collective (:class:`NodeView`, the base of
:class:`~collabopt.node.NodeOptimizer`): the swarm's values, the optimizer it shows, the checkpoint.

Rule: rank 0 reads its core while the core is open; the other ranks (and rank 0 after closing) read the last
:class:`~collabopt.node_status.NodeStatus` rank 0 sent. Reason: these calls are local, so a rank may make them any
number of times, and every rank still shows the values of the one peer the node is.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from collabopt.interface import RoundOutcome, SwarmOptimizerBase, check_state, pack_state
from collabopt.node_status import SWARM_VALUES, NodeStatus
from collabopt.optimizer import CollaborativeOptimizer
from collabopt.scheduling import CollaborativeScheduler, group_hyperparameters

logger = logging.getLogger(__name__)


class NodeView(SwarmOptimizerBase):
    """The collective-free half of a node; :class:`~collabopt.node.NodeOptimizer` sets these attributes and keeps
    ``_status`` and ``_lrs`` up to date at every collective call."""

    rank: int
    user_optimizer: torch.optim.Optimizer
    scheduler: CollaborativeScheduler | None
    _copt: CollaborativeOptimizer | None  # rank 0's core (None on other ranks)
    _status: NodeStatus  # what rank 0 sent with the last collective call
    _lrs: list[float]  # the learning rates rank 0 sent last

    @property
    def is_swarm_rank(self) -> bool:
        """True on the rank that talks to the swarm (global rank 0)."""
        return self.rank == 0

    @property
    def collaborative_optimizer(self) -> CollaborativeOptimizer | None:
        """Rank 0's CollaborativeOptimizer (None on other ranks)."""
        return self._copt

    @property
    def dht(self) -> Any:
        """Rank 0's DHT (None on other ranks)."""
        return self._copt.dht if self._copt is not None else None

    @property
    def loop(self) -> Any:
        return self._copt.loop if self._copt is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer hivemind steps on rank 0; this rank's optimizer elsewhere."""
        return self._copt.optimizer if self._copt is not None else self.user_optimizer

    @property
    def param_groups(self) -> list[dict]:
        """This rank's param groups over the model's parameters (hyperparameters kept equal to rank 0's)."""
        return self.user_optimizer.param_groups

    def _live(self, name: str) -> Any:
        """Rank 0 reads its core; other ranks (and a closed core) the last status rank 0 sent."""
        if self._copt is not None and not self._copt.closed:
            try:
                return getattr(self._copt, name)
            except Exception as e:  # informational value; fall back to the last broadcast one
                logger.debug("collabopt: cannot read a swarm metric: %r", e)
        return self._status.swarm[name]

    def __getattr__(self, name: str) -> Any:
        """The swarm's values of :data:`SWARM_VALUES` (``local_epoch``, ``num_peers``, ``samples_reported`` — of all
        ranks —, ...; see :class:`~collabopt.interface.SwarmOptimizer`): rank 0's own, elsewhere what rank 0 sent
        with the last collective call. Only called for names not found otherwise."""
        if name in SWARM_VALUES:
            return type(SWARM_VALUES[name])(self._live(name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def last_round(self) -> RoundOutcome | None:
        """The outcome of the node's last round (see :attr:`CollaborativeOptimizer.last_round`): rank 0's own,
        elsewhere what rank 0 sent with the last collective call (without its ``detail``)."""
        if self._copt is not None and not self._copt.closed:
            return self._copt.last_round
        return self._status.last_round

    def get_lr(self) -> list[float]:
        """Learning rates of the optimizer hivemind steps (the same on every rank)."""
        if self._copt is not None and not self._copt.closed:
            return self._copt.get_lr()
        return list(self._lrs)

    def state_dict(self) -> dict[str, Any]:
        """Local (no collective). Rank 0's holds the optimizer statistics: save rank 0's."""
        self._check_open()
        if self._copt is not None:
            return self._copt.state_dict()
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        return pack_state(self.user_optimizer.state_dict(), scheduler, self.local_epoch, self.samples_reported)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Local (no collective): every rank loads the same saved state. Load the model's parameters first."""
        self._check_open()
        state = check_state(state)
        if self._copt is not None:
            self._copt.load_state_dict(state)
            self._apply_hyperparameters(group_hyperparameters(self._copt.optimizer))
        else:
            groups = state["optimizer"]["param_groups"]
            self._apply_hyperparameters([{k: v for k, v in g.items() if k != "params"} for g in groups])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
        self._status.swarm.update(local_epoch=int(state["local_epoch"]),
                                  samples_reported=int(state.get("samples_reported", 0)))

    def report_metric(self, value: float) -> None:
        """Report a metric for ``ReduceLROnPlateau`` (rank 0's reports are used)."""
        if self._copt is not None:
            self._copt.report_metric(value)

    def report_loss(self, loss: Any) -> None:
        """Report a training loss for ``collabopt monitor`` (rank 0's are published; on other ranks it does
        nothing). Local: no collective."""
        if self._copt is not None:
            self._copt.report_loss(loss)

    def _apply_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        """Make the user's optimizer show the hyperparameters hivemind's optimizer uses (lr, betas, ...)."""
        self._lrs = [float(g["lr"]) for g in groups]
        if self._copt is not None and self._copt.optimizer is self.user_optimizer:
            return
        for group, values in zip(self.user_optimizer.param_groups, groups, strict=True):
            group.update(values)
