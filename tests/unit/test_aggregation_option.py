"""The ``aggregation`` option (issue 35): refused clearly before any network when wrong, carried to every averager
(gradients, DiLoCo's pseudo-gradients, parameters) when ``"centered_clip"``, and nothing changed for ``"mean"``.
What the averagers then do with it runs in real swarms (tests/swarm/test_robustness.py)."""

from __future__ import annotations

import functools

import pytest
import torch

import collabopt.optimizer as optimizer_module
import collabopt.swarm as swarm_module
from collabopt import CollabConfig, CollaborativeOptimizer, ConfigurationError
from collabopt.engine.diloco_averaging import PseudoGradientRounds
from collabopt.engine.gradient_rounds import GradientRounds
from collabopt.engine.robust_averaging import aggregation_options
from collabopt.hivemind_arguments import peer_arguments

SWARM = dict(run_id="aggregation", target_batch_size=64)
OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9)


@pytest.fixture
def no_network(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a DHT was started although the configuration is invalid")

    monkeypatch.setattr(swarm_module, "start_dht", forbidden)
    monkeypatch.setattr(optimizer_module, "HivemindPeer", forbidden)


@pytest.mark.parametrize("value", ["median", "Mean", None, 1])
def test_an_unknown_aggregation_is_refused_before_any_network(no_network, value):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigurationError) as info:
        CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), aggregation=value, **SWARM)
    assert info.value.parameter == "aggregation"
    assert "centered_clip" in str(info.value) and "Fix:" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_centered_clip_needs_three_contributors_a_compressed_round(no_network):
    from collabopt.diloco_options import SparseLoCo

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigurationError) as info:
        CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), aggregation="centered_clip",
                               outer_optimizer=OUTER, pseudo_gradient_compression=SparseLoCo(max_contributors=2),
                               **SWARM)
    assert info.value.parameter == "pseudo_gradient_compression" and "at least 3" in str(info.value)
    assert "max_contributors=3" in str(info.value) and "aggregation='mean'" in str(info.value)


def test_a_users_gradient_averager_cannot_be_combined_with_centered_clip(no_network):
    with pytest.raises(ConfigurationError, match="grad_averager_factory"):
        CollabConfig.from_options(aggregation="centered_clip", grad_averager_factory=object, **SWARM)


def test_mean_changes_nothing():
    arguments = CollabConfig.from_options(matchmaking_time=2.0, **SWARM).hivemind_arguments()
    assert arguments["averager_opts"] == {"request_timeout": 1.0}
    assert arguments["grad_averager_factory"].keywords == {"aggregation": "mean", "request_timeout": 1.0}
    assert "tracker_opts" not in arguments
    assert aggregation_options("mean") == {}


def test_centered_clip_reaches_the_gradient_and_the_state_averager():
    arguments = CollabConfig.from_options(aggregation="centered_clip", **SWARM).hivemind_arguments()
    # the state averager's parameter rounds (collabopt.engine.parameter_rounds): the aggregation by its name
    assert arguments["averager_opts"] == dict(aggregation="centered_clip", min_group_size=3, verify_downloads=True)
    factory = arguments["grad_averager_factory"]  # collabopt's gradient rounds: the aggregation by its name
    assert factory.func is GradientRounds
    assert factory.keywords["aggregation"] == "centered_clip" and factory.keywords["min_group_size"] == 3
    assert arguments["tracker_opts"] == {"cap_claims": True}  # collabopt.robust.cap_progress_claims


def test_centered_clip_reaches_the_pseudo_gradient_rounds():
    config = CollabConfig.from_options(aggregation="centered_clip", outer_optimizer=OUTER, matchmaking_time=2.0,
                                       **SWARM)
    inner = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    arguments = peer_arguments(config, inner, None)
    factory = arguments["grad_averager_factory"]
    assert factory.func is PseudoGradientRounds
    assert factory.keywords == {"aggregation": "centered_clip", "request_timeout": 1.0}
    assert arguments["averager_opts"]["aggregation"] == "centered_clip"
