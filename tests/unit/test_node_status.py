"""A node's status travels from rank 0 to every rank as one float64 tensor: nothing of it may be lost on the way."""

from __future__ import annotations

import dataclasses

import pytest

from collabopt.interface import RoundOutcome, StepResult
from collabopt.node_status import NodeStatus


@pytest.mark.parametrize("parameters_averaged", [None, True, False])
def test_a_status_and_its_rounds_outcomes_survive_the_broadcast_tensor(parameters_averaged):
    outcome = RoundOutcome(True, "partial", 3, 96.0, num_peers=4, resync=True, epoch=12,
                           parameters_averaged=parameters_averaged)
    result = dataclasses.replace(StepResult(), round=outcome)
    status = NodeStatus(error=False, params_changed=True, result=result, last_round=outcome)
    back = NodeStatus.from_tensor(status.to_tensor())
    assert back.last_round == outcome and back.result.round == outcome  # (detail stays on rank 0: it is "")
    assert back.params_changed and not back.error
    assert NodeStatus.from_tensor(NodeStatus().to_tensor()).last_round is None
