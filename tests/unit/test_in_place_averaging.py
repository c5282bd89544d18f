"""Which optimizers average parameters in place (``averages_parameters_in_place``): pure argument handling; the
real averager is checked in tests/swarm/test_memory.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from collabopt.engine.state import averages_parameters_in_place


def hivemind_optimizer(**overrides):
    return SimpleNamespace(**{"offload_optimizer": False, "delay_state_averaging": False, **overrides})


def test_foreground_averaging_of_float32_cpu_parameters_is_in_place():
    model = torch.nn.Linear(3, 2)
    assert averages_parameters_in_place(hivemind_optimizer(), {"optimizer": torch.optim.SGD(model.parameters(), lr=1)})


@pytest.mark.parametrize("overrides", [{"offload_optimizer": True}, {"delay_state_averaging": True}])
def test_offloaded_or_background_averaging_is_not(overrides):
    model = torch.nn.Linear(3, 2)
    arguments = {"optimizer": torch.optim.SGD(model.parameters(), lr=1)}
    assert not averages_parameters_in_place(hivemind_optimizer(**overrides), arguments)


@pytest.mark.parametrize("extra", [{"delta_rule_averaging": True}, {"average_opt_statistics": ("exp_avg",)},
                                   {"extra_tensors": (torch.zeros(2),)}])
def test_anything_averaged_beside_the_parameters_keeps_the_copy(extra):
    model = torch.nn.Linear(3, 2)
    arguments = {"optimizer": torch.optim.SGD(model.parameters(), lr=1), **extra}
    assert not averages_parameters_in_place(hivemind_optimizer(), arguments)


def test_parameters_that_are_not_float32_keep_the_copy():
    model = torch.nn.Linear(3, 2).double()
    assert not averages_parameters_in_place(hivemind_optimizer(), {"optimizer": torch.optim.SGD(model.parameters(),
                                                                                                lr=1)})


def test_an_iterator_of_parameters_is_read_once_and_handed_on():
    model = torch.nn.Linear(3, 2)
    arguments = {"optimizer": lambda params: torch.optim.SGD(params, lr=1), "params": model.parameters()}
    assert averages_parameters_in_place(hivemind_optimizer(), arguments)
    assert list(arguments["params"]) == list(model.parameters())
    groups = {"optimizer": None, "params": [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}]}
    assert averages_parameters_in_place(hivemind_optimizer(), groups)
