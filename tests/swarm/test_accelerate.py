"""Accelerate adapter on real processes: ``accelerate launch`` with 2 CPU processes acting as ONE peer.

The 2-CPU form is ``accelerate launch --multi_gpu --num_processes 2 ...`` with ``Accelerator(cpu=True)`` (gloo):
``--cpu --num_processes 2`` starts a single process.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
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
    wait_for_file,
)
from schedulers import reference_lrs

pytestmark = pytest.mark.swarm

WORKER = Path(__file__).resolve().parent / "accelerate_worker.py"
LR, GAMMA = 0.5, 0.7  # the same schedule as peer_worker's "exponential" spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, name: str, cfg: dict, initial_peers: str | None = None) -> Process:
    """``accelerate launch`` of the worker with 2 CPU processes."""
    cfg = dict(cfg, out=str(tmp_path / name))
    config_path = tmp_path / f"{name}.config.json"
    config_path.write_text(json.dumps(cfg))
    args = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), str(WORKER), str(config_path)]
    env = child_env(INITIAL_PEERS=initial_peers) if initial_peers else child_env()
    return Process(args, tmp_path / f"{name}.log", env=env)


def ranks(tmp_path: Path, name: str) -> list[dict]:
    return [read_result(tmp_path, f"{name}.rank{r}") for r in (0, 1)]


def test_accelerate_node_and_peer_train_in_sync(tmp_path, bootstrap):
    """2 accelerate processes (gradient_accumulation_steps=2) + 1 plain peer: the swarm sees 2 peers, all 3
    processes end bit-identical, every fed sample is counted once, the scheduler advances once per epoch."""
    run_id, epochs = unique_run_id("acc_swarm"), 3  # 3 global epochs show the LR schedule
    node = launch(tmp_path, "node", dict(run_id=run_id, target_batch_size=3000, epochs=epochs, ga=2, lr=LR,
                                         gamma=GAMMA, step_sleep=0.05, wait_peers=2,
                                         finish_with=finish_line(tmp_path, "peer")), bootstrap)
    r0, r1, _ = train_node_with_peer(tmp_path, node, run_id=run_id, target_batch_size=3000, epochs=epochs, lr=LR,
                                     initial_peers=bootstrap)
    assert r0["epochs_seen"] == r1["epochs_seen"]
    assert r0["samples_fed"] == r1["samples_fed"]  # gradient accumulation included
    # the scheduler passed to prepare() advanced once per global epoch, identically on both ranks
    for r in (r0, r1):
        for epoch, lr in r["lrs"].items():
            assert r["sched_lrs"][epoch] == pytest.approx(lr, rel=1e-12)
    assert r0["lrs"] == r1["lrs"]
    # accelerator.log carried the swarm metrics (main process only)
    assert r0["logged"] and r0["logged"][-1]["swarm/num_peers"] == 2 and r1["logged"] == []


def test_accelerate_fp16_scaler_with_reused_buffers_equals_fp32_and_bf16_trains(tmp_path):
    """fp16 loss scaling (emulated on CPU: torch GradScaler, fp32 math) + reuse_grad_buffers + clip_grad_norm_
    through accelerate gives the fp32 update exactly; bf16 autocast trains and keeps ranks identical."""
    common = dict(target_batch_size=160, epochs=3, lr=0.5, gamma=GAMMA, reuse=True, clip=1e6, step_sleep=0.0,
                  exact_epochs=True)
    # three lone nodes, each in a swarm of its own (its own run id), started together
    procs = {
        name: launch(tmp_path, name, dict(common, run_id=unique_run_id(f"acc_{name}"), **extra))
        for name, extra in {"fp32": {}, "fp16": {"emulate_fp16": True}, "bf16": {"mixed_precision": "bf16"}}.items()
    }
    finish(procs, timeout=150)

    params = {name: [read_params(tmp_path, f"{name}.rank{r}") for r in (0, 1)] for name in ("fp32", "fp16", "bf16")}
    for name, (a, b) in params.items():
        assert max_param_diff(a, b) == 0.0, name
        assert all(r["final_epoch"] == 3 for r in ranks(tmp_path, name)), name
    start = torch.load(tmp_path / "fp32.rank0.start.pt")
    moved = max_param_diff(params["fp32"][0], start)
    assert moved > 1e-2
    # loss scale 1024 is a power of two: scaling and unscaling are exact, so fp16 (emulated) == fp32 bit for bit
    assert max_param_diff(params["fp16"][0], params["fp32"][0]) == 0.0
    assert ranks(tmp_path, "fp16")[0]["samples_reported"] == ranks(tmp_path, "fp32")[0]["samples_reported"]
    # bf16: same training, rounding differences only (an update off by the loss scale would be far larger)
    assert max_param_diff(params["bf16"][0], params["fp32"][0]) < 0.1 * moved


def test_accelerate_save_state_kill_load_state_resumes(tmp_path):
    """save_state at epoch 2, kill the job, load_state in a new job: epoch, optimizer and scheduler resume."""
    common = dict(target_batch_size=160, lr=LR, gamma=GAMMA, momentum=0.9, step_sleep=0.0,
                  save_dir=str(tmp_path / "ckpt"))
    first = launch(tmp_path, "first", dict(common, run_id=unique_run_id("acc_save"), epochs=5, save_at=2))
    try:
        assert all(wait_for_file(tmp_path / f"first.rank{r}.json", 120) for r in (0, 1)), first.log()[-5000:]
        time.sleep(0.5)
    finally:
        first.kill_tree()  # killed after the checkpoint, without a clean shutdown
    saved = ranks(tmp_path, "first")
    assert saved[0]["final_epoch"] == 2
    assert (tmp_path / "ckpt").is_dir()

    second = launch(tmp_path, "second", dict(common, run_id=unique_run_id("acc_load"), epochs=3,
                                             load_from=str(tmp_path / "ckpt")))
    finish({"second": second}, timeout=120)
    resumed = ranks(tmp_path, "second")
    expected = reference_lrs("exponential", LR, 3)
    for r in resumed:
        assert r["start_epoch"] == 2, r
        assert r["lrs"]["2"] == r["sched_lrs"]["2"] == pytest.approx(expected[2], rel=1e-12)
        assert r["final_epoch"] == 3 and r["lrs"]["3"] == pytest.approx(expected[3], rel=1e-12)
    # optimizer statistics (SGD momentum, on rank 0 which steps) and parameters are those saved
    assert resumed[0]["momentum_buffer_start"] == saved[0]["momentum_buffer_saved"] is not None
    start = [torch.load(tmp_path / f"second.rank{r}.start.pt") for r in (0, 1)]
    assert max_param_diff(start[0], read_params(tmp_path, "first.rank0")) == 0.0
    assert max_param_diff(start[1], read_params(tmp_path, "first.rank0")) == 0.0


def test_accelerate_example_script_trains_as_one_peer(tmp_path):
    """examples/accelerate_train.py under the documented 2-CPU launch command: one peer joins (one join message,
    from rank 0), it trains to a useful held-out accuracy and exits cleanly."""
    example = Path(__file__).resolve().parents[2] / "examples" / "accelerate_train.py"
    args = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), str(example), "--cpu", "--epochs", "4",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = Process(args, tmp_path / "example.log")
    finish({"example": proc}, timeout=150)
    log = (tmp_path / "example.log").read_text(errors="replace")
    assert log.count("other peers can join with") == 1, log[-3000:]
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", log).group(1))
    assert accuracy > 0.7, log[-3000:]
    assert (tmp_path / "ckpt").is_dir()
