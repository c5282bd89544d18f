"""Pre-scheduled state rounds (collabopt._hivemind.preschedule_state_rounds): argument handling on a stand-in
optimizer; the rounds themselves run in every swarm test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hivemind.optim.optimizer import PerformanceEMA

from collabopt import _hivemind


def stand_in(matchmaking_time: float, eta: float) -> SimpleNamespace:
    calls = []
    averager = SimpleNamespace(delay_before_averaging=PerformanceEMA(alpha=0.1),
                               schedule_step=lambda scheduled_time=None, **kw: calls.append((scheduled_time, kw)))
    return SimpleNamespace(state_averager=averager, tracker=SimpleNamespace(estimated_next_update_time=eta),
                           delay_before_state_averaging=PerformanceEMA(alpha=0.1), matchmaking_time=matchmaking_time,
                           calls=calls)


@pytest.mark.parametrize(("matchmaking_time", "slack"), [(1.0, 0.5), (2.0, 1.0), (5.0, 1.0)])
def test_the_group_stays_open_until_the_estimated_start_plus_a_slack(matchmaking_time, slack):
    optimizer = stand_in(matchmaking_time, eta=1000.0)
    _hivemind.preschedule_state_rounds(optimizer)
    # hivemind pre-schedules only once it has timed a round: a first estimate of 0 s lets it start at once
    assert optimizer.delay_before_state_averaging.num_updates == 1
    optimizer.state_averager.schedule_step(gather=3, timeout=30.0)  # as _maybe_schedule_state_averaging calls it
    assert optimizer.calls == [(pytest.approx(1000.0 + slack), dict(gather=3, timeout=30.0))]
    optimizer.state_averager.schedule_step(scheduled_time=1234.0)  # an explicit time is kept
    assert optimizer.calls[-1][0] == 1234.0
