"""collabopt's training state (collabopt/engine/training_state.py, state.py) on stand-in parameter rounds: what a
step runs and in which order, where a round's average lands in every mode, the epoch the served state is labelled
with, and the served state in hivemind's layout. The rounds themselves run in every synchronous swarm test."""

from __future__ import annotations

import threading

import pytest
import torch
from hivemind.compression import TensorRole
from hivemind.optim.state_averager import TrainingStateAverager, initialize_optimizer_state_, load_optimizer_state

from collabopt.engine import protocol
from collabopt.engine.parameter_rounds import ParameterRound, RoundFailed
from collabopt.engine.state import ConsistentStateAverager
from collabopt.engine.training_state import TrainingState


@pytest.mark.parametrize(("evidence", "install"), [
    (protocol.ParameterRoundEvidence(), True),
    (protocol.ParameterRoundEvidence(error="no group assembled within 5.0 s"), False),
    (protocol.ParameterRoundEvidence(contributed=False), False),  # another epoch's average, or weight 0
    (protocol.ParameterRoundEvidence(received=0.75), False),  # part of it: this peer keeps its own
])
def test_a_parameter_rounds_average_is_installed_only_whole_and_with_this_peers_values(evidence, install):
    decision = protocol.parameter_round(evidence)
    assert decision.install is install and bool(decision.detail) is not install


class Rounds:
    """Stand-in parameter rounds: each round's average is ``average(tensors)`` (None: it fails)."""

    def __init__(self, average=lambda tensors: [t + 1 for t in tensors]):
        self.average, self.scheduled, self.handed, self.infos = average, [], [], []
        self.group_size_hint = None

    def schedule(self, template, epoch, timeout=None, infos=None):
        self.scheduled.append(epoch)
        self.infos.append(infos)
        return ParameterRound(Scheduled(), epoch)

    def finish(self, control, tensors, lock, timeout, may_write, late):
        with lock:
            self.handed.append([t.clone() for t in tensors])
        result = self.average(tensors)
        control.decision = protocol.ParameterDecision(result is not None, "" if result is not None else "no group")
        if result is None:
            raise RoundFailed("no group")
        with lock, torch.no_grad():
            assert may_write()
            for tensor, value in zip(tensors, result, strict=True):
                tensor.copy_(value)
        return {"a": {"epoch": control.epoch}, "b": {"epoch": control.epoch}}

    def install_late(self, control, tensors, may_write):
        return None  # (its rounds never outlive their wait)

    def is_alive(self):
        return True

    def shutdown(self):
        pass


class Scheduled:
    triggered = began_allreduce = False

    def cancel(self):
        pass


def training_state(rounds=None, **options) -> tuple[TrainingState, torch.nn.Linear]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    if options.get("offload_optimizer"):
        options.setdefault("custom_gradients", False)
        optimizer = lambda groups: torch.optim.SGD(groups, lr=0.5)  # noqa: E731
        options["params"] = list(model.parameters())
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return TrainingState(optimizer=optimizer, rounds=rounds or Rounds(), **options), model


def backward(model: torch.nn.Linear) -> None:
    model.zero_grad()
    model(torch.ones(4, 3)).sum().backward()


@pytest.mark.parametrize("options", [dict(reuse_tensors=True), dict(reuse_tensors=False), dict(offload_optimizer=True),
                                     dict(delta_rule_averaging=True)],
                         ids=["in place", "copy", "offloaded", "delta rule"])
def test_a_boundary_steps_then_averages_and_the_model_holds_the_average(options):
    state, model = training_state(**options)
    backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    stepped = [p - 0.5 * p.grad for p, p in zip(before, model.parameters(), strict=True)]
    state.step(increment_epoch=True, optimizer_step=True, averaging_round=True, delay_averaging=False)
    assert state.local_epoch == 1 and state.rounds.scheduled == [1]  # (the round gathers the epoch it ends in)
    assert all(torch.allclose(h, s) for h, s in zip(state.rounds.handed[0], stepped, strict=True))  # step, then round
    assert all(torch.allclose(p, s + 1) for p, s in zip(model.parameters(), stepped, strict=True))
    assert not state.pending_updates and not state.averaging_in_progress


