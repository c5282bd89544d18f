"""What every collaborative optimizer offers: the outcome of a step, the shared protocol, the checkpoint format.

:class:`~collabopt.CollaborativeOptimizer` (one process) and :class:`~collabopt.node.NodeOptimizer` (several ranks
as one peer) both satisfy :class:`SwarmOptimizer`, so adapters and user code treat them alike. A step's outcome
travels back as a :class:`StepResult` value; checkpoints of both use one format (:func:`pack_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from collabopt.errors import ConfigurationError

STATE_FORMAT = "collabopt/1"


# why a round ended as it did: the same words in every mode, in the step's result, the node's status, the peer's
# metrics record and the status page (their index is what a node's ranks exchange)
ROUND_REASONS = (
    "averaged",  # applied: the group's average
    "alone",  # applied: this peer's own update (no other peer in the swarm)
    "no group",  # applied: the gradient round failed (no group, a timeout): this peer stepped with its own gradients
    "partial",  # applied, re-synchronizes: part of the average arrived (hivemind used this peer's values for the rest)
    "apart",  # applied, re-synchronizes: its parameters were not its group's (another lineage, or a partial round)
    "behind",  # not applied, re-synchronizes: the swarm was ahead of this peer (it downloads the swarm's state
    # instead of stepping; applied where the step came first: delay_grad_averaging, an auxiliary peer)
    "non-finite average",  # not applied: the group's average held NaN/inf (the non-finite guard refused it)
    "no quorum",  # not applied (DiLoCo): fewer than half of the swarm's peers averaged
    "anchor differs",  # not applied (DiLoCo): this peer's anchor was not its group's
    "averaging failed",  # not applied (DiLoCo): the all-reduce failed, or part of its average did not arrive
    "nothing to apply",  # not applied (DiLoCo): no progress since the last round
)


@dataclass(frozen=True)
class RoundOutcome:
    """What one round (a global epoch's boundary, or a DiLoCo round) did on this peer: the one verdict its mode
    reached, in words every mode shares (:data:`ROUND_REASONS`).

    Attributes:
        applied: the round's update was taken (this peer moved to the next epoch).
        reason: one of :data:`ROUND_REASONS`.
        group_size: peers that averaged together (1 when alone or when averaging failed).
        weight: samples this peer's contribution counted for (0: refused as non-finite, or left out by the robust
            aggregate; a compressed-DiLoCo member that waited, not one of its round's contributors, counts its
            samples: its error feedback sends its pseudo-gradient in a later round).
        num_peers: the swarm's size as this peer counted it.
        resync: this peer knows its parameters are not the swarm's: it downloads the swarm's state (or takes its
            group's at its next round) before it contributes again.
        epoch: the epoch the round ended (-1: unknown).
        detail: what else this peer knows of it (an error), for its log only.
        parameters_averaged: whether the parameter round that followed averaged this peer's parameters with its
            group's (synchronous mode, in the foreground); None where none ran or it ran in the background.
    """

    applied: bool
    reason: str
    group_size: int = 1
    weight: float = 0.0
    num_peers: int = 1
    resync: bool = False
    epoch: int = -1
    detail: str = ""
    parameters_averaged: bool | None = None

    def summary(self) -> str:
        """A short line (at most 64 characters): what a peer's metrics record and the status page show."""
        verdict = "applied" if self.applied else "not applied"
        if self.resync:
            verdict += ", re-syncs"
        group = f" ({self.group_size} of {self.num_peers})" if self.group_size > 1 else ""
        parameters = ", parameter round failed" if self.parameters_averaged is False else ""
        return f"{verdict}: {self.reason}{group}{parameters}"[:64]

    def __str__(self) -> str:
        return f"epoch {self.epoch}: {self.summary()}" + (f" [{self.detail}]" if self.detail else "")


@dataclass(frozen=True)
class StepResult:
    """What one ``step()`` did.

    Attributes:
        samples: samples this step contributed to the swarm (0 when skipped or dropped).
        skipped: samples that were not contributed: NaN/inf gradients (an AMP overflow, or caught by the
            non-finite guard in the accumulation, which it then drops whole: the samples of the epoch's earlier
            steps too), and with ``reuse_grad_buffers`` the accumulation an AMP overflow discarded.
        epoch_changed: a global epoch happened (or a state download moved this peer to another epoch).
        grads_reset: with ``reuse_grad_buffers``, ``param.grad`` was cleared (hivemind used the accumulation, or
            the non-finite guard dropped it).
        grad_factor: the factor this step multiplied ``param.grad`` by in place (1.0, except with
            ``reuse_grad_buffers`` and AMP after ``scaler.unscale_()``: back to the loss scale's units).
        loss: what the closure returned, if one was given.
        round: the outcome of the round this step ended (:class:`RoundOutcome`), or None if it ended none.
    """

    samples: int = 0
    skipped: int = 0
    epoch_changed: bool = False
    grads_reset: bool = False
    grad_factor: float = 1.0
    loss: Any = None
    round: RoundOutcome | None = None


SNAPSHOT_FIELDS = ("local_epoch", "global_epoch", "num_peers", "samples_accumulated", "target_batch_size",
                   "samples_per_second", "eta_next_epoch", "samples_skipped", "nonfinite_steps")


def swarm_snapshot(optimizer: SwarmOptimizer) -> dict[str, float]:
    """``metrics()`` of a collaborative optimizer: its swarm state and learning rate, ready for a logger."""
    return dict({name: getattr(optimizer, name) for name in SNAPSHOT_FIELDS}, lr=optimizer.get_lr()[0])


def swarm_metrics(optimizer: SwarmOptimizer | None) -> dict[str, float]:
    """The metrics every adapter logs: ``metrics()`` named ``swarm/<name>`` (``swarm/num_peers``,
    ``swarm/local_epoch``, ``swarm/samples_per_second``, ``swarm/lr``, ...), each name that of the optimizer's
    attribute. Built here once, so that the adapters' names cannot drift apart. Empty without an open optimizer."""
    if optimizer is None or optimizer.closed:
        return {}
    return {f"swarm/{name}": float(value) for name, value in optimizer.metrics().items()}


@runtime_checkable
class SwarmOptimizer(Protocol):
    """The API of a collaborative optimizer (:class:`~collabopt.CollaborativeOptimizer` and
    :class:`~collabopt.node.NodeOptimizer`)."""

    run_id: str
    target_batch_size: int
    samples_reported: int
    samples_skipped: int

    closed: bool
    optimizer: torch.optim.Optimizer
    param_groups: list[dict]
    scheduler: Any
    local_epoch: int
    global_epoch: int
    num_peers: int
    samples_accumulated: int
    samples_per_second: float
    eta_next_epoch: float
    nonfinite_steps: int
    out_of_sync: bool
    last_round: RoundOutcome | None

    def step(self, closure: Callable[[], Any] | None = None, *, batch: Any = None,
             batch_size: int | None = None) -> StepResult: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def report_metric(self, value: float) -> None: ...
    def report_loss(self, loss: Any) -> None: ...
    def flush(self) -> None: ...
    def serve_final_state(self, timeout: float | None = None) -> str: ...
    def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> bool: ...
    def load_state_from_peers(self) -> None: ...
    def get_lr(self) -> list[float]: ...
    def metrics(self) -> dict[str, float]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def end_run(self, serve: bool) -> str | None: ...
    def close(self) -> None: ...


class SwarmOptimizerBase:
    """What the core and the node share: open until :meth:`close` (idempotent), a context manager, and the look of a
    torch optimizer (``state``, ``defaults``) over the optimizer that is really stepped."""

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def metrics(self) -> dict[str, float]:
        """A snapshot of the swarm state (the same on every rank of a node), for a progress bar or a logger."""
        return swarm_snapshot(self)

    def _begin_step(self, closure: Callable[[], Any] | None) -> tuple[Any, Any, Any]:
        """Start a ``step()``: check this is open, run the closure; return its loss and the ``grad_scale`` /
        ``found_inf`` that ``torch.amp.GradScaler.step()`` sets on the optimizer for the duration of the call."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss, self.__dict__.get("grad_scale"), self.__dict__.get("found_inf")

    def close(self) -> None:
        raise NotImplementedError

    def end_run(self, serve: bool) -> str | None:
        """The end of a run, for adapters: ``serve_final_state()`` if ``serve`` (training ended normally), then
        :meth:`close` (also where serving raised). Returns why serving ended, or None where it did not serve."""
        try:
            return self.serve_final_state() if serve and not self._closed else None
        finally:
            self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; create a new one to keep training")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _describe(self) -> str:
        return ""

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"epoch={getattr(self, 'local_epoch', '?')}"
        return f"{type(self).__name__}({self._describe()}{state})"


def pack_state(optimizer: dict[str, Any], scheduler: dict[str, Any] | None, local_epoch: int,
               samples_reported: int) -> dict[str, Any]:
    """The checkpoint of a collaborative optimizer (model parameters are saved separately)."""
    return {"optimizer": optimizer, "scheduler": scheduler, "local_epoch": int(local_epoch),
            "samples_reported": int(samples_reported), "format": STATE_FORMAT}


def check_state(state: Any) -> dict[str, Any]:
    """Return ``state`` if it is what :func:`pack_state` made, else raise a :class:`ConfigurationError`."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ConfigurationError("state", "not a collabopt optimizer state_dict()",
                                 "pass what copt.state_dict() returned (on rank 0 for a node)")
    return state


def is_collaborative_state(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") == STATE_FORMAT


__all__ = ["STATE_FORMAT", "SNAPSHOT_FIELDS", "SwarmOptimizerBase", "StepResult", "SwarmOptimizer", "check_state",
           "is_collaborative_state", "pack_state", "swarm_metrics", "swarm_snapshot"]
