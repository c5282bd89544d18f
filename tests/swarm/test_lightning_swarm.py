"""Lightning adapter: real Trainers with CollaborativeStrategy, each in its own fresh OS process on loopback."""

from __future__ import annotations

import json
import signal
import sys
import time
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
    rounds_log,
    unique_run_id,
    wait_for_file,
)

WORKER = Path(__file__).resolve().parent / "lightning_worker.py"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"
# imported by the launcher once, not by each trainer's process (2.3 s of CPU each): harness.launcher
PRELOAD = ("lightning.pytorch",)


def start_trainer(tmp_path: Path, name: str, config: dict, initial_peers: str) -> Process:
    config = dict(config, out=str(tmp_path / name))
    config_path = tmp_path / f"{name}.config.json"
    config_path.write_text(json.dumps(config))
    return Process([sys.executable, str(WORKER), str(config_path)], tmp_path / f"{name}.log",
                   env=child_env(INITIAL_PEERS=initial_peers), preload=PRELOAD)


def result(tmp_path: Path, name: str, rank: int = 0) -> dict:
    path = tmp_path / f"{name}.rank{rank}.json"
    if not path.exists():
        log = (tmp_path / f"{name}.log").read_text(errors="replace")
        raise AssertionError(f"trainer {name} wrote no result; its log ends with:\n{log[-5000:]}")
    return json.loads(path.read_text())


def params(tmp_path: Path, name: str, rank: int = 0) -> dict:
    return torch.load(tmp_path / f"{name}.rank{rank}.pt")


def torch_lrs(scheduler: str, lr: float, epochs: int) -> list[float]:
    """LR of plain torch after k = 0..epochs scheduler steps (the reference for 'k global epochs')."""
    from lightning_worker import make_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make_scheduler(scheduler, opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(epochs):
        opt.step()
        sched.step(1.0) if scheduler == "plateau" else sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


# ---------------------------------------------------------------------------------------------- no swarm


# ---------------------------------------------------------------------------------------------- real swarms


@pytest.mark.swarm
def test_trainers_and_a_two_device_node_in_sync_and_a_late_joiner_catches_up(tmp_path, bootstrap):
    """A (offload + StepLR from configure_optimizers + accumulate_grad_batches=2), B (16-mixed GradScaler path), a
    node (accelerator="cpu", devices=2: gloo DDP) and C (bf16-mixed, joins late) end at the same global epoch with
    bit-identical weights; samples counted = samples fed; LR = torch's. The node is ONE swarm peer: the swarm never
    counts more than 4 peers (A, B, the node, C), its ranks end bit-identical, and it reports the samples of both
    its ranks. (One swarm for both claims: a second swarm of the same adapter cost the suite 14 s.)"""
    run_id = unique_run_id("lightning_sync")
    epochs, lr = 5, 0.1  # epochs of a few seconds; C joins at 2 and trains 3 of them with the others
    base = dict(run_id=run_id, target_batch_size=768, global_epochs=epochs, lr=lr, scheduler="step",
                batch_size=16, step_sleep=0.05, max_seconds=100,
                finish_with=finish_line(tmp_path, "a", "b", "node", "c"))
    # A, B and the node start training together, and wait at epoch 2 until C has joined (and downloaded their state)
    together = dict(barrier=[str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "node")],
                    pause_at=dict(epoch=2, until=str(tmp_path / "c")))
    procs = {
        "a": start_trainer(tmp_path, "a", dict(base, **together, seed=1, accumulate=2,
                                               options={"offload_optimizer": True}), bootstrap),
        # the 16-mixed code path (Lightning's MixedPrecision with a torch.amp.GradScaler) on a CPU
        "b": start_trainer(tmp_path, "b", dict(base, **together, seed=2, fp16_scaler_on_cpu=1024), bootstrap),
        "node": start_trainer(tmp_path, "node", dict(base, **together, seed=4, devices=2), bootstrap),
    }
    # C's process starts once A trains (its imports meanwhile: what the launcher has not preloaded) and joins at A's
    # epoch 2
    assert wait_for_file(tmp_path / "a.progress", 60), procs["a"].log()[-3000:]
    late = dict(progress_file=str(tmp_path / "a.progress"), epoch=2)
    procs["c"] = start_trainer(tmp_path, "c", dict(base, seed=3, precision="bf16-mixed", start_after=late), bootstrap)
    finish(procs, 150)

    results = {name: result(tmp_path, name) for name in procs}
    ranks = [results["node"], result(tmp_path, "node", 1)]
    weights = {name: params(tmp_path, name) for name in procs}
    for name, res in results.items():
        assert res["final_epoch"] >= epochs, (name, res)  # one more where a peer counted a round late
        if name in ("a", "b"):  # exact, also with accumulation (B: AMP steps skipped on inf/nan count as skipped)
            assert res["samples_reported"] + res["samples_skipped"] == res["samples_fed"], (name, res)
            assert res["samples_skipped"] <= 16 * 2, (name, res)
        elif name == "c":  # a late joiner's steps before it caught up are not counted by the swarm
            assert 0 < res["samples_reported"] <= res["samples_fed"], res
    # the node reported the samples of both its ranks, exactly
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == 2
    assert ranks[0]["samples_reported"] == ranks[0]["samples_fed"] + ranks[1]["samples_fed"], ranks
    assert ranks[0]["final_epoch"] == ranks[1]["final_epoch"]
    # one node = one peer: A, B and the node trained together (3), C joined them (4, as C saw from its first
    # epoch on, A, B and the node waiting for it); never 5 (the node counted as 2)
    assert results["c"]["max_peers_logged"] == 4, {name: res["max_peers_logged"] for name, res in results.items()}
    for name, res in results.items():
        assert res["max_peers_logged"] <= 4, (name, res["max_peers_logged"])
    for name in ("a", "b", "node"):  # swarm metrics reached the progress bar and the logger
        assert results[name]["max_peers_logged"] >= 3, results[name]
        shown = {"swarm/num_peers", "swarm/local_epoch", "swarm/samples_per_second"}
        assert shown <= set(results[name]["logged_keys"]) and shown <= set(results[name]["progress_bar_keys"])
    assert results["c"]["start_epoch"] == 2  # the late joiner downloaded the swarm's state before training
    for name, res in results.items():  # lightning-hivemind code reads trainer.optimizers[0].local_epoch / .num_peers
        seen = res["module_saw"]
        assert seen["epoch"] == seen["wrapped_epoch"] >= epochs - 1 and seen["peers"] >= 2, (name, seen)
        assert not seen["wrapped_closed"], (name, seen)
    assert max_param_diff(weights["node"], params(tmp_path, "node", 1)) == 0.0  # the node's ranks: a broadcast
    why = {name: (res["final_epoch"], res["out_of_sync"], rounds_log(tmp_path, name)) for name, res in results.items()}
    for name in ("b", "node", "c"):  # equal to float rounding (node vs a single-device peer, seen once: 5.8e-11)
        assert max_param_diff(weights["a"], weights[name]) <= SWARM_ROUNDING, (name, why)
    # LR after k global epochs == plain torch after k scheduler steps (offloaded optimizer on A)
    reference = torch_lrs("step", lr, epochs + 2)
    for name in ("a", "b"):
        for k, value in results[name]["lrs"].items():
            assert value == pytest.approx(reference[int(k)], rel=1e-12), (name, k)
        assert results[name]["scheduler_last_epoch"] == results[name]["final_epoch"]
    for res in (results["c"], *ranks):
        assert res["final_lr"] == pytest.approx(reference[res["final_epoch"]], rel=1e-12)
    assert results["a"]["lightning_epoch"] >= 0  # Lightning epochs are unrelated to global epochs


