"""One Lightning peer, run as its own OS process by the Lightning swarm tests.

Usage: ``python tests/lightning_worker.py config.json``. Trains a tiny classifier with ``Trainer(strategy=
CollaborativeStrategy(...))`` until the peer reaches ``global_epochs``; writes ``<out>.rank<r>.json`` (metrics),
``<out>.rank<r>.pt`` (final parameters) and ``<out>.progress`` (its epoch, as it trains). With ``save_ckpt`` it saves
a checkpoint when it reaches its last epoch (and the collaborative state at that moment); with ``resume_ckpt`` it
resumes from one and records the state it resumed with. With ``start_after`` it joins late (see
``peer_worker.wait_to_start``). With ``outer`` (SGD arguments) it trains in DiLoCo mode;
``save_epoch_params`` writes ``<out>.rank<r>.epochs.pt``: the parameters right after each epoch change.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from collabopt.integrations.lightning import CollaborativeStrategy
from peer_worker import at_finish_line, progress_of, wait_to_start
from torch.utils.data import DataLoader, TensorDataset


def write_json(path: str, value) -> None:
    Path(path + ".tmp").write_text(json.dumps(value))
    os.replace(path + ".tmp", path)


def make_data(n: int, seed: int = 0, dim: int = 16, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    return x, (x @ w).argmax(dim=1)


def make_scheduler(name: str, optimizer: torch.optim.Optimizer):
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    if name == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1 + epoch))
    if name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    raise ValueError(name)


class Net(pl.LightningModule):
    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        torch.manual_seed(cfg.get("model_seed", 0))
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.samples_fed = 0
        self.batches_skipped = 0
        self.seen = {"epoch": -1, "peers": 0, "wrapped_epoch": -1, "wrapped_closed": False}

    def training_step(self, batch, batch_idx):
        x, y = batch
        # as a module written for lightning-hivemind does: the swarm's state read from the optimizer itself
        optimizer = self.trainer.optimizers[0]
        self.seen["epoch"] = max(self.seen["epoch"], optimizer.local_epoch)
        self.seen["peers"] = max(self.seen["peers"], optimizer.num_peers)
        self.seen["wrapped_epoch"] = max(self.seen["wrapped_epoch"], self.optimizers().local_epoch)
        self.seen["wrapped_closed"] |= self.optimizers().closed  # Lightning's wrapper shows the optimizer's state
        if self.cfg.get("scheduler") == "plateau":
            self.log("plateau_metric", 1.0)  # a plateau: the LR is cut at every global epoch after the first
        if self.cfg.get("skip_every") and batch_idx % self.cfg["skip_every"] == 0:
            self.batches_skipped += 1
            return None  # Lightning skips this batch: it must not count as samples
        loss = F.cross_entropy(self.net(x), y)
        self.samples_fed += len(x)
        time.sleep(self.cfg.get("step_sleep", 0.03))
        return loss

    def configure_optimizers(self):
        lr = self.cfg.get("lr", 0.1)
        if self.cfg.get("optimizer", "SGD") == "SGD":
            opt = torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)
        else:
            opt = getattr(torch.optim, self.cfg["optimizer"])(self.parameters(), lr=lr)
        if self.cfg.get("scheduler"):
            scheduler = make_scheduler(self.cfg["scheduler"], opt)
            config = {"scheduler": scheduler, "interval": "step"}
            if self.cfg["scheduler"] == "plateau":
                config["monitor"] = "plateau_metric"
            return {"optimizer": opt, "lr_scheduler": config}
        return opt

    def train_dataloader(self):
        x, y = make_data(self.cfg.get("n_samples", 2048), self.cfg.get("data_seed", 0))
        sizes = self.cfg.get("batch_size", 16)
        return DataLoader(TensorDataset(x, y), batch_size=sizes, shuffle=True,
                          generator=torch.Generator().manual_seed(self.cfg.get("seed", 0)))


class NetWithZeroGrad(Net):
    """A module that overrides ``optimizer_zero_grad`` (disabled by ``reuse_grad_buffers=True``)."""

    zero_grad_calls = 0

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.zero_grad_calls += 1
        optimizer.zero_grad()


def copy_state(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: copy_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_state(v) for v in obj)
    return obj


class Recorder(pl.Callback):
    """Stops at ``global_epochs``, records LRs per epoch, swarm metrics, and the state a resumed run starts with."""

    def __init__(self, cfg: dict, strategy: CollaborativeStrategy, out: str):
        self.cfg, self.strategy, self.out = cfg, strategy, out
        self.result: dict = {"lrs": {}, "max_peers_logged": 0, "progress_bar_keys": [], "logged_keys": []}
        self.deadline = time.monotonic() + cfg.get("max_seconds", 90)
        self.last_epoch = None
        self.progress: dict | None = None  # what <out>.progress holds
        self.epoch_params: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        copt = self.strategy.collaborative_optimizer
        if "start_epoch" not in self.result:
            if trainer.is_global_zero:
                Path(self.out + ".ready").write_text("1")  # joined the swarm (and caught up with it)
            if self.cfg.get("barrier"):  # start training together (epochs are short); collective on a node
                assert copt.wait_for_peers(len(self.cfg["barrier"]), timeout=60), "the other peers did not come"
            self.result["start_epoch"] = copt.local_epoch
            self.result["start_lightning_epoch"] = trainer.current_epoch
            self.result["start_lr"] = copt.get_lr()[0]
            self.last_epoch = copt.local_epoch
            if trainer.is_global_zero:
                torch.save(copy_state(copt.state_dict()), self.out + ".start_state.pt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        copt = self.strategy.collaborative_optimizer
        epoch = copt.local_epoch
        peers = trainer.progress_bar_metrics.get("swarm/num_peers")
        if peers is not None:
            self.result["max_peers_logged"] = max(self.result["max_peers_logged"], int(peers))
            self.result["progress_bar_keys"] = sorted(trainer.progress_bar_metrics)
            self.result["logged_keys"] = sorted(trainer.logged_metrics)
        if epoch != self.last_epoch:
            self.last_epoch = epoch
            self.result["lrs"][str(epoch)] = copt.get_lr()[0]
            if self.cfg.get("save_epoch_params"):  # DiLoCo: the parameters right after each round
                self.epoch_params[epoch] = copy_state(pl_module.state_dict())
        progress = progress_of(copt)
        if progress != self.progress and trainer.is_global_zero:
            write_json(self.out + ".progress", progress)
        self.progress = progress
        pause = self.cfg.get("pause_at")
        if pause and epoch >= pause["epoch"] and not self.result.get("paused"):
            # wait for a late joiner: it then downloads the state of this epoch, whatever the machine's load
            self.result["paused"] = True
            deadline = time.monotonic() + 90
            while not Path(pause["until"] + ".ready").exists():
                assert time.monotonic() < deadline, "the late joiner did not come"
                time.sleep(0.1)
        done = epoch >= self.cfg["global_epochs"]
        if done and self.cfg.get("save_ckpt") and "saved_epoch" not in self.result:
            trainer.save_checkpoint(self.cfg["save_ckpt"])
            self.result["saved_epoch"] = epoch
            self.result["saved_lightning_epoch"] = trainer.current_epoch
            if trainer.is_global_zero:
                torch.save(copy_state(copt.state_dict()), self.out + ".saved_state.pt")
        # rank 0 reads the other peers' progress (the finish line) and decides for every rank of this node; stop
        # only where an optimizer step was just taken (accumulate_grad_batches), or fed samples would not be counted
        boundary = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        finished = done and boundary and trainer.strategy.broadcast(
            at_finish_line(self.cfg, epoch, self.cfg["global_epochs"], progress["in_sync"]))
        if finished or time.monotonic() > self.deadline:
            trainer.should_stop = True


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    wait_to_start(cfg, time.monotonic() + cfg.get("max_seconds", 90))  # a late joiner (start_after)
    out = cfg["out"]
    pl.seed_everything(cfg.get("seed", 0), workers=False, verbose=False)
    options = dict(cfg.get("options", {}))
    options.setdefault("host_maddrs", ["/ip4/127.0.0.1/tcp/0"])
    options.setdefault("verbose", True)  # hivemind logs each round: what a failure report needs
    options.setdefault("matchmaking_time", 2.0)
    options.setdefault("averaging_timeout", 15.0)
    if cfg.get("outer"):  # DiLoCo mode
        options["outer_optimizer"] = functools.partial(torch.optim.SGD, **cfg["outer"])
    strategy = CollaborativeStrategy(target_batch_size=cfg["target_batch_size"], run_id=cfg["run_id"], **options)
    model = NetWithZeroGrad(cfg) if cfg.get("override_zero_grad") else Net(cfg)
    recorder = Recorder(cfg, strategy, out)
    precision: dict = {"precision": cfg.get("precision", "32-true")}
    if cfg.get("fp16_scaler_on_cpu"):  # the 16-mixed code path (GradScaler) on a CPU: Lightning's own plugin
        scaler = torch.amp.GradScaler("cpu", init_scale=cfg["fp16_scaler_on_cpu"])
        precision = {"plugins": [pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=cfg.get("devices", 1),
        **precision,
        accumulate_grad_batches=cfg.get("accumulate", 1),
        max_epochs=1000,
        callbacks=[recorder],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=pl.loggers.CSVLogger(str(Path(out).parent / "logs"), name=Path(out).name),
    )
    trainer.fit(model, ckpt_path=cfg.get("resume_ckpt"))
    copt = strategy.collaborative_optimizer
    rank = trainer.global_rank
    result = dict(
        recorder.result,
        final_epoch=copt.local_epoch,
        final_lr=copt.get_lr()[0],
        samples_fed=model.samples_fed,
        batches_skipped=model.batches_skipped,
        module_saw=model.seen,
        samples_reported=copt.samples_reported,
        samples_skipped=copt.samples_skipped,
        out_of_sync=copt.out_of_sync,
        lightning_epoch=trainer.current_epoch,
        world_size=trainer.world_size,
    )
    if cfg.get("scheduler"):
        result["scheduler_last_epoch"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
        result["scheduler_class"] = type(trainer.lr_scheduler_configs[0].scheduler).__name__
    if cfg.get("override_zero_grad"):
        result["zero_grad_calls_while_fitting"] = model.zero_grad_calls
        result["zero_grad_restored"] = "optimizer_zero_grad" not in model.__dict__
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}.rank{rank}.pt")
    if recorder.epoch_params:
        torch.save(recorder.epoch_params, f"{out}.rank{rank}.epochs.pt")
    write_json(f"{out}.rank{rank}.json", result)


if __name__ == "__main__":
    main(sys.argv[1])
