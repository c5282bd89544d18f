"""The ``aggregation`` option (issue 35): refused clearly before any network when wrong, carried to every averager
(gradients, DiLoCo's pseudo-gradients, parameters) when ``"centered_clip"``, and nothing changed for ``"mean"``.
What the averagers then do with it runs in real swarms (tests/swarm/test_robustness.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import pytest
import torch
from hivemind.averaging import allreduce, matchmaking
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.utils.serializer import MSGPackSerializer

import collabopt.optimizer as optimizer_module
import collabopt.swarm as swarm_module
from collabopt import CollabConfig, CollaborativeOptimizer, ConfigurationError
from collabopt.engine.averaging import ShieldedReducers, ShieldedTensorPartReducer
from collabopt.engine.diloco_averaging import PseudoGradientRounds
from collabopt.engine.gradient_rounds import GradientRounds
from collabopt.engine.robust_averaging import (
    ClippingTensorPartReducer,
    aggregation_options,
    cap_gathered_bandwidths,
)
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


def test_a_users_gradient_averager_cannot_be_combined_with_centered_clip(no_network):
    with pytest.raises(ConfigurationError, match="grad_averager_factory"):
        CollabConfig.from_options(aggregation="centered_clip", grad_averager_factory=object, **SWARM)


def test_mean_changes_nothing():
    arguments = CollabConfig.from_options(matchmaking_time=2.0, **SWARM).hivemind_arguments()
    assert arguments["averager_opts"] == {"request_timeout": 1.0}
    assert arguments["grad_averager_factory"].keywords == {"aggregation": "mean", "request_timeout": 1.0}
    assert "tracker_opts" not in arguments
    assert aggregation_options("mean") == {}
    assert ShieldedReducers.part_reducer is ShieldedTensorPartReducer


def test_centered_clip_reaches_the_gradient_and_the_state_averager():
    arguments = CollabConfig.from_options(aggregation="centered_clip", **SWARM).hivemind_arguments()
    assert arguments["averager_opts"]["part_reducer"] is ClippingTensorPartReducer
    assert arguments["averager_opts"]["cap_gathered"] is cap_gathered_bandwidths
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
    assert arguments["averager_opts"]["part_reducer"] is ClippingTensorPartReducer


class _Base:
    """Stands for hivemind's averager under the mixin: records what the mixin hands it."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def run(self):
        self.installed = allreduce.TensorPartReducer

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        return group_info


class _Averager(ShieldedReducers, _Base):
    matchmaking_kwargs = dict(request_timeout=None)
    allreduce_kwargs = dict(reducer_timeout=None)


@pytest.mark.parametrize("aggregation, reducer", [("mean", ShieldedTensorPartReducer),
                                                  ("centered_clip", ClippingTensorPartReducer)])
def test_the_averager_installs_its_reducer_and_caps_bandwidths(monkeypatch, aggregation, reducer):
    monkeypatch.setattr(allreduce, "TensorPartReducer", allreduce.TensorPartReducer)  # (both restored after the test)
    monkeypatch.setattr(matchmaking, "GroupKeyManager", matchmaking.GroupKeyManager)
    averager = _Averager(other=1, **aggregation_options(aggregation))
    extra = {} if aggregation == "mean" else dict(min_group_size=3)  # (hivemind's: no group of 2 when clipping)
    assert averager.kwargs == dict(other=1, **extra)  # the mixin's own arguments stop at the mixin
    averager.run()
    assert averager.installed is reducer
    gathered = tuple(MSGPackSerializer.dumps([bandwidth, 0, b""]) for bandwidth in (100.0, 100.0, 100.0, 1e9))
    group = GroupInfo(group_id=b"g", peer_ids=tuple(range(4)), gathered=gathered)
    seen = asyncio.run(averager._aggregate_with_group(group, 0))
    bandwidths = [MSGPackSerializer.loads(data)[0] for data in seen.gathered]
    shares = load_balance_peers(10**6, bandwidths)
    if aggregation == "mean":
        assert seen is group and shares == (0, 0, 0, 10**6)  # hivemind's: the claimant reduces everything
    else:
        assert dataclasses.replace(seen, gathered=group.gathered) == group
        assert bandwidths == [100.0] * 4 and max(shares) == 250_000
