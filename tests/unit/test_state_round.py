"""Pre-scheduled state rounds (collabopt.engine.sync_round.preschedule_state_rounds): argument handling on a stand-in
optimizer; the rounds themselves run in every swarm test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hivemind.optim.optimizer import PerformanceEMA
from hivemind.utils import get_dht_time

from collabopt.engine import averaging, lineage_check, progress, state, sync_round
from collabopt.engine import peer as engine_peer


def stand_in(matchmaking_time: float, eta: float) -> SimpleNamespace:
    calls = []
    averager = SimpleNamespace(delay_before_averaging=PerformanceEMA(alpha=1.0),
                               schedule_step=lambda scheduled_time=None, **kw: calls.append((scheduled_time, kw)))
    return SimpleNamespace(state_averager=averager, tracker=SimpleNamespace(estimated_next_update_time=eta),
                           delay_before_state_averaging=PerformanceEMA(alpha=1.0), matchmaking_time=matchmaking_time,
                           client_mode=False, calls=calls, sync_state=lineage_check.SyncState())


@pytest.mark.parametrize(("matchmaking_time", "slack"), [(1.0, 0.5), (2.0, 1.0), (5.0, 1.0)])
def test_the_group_stays_open_until_the_estimated_start_plus_a_slack(matchmaking_time, slack):
    eta = get_dht_time() + matchmaking_time
    optimizer = stand_in(matchmaking_time, eta)
    sync_round.preschedule_state_rounds(optimizer)
    # hivemind pre-schedules only once it has timed a round: a first estimate of 0 s lets it start at once
    assert optimizer.delay_before_state_averaging.num_updates == 1
    optimizer.delay_before_state_averaging.update(task_size=1, interval=0.3)  # boundary -> state round, measured
    optimizer.state_averager.delay_before_averaging.update(task_size=1, interval=0.2)
    optimizer.state_averager.schedule_step(gather=3, timeout=30.0)  # as _maybe_schedule_state_averaging calls it
    assert optimizer.calls == [(pytest.approx(eta + 0.3 + 0.2 + slack), dict(gather=3, timeout=30.0))]
    optimizer.state_averager.schedule_step(scheduled_time=1234.0)  # an explicit time is kept
    assert optimizer.calls[-1][0] == 1234.0


def test_the_scheduled_time_stays_before_the_rounds_deadline():
    """hivemind asserts scheduled_time < now + timeout: an averaging_timeout barely above matchmaking_time."""
    optimizer = stand_in(matchmaking_time=2.0, eta=get_dht_time() + 2.0)
    sync_round.preschedule_state_rounds(optimizer)
    optimizer.state_averager.schedule_step(timeout=2.5)
    assert optimizer.calls[0][0] < get_dht_time() + 2.5


def boundary(monkeypatch, **attributes) -> tuple[list[int], list[str]]:
    """Run ``optimizer_class()._update_global_epoch`` on a stand-in; return the ``average_state_every`` hivemind's
    own method saw, and which scheduling calls reached hivemind."""
    import hivemind

    seen, scheduled = [], []
    monkeypatch.setattr(hivemind.Optimizer, "_update_global_epoch",
                        lambda self, grad_scaler: seen.append(self.average_state_every))
    monkeypatch.setattr(hivemind.Optimizer, "_maybe_schedule_state_averaging",
                        lambda self: scheduled.append("state"))
    optimizer = SimpleNamespace(local_epoch=8, average_state_every=1, status_loglevel=10, use_gradient_averaging=True,
                                tracker=SimpleNamespace(global_epoch=8, global_progress=SimpleNamespace(num_peers=3)),
                                sync_state=lineage_check.SyncState(preschedules_state=True, **attributes))
    cls = sync_round.SyncOptimizer
    cls._maybe_schedule_state_averaging(optimizer)
    cls._update_global_epoch(optimizer, None)
    assert optimizer.average_state_every == 1  # put back
    return seen, scheduled


def test_a_boundary_with_its_state_round_pre_scheduled_averages_parameters(monkeypatch):
    assert boundary(monkeypatch) == ([1], ["state"])


def test_the_first_boundary_after_a_download_skips_parameter_averaging(monkeypatch):
    """A peer that downloaded epoch 8 as the others reached its boundary: no state round is scheduled for it, and
    hivemind's boundary sees no averaging epoch (next_epoch % average_state_every != 0)."""
    seen, scheduled = boundary(monkeypatch, downloaded_epoch=8)
    assert scheduled == [] and seen[0] > 10**9


