"""A peer whose model has other shapes than the swarm's joins a running swarm: it stops with an error that names the
first differing parameter and both shapes, before its first contribution, and the swarm trains on undisturbed."""

from __future__ import annotations

import pytest
from helpers import (
    SWARM_ROUNDING,
    diffs_at_common_epochs,
    finish,
    finish_line,
    read_params,
    read_result,
    start_peer,
    unique_run_id,
    wait_all,
)

pytestmark = [pytest.mark.swarm, pytest.mark.slow]


def test_a_peer_of_another_model_stops_before_its_first_contribution_and_the_swarm_trains_on(tmp_path, bootstrap):
    # the swarm's model: Linear(16, 64), ReLU, Linear(64, 4); the joiner's: Linear(16, 48), ReLU, Linear(48, 4)
    base = dict(run_id=unique_run_id("mismatch"), target_batch_size=480, epochs=6, lr=0.3, step_sleep=0.05,
                hidden=64, model_seed=0, save_epoch_params=True, finish_with=finish_line(tmp_path, "a", "b"),
                options=dict(matchmaking_time=1.0, averaging_timeout=10.0))
    procs = {name: start_peer(tmp_path, name, dict(base, seed=i, wait_peers=2), bootstrap)
             for i, name in enumerate("ab")}
    other = start_peer(tmp_path, "other", dict(base, seed=3, hidden=48, finish_with=[], max_seconds=150,
                                               start_after=dict(progress_file=str(tmp_path / "a.progress"),
                                                                epoch=2)), bootstrap)
    try:
        code = wait_all({"other": other}, 150)["other"]
    finally:
        other.kill_tree()
    log = other.log()
    assert code not in (0, None), f"the peer of another model exited with {code}:\n{log[-4000:]}"
    assert "ModelMismatchError" in log, log[-4000:]
    assert "parameter 0 (0.weight)" in log and "(64, 16)" in log and "(48, 16)" in log, log[-4000:]
    assert not (tmp_path / "other.started").exists(), "it stopped after it started training"
    finish(procs, 150)

    results = {name: read_result(tmp_path, name) for name in "ab"}
    assert all(result["final_epoch"] >= 6 for result in results.values()), results
    # it reported no progress: a peer stores its record only once it counted samples, and the others never saw it
    assert all(result["max_peers_seen"] == 2 for result in results.values()), results
    for name, proc in procs.items():
        assert "Traceback" not in proc.log(), f"{name}:\n{proc.log()[-4000:]}"
    diffs = diffs_at_common_epochs(tmp_path, ["a", "b"], results=results)
    assert diffs and max(diffs.values()) <= SWARM_ROUNDING, diffs
    params = {name: read_params(tmp_path, name) for name in "ab"}
    assert all(tuple(params[name]["0.weight"].shape) == (64, 16) for name in "ab")
