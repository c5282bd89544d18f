"""A node (several torch.distributed processes) acting as ONE peer: torchrun + the plain adapter, real processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import (
    Process,
    child_env,
    finish,
    finish_line,
    max_param_diff,
    read_params,
    read_result,
    train_node_with_peer,
    unique_run_id,
)

WORKER = Path(__file__).resolve().parent / "node_torchrun_worker.py"
LR, GAMMA = 0.5, 0.7  # the same schedule as peer_worker's "exponential" spec


def torchrun(tmp_path: Path, name: str, cfg: dict, initial_peers: str | None = None) -> Process:
    cfg = dict(cfg, out=str(tmp_path / name))
    config_path = tmp_path / f"{name}.config.json"
    config_path.write_text(json.dumps(cfg))
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
            str(config_path)]
    env = child_env(INITIAL_PEERS=initial_peers) if initial_peers else child_env()
    return Process(args, tmp_path / f"{name}.log", env=env)


def ranks(tmp_path: Path, name: str) -> list[dict]:
    return [read_result(tmp_path, f"{name}.rank{r}") for r in (0, 1)]


@pytest.mark.swarm
def test_torchrun_node_is_one_peer_and_survives_slow_rank0(tmp_path, bootstrap):
    """torchrun --nproc_per_node 2 + a plain peer: 2 peers in the swarm, 3 bit-identical processes, exact sample
    counts, LR per global epoch on both ranks. The default process group has a 3 s timeout and rank 0's first swarm
    step takes 5 s (the default group would fail it after 3): rank 1 waits in collabopt's long-timeout group, so the job
    survives."""
    run_id, epochs = unique_run_id("torchrun"), 3  # 3 global epochs show the LR schedule
    node = torchrun(tmp_path, "node", dict(run_id=run_id, target_batch_size=2000, epochs=epochs, lr=LR, gamma=GAMMA,
                                           pg_timeout=3, rank0_delay_s=5, check_every_step=True, wait_peers=2,
                                           finish_with=finish_line(tmp_path, "peer")),
                    bootstrap)
    r0, r1, _ = train_node_with_peer(tmp_path, node, run_id=run_id, target_batch_size=2000, epochs=epochs, lr=LR,
                                     initial_peers=bootstrap)
    assert r0["steps_out_of_sync"] == r1["steps_out_of_sync"] == 0
    for r in (r0, r1):
        assert r["get_lr"] == r["scheduler_lr"]
    # the end of the run: serve_final_state is collective (rank 0 serves), every rank returns rank 0's reason
    assert r0["final_state"] == r1["final_state"] == f"no live peer is behind epoch {r0['final_epoch']}", r0


@pytest.mark.swarm
def test_torchrun_node_delayed_updates_reach_every_rank(tmp_path):
    """offload_optimizer + delay_optimizer_step: hivemind applies the update at a later step (parameters change
    without an epoch change); the version-counter check catches it and every rank stays identical at every step."""
    node = torchrun(tmp_path, "node", dict(run_id=unique_run_id("delayed"), target_batch_size=200, epochs=4, lr=LR,
                                           check_every_step=True, step_sleep=0.02,
                                           options=dict(offload_optimizer=True, delay_optimizer_step=True,
                                                        delay_state_averaging=True)))
    finish({"node": node}, timeout=120)
    r0, r1 = ranks(tmp_path, "node")
    assert r0["final_epoch"] == r1["final_epoch"] == 4
    assert r0["refused_unwrapped_model"] and r1["refused_unwrapped_model"]  # collaborate() needs the DDP model
    assert r0["steps_out_of_sync"] == r1["steps_out_of_sync"] == 0
    assert r0.get("param_changes_without_epoch_change", 0) >= 1, r0  # the delayed path was exercised
    assert max_param_diff(read_params(tmp_path, "node.rank0"), read_params(tmp_path, "node.rank1")) == 0.0