@pytest.mark.parametrize(("lowest_epoch", "seconds_since", "schedules"), [
    (None, 0.0, False),  # no records fetched yet
    ((8, 9), 0.0, False),  # a peer still at epoch 8: the others are still in the boundary it skipped
    ((9, 8), 0.0, False),  # fetched before this peer left epoch 8
    ((9, 9), 0.0, True),
    ((8, 9), 2.1, True),  # a matchmaking_time later: their groups for it are closed (a killed peer's record stays)
])
def test_after_a_skipped_round_the_next_is_scheduled_once_the_swarm_is_past_it(monkeypatch, lowest_epoch,
                                                                               seconds_since, schedules):
    import hivemind

    scheduled = []
    monkeypatch.setattr(hivemind.Optimizer, "_maybe_schedule_state_averaging", lambda self: scheduled.append(1))
    state = lineage_check.SyncState(preschedules_state=True, downloaded_epoch=8, skipped_epoch=8,
                                    skipped_at=get_dht_time() - seconds_since)
    optimizer = SimpleNamespace(local_epoch=9, use_gradient_averaging=True, matchmaking_time=2.0, sync_state=state,
                                tracker=SimpleNamespace(lowest_epoch=lowest_epoch))
    sync_round.SyncOptimizer._maybe_schedule_state_averaging(optimizer)
    assert bool(scheduled) == schedules


def test_the_progress_is_fetched_at_least_every_half_matchmaking_time(monkeypatch):
    """hivemind spaces fetches by its ETA (up to 10 s), far too long while throughput estimates warm up."""
    made = []
    monkeypatch.setattr(progress, "SwarmProgressTracker", lambda **kwargs: made.append(kwargs))
    optimizer = SimpleNamespace(dht=None, run_id="r", client_mode=False, status_loglevel=10, matchmaking_time=2.0)
    progress.make_progress_tracker(optimizer, 64)
    progress.make_progress_tracker(optimizer, 64, max_refresh_period=30.0)  # the user's own setting is kept
    optimizer.matchmaking_time = 0.5
    progress.make_progress_tracker(optimizer, 64, min_refresh_period=0.4)
    assert [kwargs["max_refresh_period"] for kwargs in made] == [1.0, 30.0, 0.4]


def test_tagging_along_with_weight_0_sends_zeros_not_what_the_buffers_held(monkeypatch):
    """0 * NaN is NaN: a peer taking part with weight 0 must not send a refused non-finite result left in its
    gradient averager's buffers. Parameters (the state round's tensors) are never touched."""
    import contextlib

    import hivemind
    import torch

    sent = []
    monkeypatch.setattr(hivemind.Optimizer, "_tag_along_with_zero_weight",
                        lambda self, control: sent.append([b.clone() for b in buffers]))
    buffers = [torch.tensor([float("nan"), 1.0]), torch.tensor([float("inf")])]
    grad_averager = SimpleNamespace(get_tensors=lambda: contextlib.nullcontext(buffers))
    grads, state = SimpleNamespace(triggered=False), SimpleNamespace(triggered=False)
    optimizer = SimpleNamespace(scheduled_grads=grads, scheduled_state=state, grad_averager=grad_averager)
    cls = sync_round.SyncOptimizer
    cls._tag_along_with_zero_weight(optimizer, state)
    assert not torch.isfinite(sent[-1][0]).all()  # the state round's control: nothing zeroed
    cls._tag_along_with_zero_weight(optimizer, grads)
    assert all((b == 0).all() for b in sent[-1])


def test_an_averager_that_accumulates_its_own_way_is_checked_at_every_step():
    from hivemind.optim.grad_averager import GradientAverager

    class OwnAccumulation(GradientAverager):
        def accumulate_grads_(self, batch_size: int) -> None:  # e.g. compresses as it accumulates
            pass

    peer = object.__new__(engine_peer.HivemindPeer)
    peer.hivemind_optimizer = SimpleNamespace(grad_averager=object.__new__(OwnAccumulation))
    assert peer.accumulators() is None
    peer.hivemind_optimizer = SimpleNamespace(grad_averager=None)  # use_local_updates
    assert peer.accumulators() is None


def test_a_client_schedules_its_state_round_a_matchmaking_time_later():
    """A client never leads, and a leader refuses a peer whose round would end before its own: a client's round
    ends later than any leader's estimate plus slack."""
    eta = get_dht_time() + 2.0
    optimizer = stand_in(2.0, eta)
    optimizer.client_mode = True
    sync_round.preschedule_state_rounds(optimizer)
    optimizer.state_averager.schedule_step(gather=3, timeout=30.0)
    assert optimizer.calls == [(pytest.approx(eta + 1.0 + 2.0), dict(gather=3, timeout=30.0))]


class DoneRound:
    """A finished gradient round's StepControl: ``result()`` is the group's gathered metadata."""

    def __init__(self, group: dict | None = None, error: Exception | None = None):
        self.group, self.error = group, error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def exception(self) -> Exception | None:
        return self.error

    def result(self) -> dict | None:
        return self.group


