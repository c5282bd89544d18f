"""What rank 0 of a node tells every rank after each collective call (:class:`NodeStatus`): flags, the step's
:class:`~collabopt.interface.StepResult`, the round's outcome and the swarm's values, as one float64 tensor (one
broadcast)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from collabopt.interface import ROUND_REASONS, RoundOutcome, StepResult

logger = logging.getLogger(__name__)

# swarm values rank 0 sends to every rank (the other ranks show them as their own)
SWARM_VALUES = {"local_epoch": 0, "global_epoch": 0, "num_peers": 1, "samples_accumulated": 0,
                "samples_per_second": 0.0, "eta_next_epoch": 0.0, "samples_reported": 0, "samples_skipped": 0,
                "nonfinite_steps": 0, "out_of_sync": False}
_RESULT_FIELDS = [f for f in dataclasses.fields(StepResult) if f.name not in ("loss", "round")]
_CAST = {"bool": bool, "int": int, "float": float}
# a RoundOutcome as floats: present, applied, reason, group size, weight, peers, resync, epoch, parameters averaged
_ROUND_SIZE = 9


def round_to_floats(outcome: RoundOutcome | None) -> list[float]:
    """A round's outcome as floats (its ``detail`` stays on rank 0), for :class:`NodeStatus`."""
    if outcome is None:
        return [0.0] * _ROUND_SIZE
    reason = ROUND_REASONS.index(outcome.reason) if outcome.reason in ROUND_REASONS else -1
    return [1.0, float(outcome.applied), float(reason), float(outcome.group_size), float(outcome.weight),
            float(outcome.num_peers), float(outcome.resync), float(outcome.epoch),
            -1.0 if outcome.parameters_averaged is None else float(outcome.parameters_averaged)]


def round_from_floats(values: list[float]) -> RoundOutcome | None:
    present, applied, reason, group_size, weight, num_peers, resync, epoch, parameters = values
    if not present:
        return None
    return RoundOutcome(bool(applied), ROUND_REASONS[int(reason)] if reason >= 0 else "?", int(group_size), weight,
                        int(num_peers), bool(resync), int(epoch),
                        parameters_averaged=None if parameters < 0 else bool(parameters))


@dataclass
class NodeStatus:
    """What rank 0 tells every rank after each collective call: flags, the step's :class:`StepResult` and the
    swarm's values. It travels as one float64 tensor (one broadcast)."""

    error: bool = False
    params_changed: bool = False
    hyperparameters_follow: bool = False
    result: StepResult = dataclasses.field(default_factory=StepResult)
    swarm: dict[str, float] = dataclasses.field(default_factory=lambda: dict(SWARM_VALUES))
    last_round: RoundOutcome | None = None  # rank 0's core's

    def to_tensor(self) -> torch.Tensor:
        values = [self.error, self.params_changed, self.hyperparameters_follow]
        values += [getattr(self.result, f.name) for f in _RESULT_FIELDS]
        values += [self.swarm[name] for name in SWARM_VALUES]
        values += round_to_floats(self.result.round) + round_to_floats(self.last_round)
        return torch.tensor([float(v) for v in values], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> NodeStatus:
        values = tensor.tolist()
        flags, values = [bool(v) for v in values[:3]], values[3:]
        result = StepResult(**{f.name: _CAST[f.type](v) for f, v in zip(_RESULT_FIELDS, values, strict=False)})
        values = values[len(_RESULT_FIELDS):]
        swarm = dict(zip(SWARM_VALUES, values[:len(SWARM_VALUES)], strict=True))
        values = values[len(SWARM_VALUES):]
        result = dataclasses.replace(result, round=round_from_floats(values[:_ROUND_SIZE]))
        return cls(*flags, result=result, swarm=swarm, last_round=round_from_floats(values[_ROUND_SIZE:]))

    @classmethod
    def read(cls, copt: Any, **flags: Any) -> NodeStatus:
        """The status of rank 0's core now."""
        status = cls(**flags, last_round=copt.last_round)
        for name in SWARM_VALUES:
            try:  # informational values: a failure to read one must not break the node
                status.swarm[name] = float(getattr(copt, name))
            except Exception as e:
                logger.debug("collabopt: cannot read a swarm metric: %r", e)
        return status
