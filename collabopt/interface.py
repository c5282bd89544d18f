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


@dataclass(frozen=True)
class StepResult:
    """What one ``step()`` did.

    Attributes:
        samples: samples this step contributed to the swarm (0 when skipped or dropped).
        skipped: samples that were not contributed: an AMP overflow, or (with ``reuse_grad_buffers``) the
            accumulation that an overflow discarded.
        epoch_changed: a global epoch happened (or a state download moved this peer to another epoch).
        grads_reset: with ``reuse_grad_buffers``, ``param.grad`` was cleared (hivemind used the accumulation).
        grad_scale: with ``reuse_grad_buffers`` and AMP, the loss scale ``param.grad`` is now expressed in.
        loss: what the closure returned, if one was given.
    """

    samples: int = 0
    skipped: int = 0
    epoch_changed: bool = False
    grads_reset: bool = False
    grad_scale: float = 1.0
    loss: Any = None


@runtime_checkable
class SwarmOptimizer(Protocol):
    """The API of a collaborative optimizer (:class:`~collabopt.CollaborativeOptimizer` and
    :class:`~collabopt.node.NodeOptimizer`)."""

    run_id: str
    target_batch_size: int
    samples_reported: int
    samples_skipped: int

    def step(self, closure: Callable[[], Any] | None = None, *, batch: Any = None,
             batch_size: int | None = None) -> StepResult: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def report_metric(self, value: float) -> None: ...
    def flush(self) -> None: ...
    def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> bool: ...
    def load_state_from_peers(self) -> None: ...
    def get_lr(self) -> list[float]: ...
    def metrics(self) -> dict[str, float]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def param_groups(self) -> list[dict]: ...
    @property
    def scheduler(self) -> Any: ...
    @property
    def local_epoch(self) -> int: ...
    @property
    def global_epoch(self) -> int: ...
    @property
    def num_peers(self) -> int: ...
    @property
    def samples_accumulated(self) -> int: ...
    @property
    def samples_per_second(self) -> float: ...
    @property
    def eta_next_epoch(self) -> float: ...


SNAPSHOT_FIELDS = ("local_epoch", "global_epoch", "num_peers", "samples_accumulated", "target_batch_size",
                   "samples_per_second", "eta_next_epoch")


def swarm_snapshot(optimizer: SwarmOptimizer) -> dict[str, float]:
    """``metrics()`` of a collaborative optimizer: its swarm state and learning rate, ready for a logger."""
    return dict({name: getattr(optimizer, name) for name in SNAPSHOT_FIELDS}, lr=optimizer.get_lr()[0])


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


__all__ = ["STATE_FORMAT", "SNAPSHOT_FIELDS", "StepResult", "SwarmOptimizer", "check_state", "is_collaborative_state",
           "pack_state", "swarm_snapshot"]
