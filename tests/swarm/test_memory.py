"""Parameter averaging and gradient accumulation in place: where the round runs inside ``step()`` on CPU tensors,
hivemind's state averager averages the parameters themselves instead of a copy of them
(``collabopt.engine.state.averages_parameters_in_place``), and the local steps' gradients accumulate in the gradient
round's buffers instead of accumulators of their own (``can_accumulate_in_place``): 1x the parameters less each (B4
measures it). One real optimizer in this process, a lone peer, no swarm: that peers averaging in place end in sync
is what every synchronous swarm test checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import unique_run_id

pytestmark = pytest.mark.swarm


def averaged_pointers(optimizer) -> list[int]:
    with optimizer.loop.state_averager.get_tensors() as averaged:
        return [t.data_ptr() for t in averaged]


@pytest.mark.parametrize("delay_state_averaging", [False, True])
def test_the_state_averager_averages_the_parameters_themselves_unless_it_runs_in_the_background(delay_state_averaging):
    from collabopt import CollaborativeOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                 run_id=unique_run_id("in_place"), target_batch_size=16, batch_size=4,
                                 matchmaking_time=1.0, averaging_timeout=2.0, print_join_message=False,
                                 handle_signals=False, delay_state_averaging=delay_state_averaging)
    try:
        params = list(model.parameters())
        shared = averaged_pointers(opt)[:len(params)] == [p.data_ptr() for p in params]
        assert shared is not delay_state_averaging, (
            "the averager's tensors should be the parameters in the foreground and a copy in the background")
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        before = [p.detach().clone() for p in params]
        for _ in range(4 * 3):  # a lone peer's epochs of 4 steps: optimizer steps, averaging rounds that find no one
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert opt.local_epoch >= 2
        assert all(torch.isfinite(p).all() for p in params)
        assert any(not torch.equal(a, p) for a, p in zip(before, params, strict=True))
        if not delay_state_averaging:  # still the same memory: nothing replaced the parameters' storage
            assert averaged_pointers(opt)[:len(params)] == [p.data_ptr() for p in params]
    finally:
        opt.close()


def round_buffer_pointers(optimizer) -> tuple[list[int], list[int]]:
    averager = optimizer.loop.grad_averager
    with averager.get_tensors() as buffers:
        return [t.data_ptr() for t in averager._grad_accumulators()], [t.data_ptr() for t in buffers]


@pytest.mark.parametrize("mode", ["default", "offload_optimizer", "reuse_grad_buffers", "delay_optimizer_step"])
def test_gradients_accumulate_in_the_rounds_buffers_where_the_round_runs_inside_step(mode):
    from collabopt import CollaborativeOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    options = {"default": {}, "offload_optimizer": dict(offload_optimizer=True),
               "reuse_grad_buffers": dict(reuse_grad_buffers=True),
               "delay_optimizer_step": dict(offload_optimizer=True, delay_optimizer_step=True,
                                            delay_state_averaging=True)}[mode]
    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                 run_id=unique_run_id("accumulate_in_place"), target_batch_size=16, batch_size=4,
                                 matchmaking_time=1.0, averaging_timeout=2.0, print_join_message=False,
                                 handle_signals=False, **options)
    in_place = mode in ("default", "offload_optimizer")  # (reuse_grad_buffers accumulates in param.grad)
    try:
        accumulators, buffers = round_buffer_pointers(opt)
        assert (accumulators == buffers) is in_place
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(4 * 3):  # a lone peer's epochs of 4 steps
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert opt.local_epoch >= 2
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert (round_buffer_pointers(opt) == (buffers, buffers)) is in_place
    finally:
        opt.close()


@pytest.mark.parametrize("mode", ["separate_accumulators", "reuse_grad_buffers", "users_grad_averager"])
def test_a_lone_peer_steps_with_its_own_gradients_without_a_trip_through_the_rounds_buffers(mode, monkeypatch):
    """Where the accumulators are not the round's buffers (on a GPU they never are), a boundary with no gradient round
    loads the epoch's mean gradient straight into the optimizer: the buffers live in host memory, and the trip moved
    every gradient to the host and back (B2 on a GPU). The sentinel in the buffers must survive, the update be plain
    SGD's."""
    from collabopt import CollaborativeOptimizer
    from collabopt.engine import gradient_rounds

    monkeypatch.setattr(gradient_rounds, "ACCUMULATE_IN_PLACE", False)  # (CPU tensors: as on a GPU)
    users_averager = {}
    if mode == "users_grad_averager":  # hivemind's own class: none of collabopt's attributes
        from hivemind.optim.grad_averager import GradientAverager

        users_averager = dict(grad_averager_factory=GradientAverager)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    reference.load_state_dict(model.state_dict())
    opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 run_id=unique_run_id("lone_gradients"), target_batch_size=16, batch_size=4,
                                 matchmaking_time=1.0, averaging_timeout=2.0, print_join_message=False,
                                 handle_signals=False, reuse_grad_buffers=mode == "reuse_grad_buffers",
                                 **users_averager)
    try:
        averager = opt.loop.grad_averager
        accumulators, buffers = round_buffer_pointers(opt)
        assert accumulators != buffers
        with averager.get_tensors() as tensors:
            for tensor in tensors:
                tensor.fill_(float("nan"))
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        for _ in range(4):  # one epoch of a lone peer: the same batch 4 times, so its mean gradient is this one
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if mode != "reuse_grad_buffers":
                opt.zero_grad()
        assert opt.local_epoch == 1
        F.cross_entropy(reference(x), y).backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
        with averager.get_tensors() as tensors:
            assert all(torch.isnan(tensor).all() for tensor in tensors), "the boundary went through the buffers"
    finally:
        opt.close()