@pytest.mark.parametrize(("control", "delayed", "swarm", "expected"), [
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 5}, "c": {"epoch": 4}}), False, 3, (5, 3)),  # every peer counted
    (DoneRound({"me": None, "b": None, "c": None}), False, 2, (5, 3)),  # (a peer not counted yet)
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 5}}), False, 3, None),  # split groups: the others may come
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 5}}), True, 2, None),  # delayed: ends after the state round began
    (DoneRound({"me": {"epoch": 5}}), False, 1, None),  # alone: hivemind's matchmaking as before
    (DoneRound(error=TimeoutError()), False, 3, None),
    (None, False, 3, None),
])
def test_the_state_round_expects_the_gradient_group_when_it_held_the_whole_swarm(control, delayed, swarm, expected):
    optimizer = SimpleNamespace(local_epoch=5, delay_grad_averaging=delayed,
                                tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=swarm)),
                                state_averager=SimpleNamespace(group_size_hint=(1, 9)))
    lineage_check.hint_state_group(optimizer, control)
    assert optimizer.state_averager.group_size_hint == expected


@pytest.mark.parametrize(("hint", "configured", "expected"), [
    ((5, 3), None, 3), ((4, 3), None, None), (None, None, None),
    ((5, 3), 2, 2), ((5, 3), 8, 3), (None, 8, 8),  # a target_group_size of the user's stays the upper bound
])
def test_a_hint_sizes_only_the_state_round_of_its_epoch(hint, configured, expected):
    cls = state.ConsistentStateAverager
    sent = []
    averager = SimpleNamespace(group_size_hint=hint, local_epoch=5, _outer_pipe=SimpleNamespace(send=sent.append),
                               matchmaking_kwargs=dict(target_group_size=configured))
    cls._size_next_group(averager)
    assert sent == [("_set_target_group_size", [expected], {})]
    assert averager.group_size_hint is None  # used once


@pytest.mark.parametrize("shielded", [True, False], ids=["collabopt", "hivemind"])
def test_a_sender_that_dies_mid_part_does_not_cancel_the_part_for_the_others(shielded):
    """hivemind 1.1.12: the handler of a sender whose stream closed is cancelled, and with it the part's future that
    every sender awaits; each member then waited for its own share until allreduce_timeout (30 s in the churn test).
    collabopt's reducer shields that future: the others get the average."""
    import asyncio

    from hivemind.averaging.partition import TensorPartReducer

    reducer_class = averaging.ShieldedTensorPartReducer if shielded else TensorPartReducer

    async def round_with_a_dying_sender() -> tuple[bool, torch.Tensor | None]:
        reducer = reducer_class([torch.Size([4])], num_senders=3)
        first = asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(4)))
        dying = asyncio.create_task(reducer.accumulate_part(1, 0, torch.full((4,), 3.0)))
        await asyncio.sleep(0.01)  # both parts added, both senders waiting for the third
        dying.cancel()  # its stream closed: hivemind cancels its handler
        await asyncio.sleep(0.01)
        if first.done():
            return first.cancelled(), None
        reducer.on_sender_failed(1)  # the runner bans it; the part it sent stays in
        third = await reducer.accumulate_part(2, 0, torch.full((4,), 5.0))
        return False, torch.stack([await first, third])

    cancelled, averages = asyncio.run(round_with_a_dying_sender())
    if shielded:
        assert not cancelled and torch.equal(averages, torch.full((2, 4), 3.0))
    else:
        assert cancelled  # the defect the shield removes (if this fails, hivemind fixed it)


def test_only_collabopts_averagers_build_shielded_reducers_and_only_in_their_own_process(monkeypatch):
    """The seam (averaging.ShieldedReducers): an averager's process replaces hivemind's reducer class as it starts
    (run() runs in the forked averager process); the training process and other averagers keep hivemind's."""
    from hivemind.averaging import allreduce
    from hivemind.averaging.partition import TensorPartReducer
    from hivemind.optim.grad_averager import GradientAverager

    from collabopt.engine.diloco_averaging import PseudoGradientAverager

    assert allreduce.TensorPartReducer is TensorPartReducer  # importing collabopt replaces nothing
    for ours in (averaging.GradientAveragerThatTellsGaps, state.ConsistentStateAverager, PseudoGradientAverager):
        assert issubclass(ours, averaging.ShieldedReducers), ours
    assert not issubclass(GradientAverager, averaging.ShieldedReducers)
    seen = []
    monkeypatch.setattr(allreduce, "TensorPartReducer", TensorPartReducer)  # restored after the test

    class Process:
        def run(self) -> None:
            seen.append(allreduce.TensorPartReducer)

    class Averager(averaging.ShieldedReducers, Process):
        pass

    Averager().run()  # what an averager's process does first
    assert seen == [averaging.ShieldedTensorPartReducer]
