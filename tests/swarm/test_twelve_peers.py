"""A swarm of 12 peers on loopback, half of them in client mode (issue 36): every peer trains, and all end in sync.

Twelve peers keep this machine's 2 cores busy (each has a training process, a DHT, two averagers and a p2pd), so
the epochs are long enough for that: about 15 s of the swarm's samples."""

from __future__ import annotations

import pytest
from helpers import (
    SWARM_ROUNDING,
    finish,
    finish_line,
    max_param_diff,
    read_params,
    read_result,
    start_peer,
    unique_run_id,
)

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

PEERS = 12


def test_twelve_peers_half_in_client_mode_train_in_sync(tmp_path, bootstrap):
    names = [f"p{i:02d}" for i in range(PEERS)]
    # 2 global epochs: both rounds of all 12 (every peer waits for the 12 first), the loss falls, all end in sync
    base = dict(run_id=unique_run_id("twelve"), target_batch_size=3072, epochs=2, model_seed=0, lr=0.5,
                step_sleep=0.1, finish_with=finish_line(tmp_path, *names), wait_peers=PEERS, max_seconds=240)
    configs = {name: dict(base, seed=i, options=dict(client_mode=i % 2 == 1, matchmaking_time=3.0,
                                                     averaging_timeout=30.0))
               for i, name in enumerate(names)}
    procs = {name: start_peer(tmp_path, name, cfg, bootstrap) for name, cfg in configs.items()}
    finish(procs, timeout=330)
    results = {name: read_result(tmp_path, name) for name in names}
    params = {name: read_params(tmp_path, name) for name in names}
    for name, result in results.items():
        assert result["final_epoch"] >= 2, (name, result["final_epoch"])
        assert result["samples_reported"] > 0, (name, "trained nothing")
        assert result["final_loss"] < result["start_loss"], (name, result["start_loss"], result["final_loss"])
        assert result["rounds"] and all(r["applied"] for r in result["rounds"]), (name, result["rounds"])
        assert result["rounds"][-1]["group_size"] == PEERS, (name, "the last round was not one group of all")
    epochs = [r["final_epoch"] for r in results.values()]
    assert max(epochs) - min(epochs) <= 1, epochs
    apart = {name: max_param_diff(params[names[0]], params[name]) for name in names[1:]}
    assert all(diff <= SWARM_ROUNDING for diff in apart.values()), apart
