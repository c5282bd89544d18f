"""Pre-scheduled state rounds (collabopt._hivemind.preschedule_state_rounds): argument handling on a stand-in
optimizer; the rounds themselves run in every swarm test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hivemind.optim.optimizer import PerformanceEMA
from hivemind.utils import get_dht_time

from collabopt import _hivemind


def stand_in(matchmaking_time: float, eta: float) -> SimpleNamespace:
    calls = []
    averager = SimpleNamespace(delay_before_averaging=PerformanceEMA(alpha=1.0),
                               schedule_step=lambda scheduled_time=None, **kw: calls.append((scheduled_time, kw)))
    return SimpleNamespace(state_averager=averager, tracker=SimpleNamespace(estimated_next_update_time=eta),
                           delay_before_state_averaging=PerformanceEMA(alpha=1.0), matchmaking_time=matchmaking_time,
                           calls=calls)


@pytest.mark.parametrize(("matchmaking_time", "slack"), [(1.0, 0.5), (2.0, 1.0), (5.0, 1.0)])
def test_the_group_stays_open_until_the_estimated_start_plus_a_slack(matchmaking_time, slack):
    eta = get_dht_time() + matchmaking_time
    optimizer = stand_in(matchmaking_time, eta)
    _hivemind.preschedule_state_rounds(optimizer)
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
    _hivemind.preschedule_state_rounds(optimizer)
    optimizer.state_averager.schedule_step(timeout=2.5)
    assert optimizer.calls[0][0] < get_dht_time() + 2.5
