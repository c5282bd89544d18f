"""A plain Accelerate training script made collaborative, run by the Accelerate swarm tests.

Usage: ``accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no
tests/accelerate_worker.py config.json`` (CPU: ``Accelerator(cpu=True)``, gloo). Each rank writes
``<out>.rank<R>.json`` and ``<out>.rank<R>.pt`` (final parameters).

Config keys: run_id, target_batch_size, epochs, ga (gradient accumulation steps), gamma (ExponentialLR),
mixed_precision ("no" | "bf16"), emulate_fp16 (a torch GradScaler with fp32 math: CPU has no fp16 scaler in
Accelerate), clip, reuse (reuse_grad_buffers), save_at (save_state when this epoch is reached, then exit),
load_from (load_state before training), stop_after_epoch, outer (DiLoCo: SGD arguments of outer_optimizer),
save_epoch_params (``<out>.rank<R>.epochs.pt``: the parameters right after each epoch change).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.tracking import GeneralTracker
from collabopt.integrations.accelerate import CollaborativeAccelerator
from peer_worker import at_finish_line, make_data, make_model, progress_of, rank0_decides, write_json


class MemoryTracker(GeneralTracker):
    """Keeps what accelerator.log() sends (the test checks the swarm metrics arrive)."""

    name = "memory"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict] = []

    @property
    def tracker(self):
        return self.logged

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.logged.append(dict(values))


class EmulatedFp16Accelerator(CollaborativeAccelerator):
    """fp16 loss scaling on CPU: Accelerate's own fp16 path needs a GPU, so install the scaler by hand."""

    @property
    def mixed_precision(self) -> str:
        return "fp16"


def exact_epoch_boundaries() -> None:
    """Test scaffolding for comparing two solo runs: the tracker also ends an epoch when its throughput estimate
    says the target is reached (timing-dependent); keep only the sample count so boundaries are reproducible."""
    from collabopt.engine.progress import SwarmProgressTracker

    SwarmProgressTracker.ready_to_update_epoch = property(
        lambda self: self.global_epoch > self.local_progress.epoch
        or self.global_progress.samples_accumulated >= self.target_batch_size
    )


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    if cfg.get("exact_epochs"):
        exact_epoch_boundaries()
    tracker = MemoryTracker()
    accelerator_class = EmulatedFp16Accelerator if cfg.get("emulate_fp16") else CollaborativeAccelerator
    accelerator = accelerator_class(
        cpu=True, gradient_accumulation_steps=cfg.get("ga", 1), mixed_precision=cfg.get("mixed_precision", "no"),
        log_with=[tracker],
        run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        matchmaking_time=2.0, averaging_timeout=15.0, reuse_grad_buffers=cfg.get("reuse", False), verbose=True,
        **({"outer_optimizer": functools.partial(torch.optim.SGD, **cfg["outer"])} if cfg.get("outer") else {}),
    )
    if cfg.get("emulate_fp16"):
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    accelerator.init_trackers("collabopt_test")
    rank = accelerator.process_index
    out = f"{cfg['out']}.rank{rank}"

    x_all, y_all = make_data(cfg.get("data_seed", 0))
    model = make_model(cfg.get("model_seed", 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.5), momentum=cfg.get("momentum", 0.0))
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=cfg.get("gamma", 1.0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all),
                                         batch_size=cfg.get("batch_size", 8), shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if cfg.get("emulate_fp16"):
        accelerator.native_amp = True  # after prepare: only unscale_gradients() reads it (no fp16 autocast on CPU)
    copt = accelerator.collaborative_optimizer
    if accelerator.is_main_process:
        Path(out + ".ready").write_text("ready")
    if cfg.get("wait_peers"):  # start once the other peer is there (a node alone would race through the epochs)
        assert copt.wait_for_peers(cfg["wait_peers"], timeout=60), "the other peer did not show up"  # every rank
    if cfg.get("load_from"):
        accelerator.load_state(cfg["load_from"])

    result = {"rank": rank, "type": type(copt).__name__, "samples_fed": 0, "lrs": {}, "sched_lrs": {},
              "start_epoch": copt.local_epoch, "epochs_seen": [], "num_peers_seen": []}
    result["lrs"][str(copt.local_epoch)] = optimizer.param_groups[0]["lr"]
    result["sched_lrs"][str(copt.local_epoch)] = scheduler.get_last_lr()[0]
    result["momentum_buffer_start"] = _momentum_norm(copt)
    torch.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
               out + ".start.pt")
    fed_since_sync = 0
    progress = None  # what <out>.progress holds
    epoch_params = {}
    done = False
    while not done:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                fed_since_sync += len(x)
                if cfg.get("clip") and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), cfg["clip"])
                before = copt.local_epoch
                optimizer.step()
                scheduler.step()  # a no-op: collabopt steps the schedule once per global epoch
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            result["samples_fed"] += fed_since_sync
            result["max_num_peers"] = max(result.get("max_num_peers", 0), copt.num_peers)
            fed_since_sync = 0
            now = progress_of(copt)
            if now != progress and accelerator.is_main_process:
                write_json(cfg["out"] + ".progress", now)
            progress = now
            if copt.local_epoch != before:
                epoch = copt.local_epoch
                result["epochs_seen"].append(epoch)
                result["lrs"][str(epoch)] = optimizer.param_groups[0]["lr"]
                result["sched_lrs"][str(epoch)] = scheduler.get_last_lr()[0]
                result["num_peers_seen"].append(copt.num_peers)
                if cfg.get("save_epoch_params"):  # DiLoCo: the parameters right after each round
                    epoch_params[epoch] = {k: v.detach().clone()
                                           for k, v in accelerator.unwrap_model(model).state_dict().items()}
                accelerator.log({"loss": loss.item()}, step=epoch)
                if cfg.get("save_at") == epoch:
                    accelerator.save_state(cfg["save_dir"])
                    result["momentum_buffer_saved"] = _momentum_norm(copt)
                    result["saved_lr"] = optimizer.param_groups[0]["lr"]
                    done = True
                    break
            # every rank sees the same local_epoch; rank 0 reads the other peers' progress for all of them
            if copt.local_epoch >= cfg["epochs"] and rank0_decides(at_finish_line(cfg, copt.local_epoch,
                                                                                   cfg["epochs"], progress["in_sync"])):
                done = True
                break
            time.sleep(cfg.get("step_sleep", 0.03))
    result.update(final_epoch=copt.local_epoch, samples_reported=copt.samples_reported,
                  final_lr=optimizer.param_groups[0]["lr"], get_lr=copt.get_lr()[0],
                  logged=[{k: v for k, v in entry.items() if k.startswith("swarm/")} for entry in tracker.logged])
    torch.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, out + ".pt")
    if epoch_params:
        torch.save(epoch_params, out + ".epochs.pt")
    write_json(out + ".json", result)
    if cfg.get("save_at") and "momentum_buffer_saved" in result:
        time.sleep(600)  # the test kills this job after the checkpoint: resuming must not need a clean exit
    accelerator.end_training()


def _momentum_norm(copt) -> float | None:
    """Norm of SGD's momentum buffers of the optimizer hivemind steps (rank 0 holds them)."""
    state = copt.optimizer.state
    buffers = [s["momentum_buffer"] for s in state.values() if s.get("momentum_buffer") is not None]
    return float(sum(float(b.double().norm() ** 2) for b in buffers)) if buffers else None


if __name__ == "__main__":
    main(sys.argv[1])