@pytest.mark.parametrize("offload", [False, True])
def test_a_parameter_round_gives_its_tensors_hiveminds_compression_keys_and_roles(offload):
    """As hivemind's state averager gives them (its own function read on this state), so that a
    ``state_averaging_compression`` that chooses by role or key chooses as it does in hivemind."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = (lambda groups: torch.optim.Adam(groups, lr=0.1)) if offload else \
        torch.optim.Adam(model.parameters(), lr=0.1)
    state = TrainingState(optimizer=optimizer, rounds=Rounds(), params=list(model.parameters()),
                          offload_optimizer=offload, average_opt_statistics=("exp_avg", "exp_avg_sq"),
                          extra_tensors=[torch.zeros(3)], initialize_optimizer=True)
    model(torch.ones(4, 3)).sum().backward()
    state.step(increment_epoch=True, optimizer_step=True, averaging_round=True, delay_averaging=False)
    hiveminds = TrainingStateAverager._init_tensor_infos(state)
    given = state.rounds.infos[0]
    assert len(given) == len(hiveminds) == 4 + 2 * 4 + 1
    assert [(i.key, i.role) for i in given] == [(i.key, i.role) for i in hiveminds]
    assert [i.descriptor.shape for i in given] == [i.descriptor.shape for i in hiveminds]


def test_the_synchronous_modes_scheduled_parameter_round_gets_the_infos_too():
    averager = object.__new__(ConsistentStateAverager)
    optimizer = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    TrainingState.__init__(averager, optimizer=optimizer, rounds=Rounds(), average_opt_statistics=["exp_avg"],
                           initialize_optimizer=True)
    averager.schedule_parameter_round(5.0)
    assert averager.rounds.infos == [averager._averaged_infos]
    assert [i.role for i in averager._averaged_infos] == [TensorRole.PARAMETER] * 2 + [TensorRole.OPTIMIZER] * 2


@pytest.mark.parametrize("reuse", [True, False])
def test_a_failed_round_leaves_the_stepped_parameters(reuse):
    state, model = training_state(Rounds(average=lambda tensors: None), reuse_tensors=reuse)
    backward(model)
    stepped = [p.detach() - 0.5 * p.grad for p in model.parameters()]
    state.step(increment_epoch=True, optimizer_step=True, averaging_round=True, delay_averaging=False)
    assert all(torch.allclose(p, s) for p, s in zip(model.parameters(), stepped, strict=True))


def test_a_background_round_is_applied_by_the_next_step_never_while_the_model_is_in_use():
    state, model = training_state(reuse_tensors=False)
    release = threading.Event()
    average = state.rounds.average
    state.rounds.average = lambda tensors: release.wait(5) and average(tensors)
    state.step(averaging_round=True, delay_averaging=True)
    before = [p.detach().clone() for p in model.parameters()]
    release.set()
    state.step(wait_for_delayed_updates=True)  # (the loop's next step: waits, then applies)
    assert all(torch.allclose(p, b + 1) for p, b in zip(model.parameters(), before, strict=True))


def test_the_served_epoch_is_the_one_whose_optimizer_step_the_parameters_hold():
    """With a delayed optimizer step, step() counts the epoch before the step runs: until it has, the state is
    served as the epoch before (a download would otherwise get new labels on old parameters)."""
    state, model = training_state(offload_optimizer=True)
    ran = threading.Event()
    step = state.optimizer.step
    state.optimizer.step = lambda: ran.wait(5) and step()
    backward(model)
    state.step(increment_epoch=True, optimizer_step=True, delay_optimizer_step=True, delay_averaging=True)
    assert state.local_epoch == 1 and state.served_epoch() == 0
    ran.set()
    state.step(wait_for_delayed_updates=True)
    assert state.served_epoch() == 1


def test_the_served_state_is_hiveminds_layout_and_installs_into_another_peer():
    optimizer = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    averager = object.__new__(ConsistentStateAverager)
    TrainingState.__init__(averager, optimizer=optimizer, rounds=Rounds(), extra_tensors=[torch.arange(3.0)])
    averager.local_epoch = 7
    for statistics in optimizer.state.values():
        statistics["exp_avg"].fill_(3.0)
    metadata, tensors, infos = averager.state_copy()
    assert metadata["epoch"] == 7 and isinstance(metadata["optimizer_metadata"], list)
    assert len(tensors) == len(infos) == 2 + 1 + 2 * 2 + 2  # parameters, the extra tensor, exp_avg(_sq)s, steps
    assert [t.data_ptr() for t in tensors[:2]] != [p.data_ptr() for p in optimizer.param_groups[0]["params"]]
    other = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    initialize_optimizer_state_(other)  # (statistics to load into, as a fresh peer's)
    load_optimizer_state(other, metadata["optimizer_metadata"], tensors[3:])
    for index, statistics in optimizer.state_dict()["state"].items():
        loaded = other.state_dict()["state"][index]
        assert loaded.keys() == statistics.keys() and all(torch.equal(loaded[k], statistics[k]) for k in statistics)
        assert torch.equal(loaded["exp_avg"], torch.full_like(loaded["exp_avg"], 3.0))
