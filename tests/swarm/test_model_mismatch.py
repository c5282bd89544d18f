"""A peer whose model has other shapes than the swarm's stops with an error that names the first differing parameter
and both shapes, before its first contribution, and the swarm trains on undisturbed: a late joiner (the state it
downloads) and peers that start together (the records of the peers' models, synchronous and DiLoCo modes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import (
    HERE,
    SWARM_ROUNDING,
    Process,
    child_env,
    diffs_at_common_epochs,
    finish,
    finish_line,
    max_param_diff,
    read_params,
    read_result,
    start_peer,
    unique_run_id,
    wait_all,
    worst,
)

pytestmark = [pytest.mark.swarm, pytest.mark.slow]


def stopped_with_a_mismatch(other) -> str:
    """Wait for the peer of the other model to end; it must exit non-zero with ModelMismatchError naming the first
    parameter. Returns its log."""
    try:
        code = wait_all({"other": other}, 150)["other"]
    finally:
        other.kill_tree()
    log = other.log()
    assert code not in (0, None), f"the peer of another model exited with {code}:\n{log[-4000:]}"
    assert "ModelMismatchError" in log and "parameter 0 (0.weight)" in log, log[-4000:]
    return log


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
    log = stopped_with_a_mismatch(other)
    assert "(64, 16)" in log and "(48, 16)" in log, log[-4000:]
    assert not (tmp_path / "other.started").exists(), "it stopped after it started training"
    finish(procs, 150)

    results = {name: read_result(tmp_path, name) for name in "ab"}
    assert all(result["final_epoch"] >= 6 for result in results.values()), results
    # it reported no progress: a peer stores its record only once it counted samples, and the others never saw it
    assert all(result["max_peers_seen"] == 2 for result in results.values()), results
    for name, proc in procs.items():
        assert "Traceback" not in proc.log(), f"{name}:\n{proc.log()[-4000:]}"
    diffs = diffs_at_common_epochs(tmp_path, ["a", "b"], results=results)
    assert diffs and worst(diffs.values()) <= SWARM_ROUNDING, diffs
    params = {name: read_params(tmp_path, name) for name in "ab"}
    assert all(tuple(params[name]["0.weight"].shape) == (64, 16) for name in "ab")



def start(tmp_path: Path, name: str, config: dict, bootstrap: str, worker: Path) -> Process:
    """Start ``worker`` (peer_worker.py or diloco_worker.py) with ``config``; its results go to ``<name>.*``."""
    config = dict(config, out=str(tmp_path / name))
    path = tmp_path / f"{name}.config.json"
    path.write_text(json.dumps(config))
    return Process([sys.executable, str(worker), str(path)], tmp_path / f"{name}.log",
                   env=child_env(INITIAL_PEERS=bootstrap))


@pytest.mark.parametrize("mode", ["synchronous", "diloco"])
def test_peers_that_start_together_with_another_model_than_most_stop_before_their_first_round(tmp_path, bootstrap,
                                                                                                  mode):
    """Nothing to download (all start at epoch 0): the records of the peers' models decide. The peer of the model
    fewer peers run stops at once with the error; the two others train on and end in sync."""
    # a and b: Linear(16, 64), ReLU, Linear(64, 4); other: Linear(16, 48), ReLU, Linear(48, 4)
    diloco = mode == "diloco"
    epochs = 4 if diloco else 5
    base = dict(run_id=unique_run_id(f"together_{mode}"), target_batch_size=320 if diloco else 480, epochs=epochs,
                step_sleep=0.05, hidden=64, model_seed=0, wait_peers=3, max_seconds=150,
                finish_with=finish_line(tmp_path, "a", "b"))
    if not diloco:
        base.update(lr=0.3, save_epoch_params=True, options=dict(matchmaking_time=1.0, averaging_timeout=10.0))
    worker = HERE / ("diloco_worker.py" if diloco else "peer_worker.py")
    procs = {name: start(tmp_path, name, dict(base, seed=i), bootstrap, worker) for i, name in enumerate("ab")}
    other = start(tmp_path, "other", dict(base, seed=3, hidden=48, finish_with=[]), bootstrap, worker)
    log = stopped_with_a_mismatch(other)
    assert "is (48, 16) torch.float32 here and (64, 16) torch.float32" in log, log[-4000:]
    # within its first epoch: it never left epoch 0 (no round, no download)
    assert json.loads((tmp_path / "other.progress").read_text())["epoch"] == 0, log[-4000:]
    assert (tmp_path / "other.progress").exists() and not (tmp_path / "other.json").exists()
    finish(procs, 150)

    results = {name: read_result(tmp_path, name) for name in "ab"}
    assert all(result["final_epoch"] >= epochs for result in results.values()), results
    for name, proc in procs.items():
        assert "Traceback" not in proc.log(), f"{name}:\n{proc.log()[-4000:]}"
    if diloco:
        after = {name: read_params(tmp_path, name)["after"] for name in "ab"}
        diffs = {epoch: max_param_diff(after["a"][epoch], after["b"][epoch])
                 for epoch in sorted(set(after["a"]) & set(after["b"]))}
    else:
        diffs = diffs_at_common_epochs(tmp_path, ["a", "b"], results=results)
    assert diffs and worst(diffs.values()) <= SWARM_ROUNDING, diffs
