"""A gradient round that fails goes on with this peer's own accumulated gradients.

hivemind 1.1.12 zeroes the accumulators as it hands them to a round; when the round then fails ("could not find a
group", a timeout) it logged "Proceeding with local gradients" but reloaded the zeroed accumulators, and the epoch's
optimizer step got zero gradients: the epoch's samples were lost (SGD does not move; Adam moves by its momentum
only). collabopt's loop keeps the accumulators until the epoch ends (``SyncLoop._gradient_round``).

One real optimizer in this process, a lone peer whose tracker is made to count a second peer at the boundary: its
rounds run and really find no group."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import unique_run_id

pytestmark = pytest.mark.swarm


# the gradient round, the optimizer step and the parameter averaging run in the background
OVERLAP = ("offload_optimizer", "delay_optimizer_step", "delay_grad_averaging", "delay_state_averaging")


# (reuse_grad_buffers keeps its accumulation the same way as the default mode; the offload mode's optimizer steps
# with the round's buffers themselves)
@pytest.mark.parametrize("mode", ["default", "offload_optimizer", "overlap"])
def test_a_failed_gradient_round_steps_with_the_local_gradients(mode, monkeypatch):
    from collabopt import CollaborativeOptimizer

    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    options = {name: True for name in (OVERLAP if mode == "overlap" else (mode,)) if name != "default"}
    opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), run_id=unique_run_id("failed_round"),
                                 target_batch_size=8, batch_size=4, matchmaking_time=0.5, averaging_timeout=2.0,
                                 print_join_message=False, handle_signals=False,
                                 average_state_every=1000, **options)  # (no parameter round: it would fail too)
    try:
        hm = opt.loop
        gradient_round = hm._gradient_round
        rounds = []

        def round_with_another_peer(epoch, num_peers):
            hm.tracker.global_progress.num_peers = 2  # the round starts, and finds nobody
            decision, in_background = gradient_round(epoch, 2)
            rounds.append(decision is None or decision.outcome.reason != "alone")  # (overlap: in the background)
            return decision, in_background

        monkeypatch.setattr(hm, "_gradient_round", round_with_another_peer)
        expected = 0.0
        for epoch, gradient in ((1, 1.0), (2, 2.0)):
            for _ in range(400):  # until the boundary (a lone peer's view of the swarm's samples can lag a step)
                opt.zero_grad()
                (model(gradient * torch.ones(4, 4)).sum() / 4).backward()  # every weight's gradient: `gradient`
                opt.step()
                if opt.local_epoch == epoch:
                    break
                time.sleep(0.01)
            assert opt.local_epoch == epoch
            while mode == "overlap" and hm.state_averager.pending_updates:  # the epoch's optimizer step runs in the
                opt._peer.finish_background_work()  # background (this waits allreduce_timeout at most, then returns)
            # SGD(lr=1) with the epoch's (mean) accumulated gradient (hivemind alone: zero gradients; with overlap
            # whatever the next epoch had accumulated when the round failed, which its own round counted again)
            expected -= gradient
            assert model.weight.detach().tolist() == [[expected] * 4], f"epoch {epoch}"
        assert rounds == [True, True], "the gradient rounds should have started (and failed: no other peer)"
    finally:
        opt.close()
