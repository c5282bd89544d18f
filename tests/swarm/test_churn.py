"""Churn, the short version: 5 peers, 2 SIGKILLs 9-10 s apart, each peer restarted with the same identity.

The driver is :func:`benchmarks.churn.run_churn`; the long version (3.5 minutes, against a churn-free run) is the
benchmark ``python -m benchmarks.churn``.
"""

from __future__ import annotations

import pytest
from helpers import SWARM_ROUNDING, unique_run_id

from benchmarks.churn import run_churn

pytestmark = [pytest.mark.swarm, pytest.mark.slow]


def test_churn_killed_peers_restart_in_sync_and_the_swarm_goes_on(tmp_path, monkeypatch):
    """Each restarted peer holds the swarm's parameters before its first contribution; the swarm keeps making
    epochs; at the end every live peer is in sync and finite, and no process of a killed peer is left (its DHT
    process and p2pd exit by themselves once the training process is gone)."""
    # kills 9-10 s apart: 2 within 18-20 s plus a kill-and-restart overhead, so a 24 s window (the loop ends at the
    # second kill: the window costs nothing unless a kill is late). Two kills, not the benchmark's three: the seed
    # picks two different peers either way (e, then b), and a third kill added 10 s to the suite and no new case.
    # matchmaking_time 3 s, not the benchmark's 5 s:
    # with 5 s an epoch took 5-10 s, and the start, 40 s of kills and the 2 settling epochs 72-94 s; with 3 s an
    # epoch takes 3-4 s, 6-10 s around a kill. (With 2 s, under an older engine, one run of 3 ended in two lineages:
    # a restarted peer counted one epoch ahead, the others downloaded its state at the last boundary and the last
    # round split in two pairs)
    monkeypatch.setenv("COLLABOPT_BENCHMARK_FORK", "1")  # its peers forked from the test launcher
    report = run_churn(tmp_path, peers=5, seconds=24, kills=2, interval=(9.0, 10.0), run_id=unique_run_id("churn"),
                       options=dict(matchmaking_time=3.0))
    assert report["kills"] == 2, report
    # the swarm goes on: at least 2 epochs in the kills' window (5 in 2 runs of this 24 s window, 4-6 in 3 runs of
    # a 34 s one with 3 kills; a round whose member was just killed waits for it). With 5 s matchmaking and 40 s of
    # kills ">= 3" failed once at 2, in a run whose peers then all reached the finish line in sync
    assert report["epochs_reached"] >= 2, report
    for restart in report["restarts"]:
        assert restart["start_epoch"] >= 2 and restart["diff_before_first_step"] is not None, report
        assert restart["diff_before_first_step"] <= SWARM_ROUNDING, report
    assert min(report["final_epochs"].values()) >= report["target_epoch"], report
    assert report["final_diff"] <= SWARM_ROUNDING, report
    assert report["finite"], report
    assert report["orphans"] == {}, report
