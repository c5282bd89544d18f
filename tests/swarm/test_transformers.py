"""``CollaborativeTrainer`` on real processes: tiny GPT-2 peers (random weights from a config, made-up data) that
train together on loopback, each a ``transformers.Trainer`` in its own OS process (tests/swarm/transformers_worker.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    SWARM_ROUNDING,
    Process,
    child_env,
    finish,
    finish_line,
    max_param_diff,
    read_result,
    rounds_log,
    unique_run_id,
)

pytestmark = pytest.mark.swarm

WORKER = Path(__file__).resolve().parent / "transformers_worker.py"
LR, WARMUP = 1e-2, 1
# imported by the launcher once, not by each Trainer's process (1.1 s of CPU each): harness.launcher
PRELOAD = ("transformers.trainer", "transformers.models.gpt2.modeling_gpt2")


def start(tmp_path: Path, name: str, cfg: dict, initial_peers: str | None, processes: int = 1) -> Process:
    """A worker process, or with ``processes`` > 1 a ``torchrun`` job of that many (one peer)."""
    cfg = dict(cfg, out=str(tmp_path / name), output_dir=str(tmp_path / f"{name}_output"))
    config_path = tmp_path / f"{name}.config.json"
    config_path.write_text(json.dumps(cfg))
    env = child_env(HF_HUB_OFFLINE="1", **({"INITIAL_PEERS": initial_peers} if initial_peers else {}))
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    args = [sys.executable, *(launcher if processes > 1 else []), str(WORKER), str(config_path)]
    # (torchrun's ranks are processes it starts afresh)
    return Process(args, tmp_path / f"{name}.log", env=env, preload=PRELOAD if processes == 1 else ())


def reference_lrs(epochs: int, count: int) -> list[float]:
    """The LR of transformers' linear schedule (warmup ``WARMUP``) after k steps, k = 0 .. count - 1."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=WARMUP, num_training_steps=epochs)
    lrs = []
    for _ in range(count):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def samples_between(n: int, bs: int, ga: int, first: int, last: int) -> int:
    """Samples the Trainer feeds in its local steps ``first`` .. ``last - 1``: each pass over ``n`` samples is
    batches of ``bs`` (the last one short), grouped ``ga`` at a time (the last group of a pass may be smaller)."""
    batches = [bs] * (n // bs) + ([n % bs] if n % bs else [])
    steps = [sum(batches[i:i + ga]) for i in range(0, len(batches), ga)]
    return sum(steps[s % len(steps)] for s in range(first, last))


def why(tmp_path: Path, *names: str) -> str:
    return "\n".join(f"--- {name}:\n{rounds_log(tmp_path, name)}" for name in names)


def check_lrs(result: dict, epochs: int) -> None:
    expected = reference_lrs(epochs, result["final_epoch"] + 1)
    assert result["lrs"], "no global epoch was recorded"
    for epoch, lr in result["lrs"].items():
        assert lr == pytest.approx(expected[int(epoch)], rel=1e-9, abs=1e-15), (epoch, result["lrs"], expected)
        assert result["sched_lrs"][epoch] == pytest.approx(expected[int(epoch)], rel=1e-9, abs=1e-15)


def test_two_trainers_train_in_sync_and_one_resumes_from_its_checkpoint(tmp_path, bootstrap):
    """Two peers with different per_device_train_batch_size (8 with gradient accumulation 2, and 12) train 5 global
    epochs: equal parameters at every global epoch, the held-out loss falls, the LR at each global epoch is the
    linear schedule's over 5 global epochs (max_steps), every sample fed is counted (short last batches included),
    logs carry the swarm's state. Then B resumes alone from one of its save_steps checkpoints taken mid-run: epoch,
    local step, optimizer statistics, parameters and LR are those saved, and it trains on to the last epoch."""
    run_id, epochs = unique_run_id("hf_sync"), 5
    common = dict(run_id=run_id, target_batch_size=128, max_steps=epochs, lr=LR, warmup=WARMUP, n=100, wait_peers=2)
    configs = {"a": dict(common, bs=8, ga=2, data_seed=1, finish_with=finish_line(tmp_path, "b")),
               "b": dict(common, bs=12, ga=1, data_seed=2, save_steps=4, finish_with=finish_line(tmp_path, "a"))}
    procs = {name: start(tmp_path, name, cfg, bootstrap) for name, cfg in configs.items()}
    finish(procs, timeout=150)
    results = {name: read_result(tmp_path, name) for name in procs}
    params = {name: torch.load(tmp_path / f"{name}.epochs.pt") for name in procs}

    for name, r in results.items():
        cfg = configs[name]
        assert r["target_epochs"] == epochs and r["final_epoch"] >= epochs, (name, r["final_epoch"])
        assert r["closed"] and r["optimizer_restored"] == "AcceleratedOptimizer"
        assert r["samples_reported"] == samples_between(100, cfg["bs"], cfg["ga"], 0, r["global_step"]), name
        assert r["samples_fed"] == r["samples_reported"]
        assert r["eval_loss_after"] < r["eval_loss_before"] - 0.3, (name, r["eval_loss_before"], r["eval_loss_after"])
        assert r["predict"]["test_loss"] == pytest.approx(r["eval_loss_after"], rel=1e-6)  # predict() unchanged
        check_lrs(r, epochs)
        assert max(entry["swarm/num_peers"] for entry in r["logs"]) == 2, r["logs"]
        assert max(entry["swarm/local_epoch"] for entry in r["logs"]) >= epochs - 1
        assert r["logs"][-1]["swarm/samples_per_second"] > 0
    # reaching max_steps global epochs, B saved a last checkpoint, as a plain Trainer does at max_steps
    reached = min(step for epoch, step in results["b"]["local_steps_at"].items() if int(epoch) >= epochs)
    assert (tmp_path / "b_output" / f"checkpoint-{reached}" / "optimizer.pt").exists()
    # several local steps per global epoch, and a peer's steps differ from the other's (other batch sizes)
    assert results["a"]["global_step"] >= 2 * epochs and results["b"]["global_step"] >= 2 * epochs
    common_epochs = sorted(set(params["a"]) & set(params["b"]))
    assert len(common_epochs) >= epochs - 1, (sorted(params["a"]), sorted(params["b"]))
    for epoch in common_epochs:
        diff = max_param_diff(params["a"][epoch], params["b"][epoch])
        assert diff <= SWARM_ROUNDING, (epoch, diff, why(tmp_path, "a", "b"))
    assert max_param_diff(params["a"][common_epochs[-1]], params["a"][common_epochs[0]]) > 1e-3

    # ---- B resumes alone (a new run) from a checkpoint of the middle of the run
    checkpoints = sorted((tmp_path / "b_output").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    states = {path: torch.load(path / "optimizer.pt", weights_only=True) for path in checkpoints}
    # (not epoch 1: the warmup's LR of epoch 0 is 0, so the parameters saved then are still the initial ones)
    middle = [path for path, state in states.items() if 2 <= state["local_epoch"] <= epochs - 2]
    assert middle, {path.name: state.get("local_epoch") for path, state in states.items()}
    checkpoint, saved = middle[0], states[middle[0]]
    assert saved["format"] == "collabopt/1" and saved["scheduler"] is not None
    step = int(checkpoint.name.split("-")[1])
    resumed = start(tmp_path, "b2", dict(configs["b"], run_id=unique_run_id("hf_resume"), resume=str(checkpoint),
                                         finish_with=[], wait_peers=0), None)
    finish({"b2": resumed}, timeout=120)
    r = read_result(tmp_path, "b2")
    from safetensors.torch import load_file

    saved_params = load_file(str(checkpoint / "model.safetensors"))
    start_state = r["start"]
    assert start_state["epoch"] == saved["local_epoch"] and start_state["global_step"] == step
    assert start_state["lr"] == pytest.approx(reference_lrs(epochs, epochs)[saved["local_epoch"]], rel=1e-9)
    exp_avg = sum(float(s["exp_avg"].double().sum()) for s in saved["optimizer"]["state"].values())
    assert start_state["exp_avg_sum"] == pytest.approx(exp_avg, rel=1e-12) and exp_avg != 0.0
    saved_sum = sum(float(t.double().sum()) for t in saved_params.values())
    assert start_state["param_sum"] == pytest.approx(saved_sum, rel=1e-12)
    assert abs(saved_sum - results["b"]["start"]["param_sum"]) > 1e-3  # trained parameters, not the initial ones
    assert r["final_epoch"] == epochs
    check_lrs(r, epochs)
    assert r["samples_reported"] - saved["samples_reported"] == samples_between(100, 12, 1, step, r["global_step"])


def test_trainer_in_diloco_mode_with_a_torchrun_node(tmp_path, bootstrap):
    """DiLoCo (outer_optimizer=) with a plain peer A and a peer B of 2 torchrun processes: the swarm counts 2 peers,
    the node's ranks are bit-identical, every peer holds the same parameters right after every round, several inner
    steps per round, the node counts the samples of both ranks, the rounds follow the schedule, the loss falls."""
    run_id, rounds = unique_run_id("hf_diloco"), 3
    common = dict(run_id=run_id, target_batch_size=192, max_steps=rounds, lr=LR, warmup=WARMUP, n=100, wait_peers=2,
                  outer=dict(lr=0.7, momentum=0.9, nesterov=True))
    configs = {"a": dict(common, bs=8, data_seed=1, finish_with=finish_line(tmp_path, "b")),
               "b": dict(common, bs=6, data_seed=2, finish_with=finish_line(tmp_path, "a"))}
    procs = {"a": start(tmp_path, "a", configs["a"], bootstrap), "b": start(tmp_path, "b", configs["b"], bootstrap, 2)}
    finish(procs, timeout=180)
    results = {name: read_result(tmp_path, name) for name in ("a", "b", "b.rank1")}
    params = {name: torch.load(tmp_path / f"{name}.epochs.pt") for name in results}
    assert results["a"]["type"] == "CollaborativeOptimizer"
    assert results["b"]["type"] == results["b.rank1"]["type"] == "NodeOptimizer"
    for name, r in results.items():
        assert r["start"]["diloco"] and r["final_epoch"] >= rounds, (name, r["final_epoch"])
        assert r["local_steps_at"]["1"] >= 3, r["local_steps_at"]  # inner steps before the first round
        assert r["eval_loss_after"] < r["eval_loss_before"] - 0.3, (name, r["eval_loss_before"], r["eval_loss_after"])
        assert max(entry["swarm/num_peers"] for entry in r["logs"]) == 2, r["logs"]  # the node is one peer
        check_lrs(r, rounds)
    assert results["a"]["samples_reported"] == samples_between(100, 8, 1, 0, results["a"]["global_step"])
    # the node: the samples of both ranks are counted (each trains on its share of every pass)
    fed = results["b"]["samples_fed"] + results["b.rank1"]["samples_fed"]
    assert results["b"]["samples_reported"] == results["b.rank1"]["samples_reported"] == fed
    assert results["b"]["global_step"] == results["b.rank1"]["global_step"]
    assert sorted(params["b"]) == sorted(params["b.rank1"])
    for epoch in params["b"]:
        assert max_param_diff(params["b"][epoch], params["b.rank1"][epoch]) == 0.0, epoch
    common_rounds = sorted(set(params["a"]) & set(params["b"]))
    assert len(common_rounds) >= rounds - 1, (sorted(params["a"]), sorted(params["b"]))
    for epoch in common_rounds:
        diff = max_param_diff(params["a"][epoch], params["b"][epoch])
        assert diff <= SWARM_ROUNDING, (epoch, diff, why(tmp_path, "a", "b"))


def test_example_script_trains(tmp_path):
    """examples/transformers_train.py as documented (a new swarm, one peer): it prints how others join once, the
    progress bar counts global epochs, the held-out loss falls, and it exits cleanly."""
    example = Path(__file__).resolve().parents[2] / "examples" / "transformers_train.py"
    proc = Process([sys.executable, str(example), "--max-steps", "3", "--output-dir", str(tmp_path / "out")],
                   tmp_path / "example.log", env=child_env(HF_HUB_OFFLINE="1"), preload=PRELOAD)
    finish({"example": proc}, timeout=120)
    log = (tmp_path / "example.log").read_text(errors="replace")
    assert log.count("other peers can join with") == 1 and "CollaborativeTrainer(..., initial_peers=" in log
    assert "global epochs: 100%" in log and "3/3" in log, log[-3000:]
    before, after = map(float, re.search(r"held-out loss: ([0-9.]+) -> ([0-9.]+)", log).groups())
    assert after < before - 0.2, log[-3000:]
    assert (tmp_path / "out" / "final" / "config.json").exists()