@pytest.mark.swarm
def test_resume_from_checkpoint_restores_epoch_optimizer_and_scheduler(tmp_path, bootstrap):
    run_id = unique_run_id("lightning_resume")
    ckpt = tmp_path / "peer.ckpt"
    base = dict(run_id=run_id, target_batch_size=96, optimizer="Adam", lr=0.01, scheduler="lambda", batch_size=16,
                step_sleep=0.0, n_samples=160, options={"offload_optimizer": True})
    first = {"first": start_trainer(tmp_path, "first", dict(base, global_epochs=3, save_ckpt=str(ckpt)), bootstrap)}
    finish(first, 90)
    saved = torch.load(tmp_path / "first.saved_state.pt")
    saved_result = result(tmp_path, "first")
    assert saved["local_epoch"] == 3 and ckpt.exists()

    # the whole swarm restarts from the checkpoint: no DHT record of the run remains (a fresh run id stands for that)
    restart = dict(base, run_id=unique_run_id("lightning_resume"), global_epochs=5, resume_ckpt=str(ckpt))
    second = {"second": start_trainer(tmp_path, "second", restart, bootstrap)}
    finish(second, 90)
    resumed = torch.load(tmp_path / "second.start_state.pt")
    res = result(tmp_path, "second")
    # continues from the saved epoch, with the saved optimizer statistics and scheduler state
    assert res["start_epoch"] == 3
    assert res["start_lightning_epoch"] == saved_result["saved_lightning_epoch"]
    assert resumed["local_epoch"] == 3
    assert resumed["samples_reported"] == saved["samples_reported"] > 0
    assert resumed["scheduler"]["scheduler"]["last_epoch"] == saved["scheduler"]["scheduler"]["last_epoch"] == 3
    saved_opt, resumed_opt = saved["optimizer"], resumed["optimizer"]
    assert saved_opt["param_groups"][0]["lr"] == resumed_opt["param_groups"][0]["lr"]
    assert len(saved_opt["state"]) == len(resumed_opt["state"]) > 0
    for key, state in saved_opt["state"].items():
        assert float(state["step"]) == float(resumed_opt["state"][key]["step"]) > 1
        assert torch.equal(state["exp_avg"], resumed_opt["state"][key]["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], resumed_opt["state"][key]["exp_avg_sq"])
    # and goes on: LR after 5 global epochs is torch's after 5 scheduler steps
    reference = torch_lrs("lambda", 0.01, 5)
    assert res["start_lr"] == pytest.approx(reference[3], rel=1e-12)
    assert res["final_epoch"] == 5
    assert res["samples_fed"] == 2 * 96  # no step wasted after the resume: 2 epochs of the target, exactly
    assert res["final_lr"] == pytest.approx(reference[5], rel=1e-12)
    assert res["scheduler_last_epoch"] == 5


@pytest.mark.swarm
def test_reuse_grad_buffers_disables_zero_grad_override_and_plateau_follows_global_epochs(tmp_path, bootstrap):
    """reuse_grad_buffers=True: the module's optimizer_zero_grad override is disabled with a warning (and restored
    after fit); ReduceLROnPlateau from configure_optimizers (monitor=...) is stepped once per global epoch."""
    run_id = unique_run_id("lightning_reuse")
    epochs, lr = 4, 0.1
    config = dict(run_id=run_id, target_batch_size=96, global_epochs=epochs, lr=lr, scheduler="plateau",
                  batch_size=16, step_sleep=0.0, override_zero_grad=True, options={"reuse_grad_buffers": True},
                  skip_every=3)  # training_step returns None on every 3rd batch: those samples are not counted
    procs = {"peer": start_trainer(tmp_path, "peer", config, bootstrap)}
    finish(procs, 90)
    res = result(tmp_path, "peer")
    assert "disables your optimizer_zero_grad override" in (tmp_path / "peer.log").read_text()
    assert res["zero_grad_calls_while_fitting"] == 0
    assert res["zero_grad_restored"]
    assert res["samples_reported"] == res["samples_fed"] and res["batches_skipped"] > 0
    assert res["scheduler_class"] == "ReduceLROnPlateau"  # the user's instance is back in the Trainer after fit
    reference = torch_lrs("plateau", lr, epochs)
    assert reference[epochs] < reference[1]  # the reference really cuts the LR
    assert res["final_epoch"] == epochs
    for k, value in res["lrs"].items():
        assert value == pytest.approx(reference[int(k)], rel=1e-12), (k, value, reference)
    assert res["final_lr"] == pytest.approx(reference[epochs], rel=1e-12)


@pytest.mark.swarm
def test_example_script_trains_and_prints_how_to_join(tmp_path):
    run_id = unique_run_id("lightning_example")
    proc = Process([sys.executable, str(EXAMPLE), "--run-id", run_id, "--target-batch-size", "256",
                    "--global-epochs", "4", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], tmp_path / "example.log",
                    preload=PRELOAD)
    try:
        code = proc.wait(90)
    finally:
        proc.kill_tree()
    log = (tmp_path / "example.log").read_text(errors="replace")
    assert code == 0, log[-5000:]
    # the helper message of lightning-hivemind: how other machines join
    assert "INITIAL_PEERS=/ip4/127.0.0.1/tcp/" in log and "CollaborativeStrategy(..., initial_peers=" in log
    line = next(line for line in log.splitlines() if line.startswith("finished at global epoch"))
    start, final = (float(v) for v in line.split("test accuracy ")[1].split(" -> "))
    assert line.startswith("finished at global epoch 4:"), line
    assert final > start + 0.2, line  # it learned (chance is 0.1)


@pytest.mark.swarm
def test_sigterm_stops_the_trainer_and_leaves_no_process_behind(tmp_path, bootstrap):
    config = dict(run_id=unique_run_id("lightning_sigterm"), target_batch_size=64, global_epochs=10_000,
                  batch_size=16, step_sleep=0.02, max_seconds=120)
    proc = start_trainer(tmp_path, "peer", config, bootstrap)
    try:
        assert wait_for_file(tmp_path / "peer.progress", 60), proc.log()[-3000:]
        proc.remember_descendants()
        assert proc.descendants_alive(), "hivemind's DHT / averager processes should be running"
        proc.signal(signal.SIGTERM)
        code = proc.wait(30)
        assert code is not None, "the trainer did not stop within 30 s of SIGTERM"
        deadline = time.monotonic() + 10
        while proc.descendants_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.descendants_alive() == []
    finally:
        proc.kill_tree()
    assert not (tmp_path / "peer.rank0.json").exists()  # it stopped (Lightning raises), it did not finish


@pytest.mark.swarm
def test_works_with_standalone_pytorch_lightning_when_lightning_is_absent(tmp_path):
    pytest.importorskip("pytorch_lightning")
    script = WORKER.parent / "lightning_standalone_pl.py"
    proc = Process([sys.executable, str(script), unique_run_id("lightning_pl")], tmp_path / "pl.log")
    try:
        code = proc.wait(90)
    finally:
        proc.kill_tree()
    log = (tmp_path / "pl.log").read_text(errors="replace")
    assert code == 0, log[-5000:]
    res = json.loads(next(line for line in log.splitlines() if line.startswith("{")))
    assert res["strategy_base"] == "pytorch_lightning.strategies.ddp.DDPStrategy"
    assert not res["lightning_loaded"]
    assert res["local_epoch"] == 2
    assert res["samples_reported"] == res["samples_fed"] > 0
