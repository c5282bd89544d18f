"""A peer loses its link for 25 s mid-training and gets it back."""

from __future__ import annotations

import json
import time

from helpers import (
    SWARM_ROUNDING,
    finish,
    finish_line,
    max_param_diff,
    read_params,
    read_result,
    start_bootstrap,
    start_peer,
    unique_run_id,
)

CUT_SECONDS = 25.0
AVERAGING_TIMEOUT, MATCHMAKING_TIME = 10.0, 2.0


def epoch_of(tmp_path, name) -> int:
    try:
        return json.loads((tmp_path / f"{name}.progress").read_text())["epoch"]
    except (OSError, ValueError, KeyError):
        return 0


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_cut_link_heals_and_the_peer_catches_up(tmp_path, net3):
    """A and B keep making global epochs while C is cut off; C does not crash, downloads the swarm's state once its
    link is back, and ends in sync with A and B."""
    names = ["a", "b", "c"]
    bootstrap, initial_peers = start_bootstrap(tmp_path, host=net3.bootstrap_addr, netns=net3.bootstrap)
    epochs = 12
    base = dict(run_id=unique_run_id("cut_link"), target_batch_size=1536, epochs=epochs, model_seed=0, lr=0.3,
                step_sleep=0.05, finish_with=finish_line(tmp_path, *names), wait_peers=3, max_seconds=240)
    procs = {}
    try:
        for i, name in enumerate(names):
            options = dict(host_maddrs=[f"/ip4/{net3.addr[i]}/tcp/0"], averaging_timeout=AVERAGING_TIMEOUT,
                           matchmaking_time=MATCHMAKING_TIME)
            procs[name] = start_peer(tmp_path, name, dict(base, seed=i + 1, options=options), initial_peers,
                                     netns=net3.peers[i])
        wait_until(lambda: epoch_of(tmp_path, "c") >= 2, 120, "the swarm did not reach epoch 2")
        at_cut = {name: epoch_of(tmp_path, name) for name in names}
        net3.cut(2)
        time.sleep(CUT_SECONDS)
        at_restore = {name: epoch_of(tmp_path, name) for name in names}
        net3.restore(2)
        finish(procs, 300)
    finally:
        for proc in procs.values():
            proc.kill_tree()
        bootstrap.kill_tree()
    results = {name: read_result(tmp_path, name) for name in names}
    params = {name: read_params(tmp_path, name) for name in names}
    # the healthy peers went on: at most averaging_timeout + matchmaking_time without an epoch (measured: ~20 s)
    for name in ("a", "b"):
        assert at_restore[name] - at_cut[name] >= 1, (name, at_cut, at_restore)
    for name, result in results.items():
        assert result["final_epoch"] >= epochs, (name, result["final_epoch"])
    assert "Downloading parameters from peer" in procs["c"].log() or "load_state" in procs["c"].log(), (
        "C never caught up by downloading the swarm's state")
    assert max_param_diff(params["a"], params["b"]) <= SWARM_ROUNDING
    assert max_param_diff(params["a"], params["c"]) <= SWARM_ROUNDING
