"""One config for the core, the node and every adapter; one scheduler wrapper and its state format."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate.state import AcceleratorState
from collabopt.integrations.accelerate import CollaborativeAccelerator
from collabopt.integrations.lightning import CollaborativeStrategy

from collabopt import CollabConfig, CollaborativeScheduler, ConfigurationError
from collabopt.config import option_names


def test_config_is_frozen_and_normalizes_addresses():
    config = CollabConfig.from_options(run_id="cfg", target_batch_size=64, host_maddrs="/ip4/127.0.0.1/tcp/0")
    assert config.host_maddrs == ["/ip4/127.0.0.1/tcp/0"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.run_id = "other"


def test_hivemind_options_pass_through_and_unknown_names_are_refused():
    config = CollabConfig.from_options(run_id="cfg", target_batch_size=64, allreduce_timeout=12.0)
    assert config.hivemind_arguments()["allreduce_timeout"] == 12.0
    with pytest.raises(ConfigurationError, match="allreduce_timout: is not an argument"):
        CollabConfig.from_options(run_id="cfg", target_batch_size=64, allreduce_timout=12.0)
    with pytest.raises(ConfigurationError, match="run_id: is required"):
        CollabConfig.from_options(target_batch_size=64)


def test_every_adapter_accepts_the_configs_options():
    """The accepted names come from one place: node_timeout (for devices > 1) reaches every adapter."""
    assert {"node_timeout", "matchmaking_time", "grad_compression", "initial_peers"} <= option_names()
    strategy = CollaborativeStrategy(target_batch_size=64, node_timeout=60.0, allreduce_timeout=5.0)
    assert strategy._options["node_timeout"] == 60.0
    accelerator = CollaborativeAccelerator(run_id="cfg", target_batch_size=64, node_timeout=60.0, cpu=True)
    assert accelerator.collab_options["node_timeout"] == 60.0
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("options, parameter", [(dict(matchmaking_time=0), "matchmaking_time"),
                                                (dict(node_timeout=-1), "node_timeout"),
                                                (dict(delay_optimizer_step=True), "delay_optimizer_step")])
def test_the_strategy_checks_every_option_when_built(options, parameter):
    with pytest.raises(ConfigurationError) as info:
        CollaborativeStrategy(target_batch_size=64, **options)
    assert info.value.parameter == parameter


def make_wrapper(gamma: float = 0.5) -> tuple[torch.optim.Optimizer, CollaborativeScheduler]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return opt, CollaborativeScheduler(torch.optim.lr_scheduler.ExponentialLR(opt, gamma=gamma))


def test_scheduler_wrapper_state_has_one_format_and_accepts_a_plain_schedulers_state():
    source_opt, wrapper = make_wrapper()
    wrapper.advance_to(3)
    state = wrapper.state_dict()
    assert state["format"] == "collabopt-scheduler/1" and state["epoch"] == 3
    opt, other = make_wrapper()
    opt.load_state_dict(source_opt.state_dict())  # as in a checkpoint: the optimizer's state first
    other.load_state_dict(state)
    assert other.epoch == 3 and other.get_last_lr() == [0.125] and other.last_epoch == 3
    other.advance_to(4)
    assert opt.param_groups[0]["lr"] == 0.0625
    # a plain torch scheduler's state (a checkpoint of ordinary training) is the state at the current epoch
    plain_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    plain = torch.optim.lr_scheduler.ExponentialLR(plain_opt, gamma=0.5)
    plain_opt.step()
    plain.step()
    _, restored = make_wrapper()
    restored.load_state_dict(plain.state_dict())
    assert restored.epoch == 0 and restored.last_epoch == 1


def test_plateau_wrapper_reports_metrics_from_framework_calls():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    wrapper = CollaborativeScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0))
    for epoch in range(1, 4):
        wrapper.step(1.0)  # what Lightning calls with the monitored metric
        wrapper.step(metrics=1.0)
        wrapper.advance_to(epoch)
    assert wrapper.get_last_lr() == [0.25]  # the plateau cut the LR after the first epoch, at every epoch
