"""The training state's failures and shutdown (collabopt/engine/training_state.py, parameter_rounds.py): a failed
optimizer step is raised and its epoch not served; a peer without parameter rounds shuts down once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from collabopt.engine.parameter_rounds import NoRounds, ParameterRound
from collabopt.engine.training_state import TrainingState


class Scheduled:
    triggered = began_allreduce = False

    def cancel(self):
        pass

    def done(self):
        return False


@pytest.mark.parametrize("averaging", [dict(), dict(averaging_round=True, delay_averaging=True)],
                         ids=["step", "step, round in the background"])
def test_an_optimizer_step_that_raises_is_raised_and_its_epoch_is_not_served(averaging):
    model = torch.nn.Linear(3, 2)
    rounds = SimpleNamespace(schedule=lambda *args: ParameterRound(Scheduled(), 1), shutdown=lambda: None)
    state = TrainingState(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), rounds=rounds)

    def fails():
        raise FloatingPointError("the step failed")

    state.optimizer.step = fails
    with pytest.raises(FloatingPointError):
        state.step(increment_epoch=True, optimizer_step=True, **averaging)
    assert state.local_epoch == 1 and state.served_epoch() == 0  # (its parameters hold no update of epoch 1)
    assert not state.pending_updates
    state.shutdown()


def test_a_peer_without_parameter_rounds_is_not_alive_after_its_shutdown():
    model = torch.nn.Linear(3, 2)
    state = TrainingState(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), rounds=NoRounds())
    assert state.is_alive()
    state.shutdown()
    assert not state.is_alive()
