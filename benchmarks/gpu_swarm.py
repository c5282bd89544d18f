"""One peer of the AMP swarms of ``gpu-check`` (issue 34), run as its own OS process: ``python -m benchmarks.gpu_swarm
config.json``.

The peer runs the cases of its config (of :data:`CASES`) one after the other, each a swarm of its own (``run_id``
per case) with the other peer processes, started from the ``INITIAL_PEERS`` of the environment. In each case it
trains a small classifier under autocast through one adapter, injects one overflow (its loss times inf) at local step
``overflow_step``, and trains on until it and every other peer reached ``epochs`` (the others' progress files).
It writes ``<out>.json`` (per case: losses, samples skipped, the loss scale around the overflow, whether its
parameters were finite after every round) and ``<out>.<case>.pt`` (its parameters right after each epoch change:
the driver compares the peers' at their last common epoch).

On CUDA the cases are what their names say. On CPU (the smoke version) fp16 autocast becomes bf16 autocast with the
same ``torch.amp.GradScaler`` (plain loop, DiLoCo), Lightning keeps ``16-mixed`` through its mixed-precision plugin
with a CPU scaler, and Accelerate runs ``bf16`` (its fp16 path needs a GPU; the overflow is then dropped by
collabopt's non-finite guard instead of the scaler). Each case's result says what ran.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

CASES = ["plain fp16", "plain bf16", "lightning 16-mixed", "diloco fp16", "accelerate fp16"]  # accelerate last:
# its AcceleratorState is one per process


def slug(case: str) -> str:
    return case.replace(" ", "_").replace("-", "_")


def write_json(path: str | Path, value: Any) -> None:
    Path(f"{path}.tmp").write_text(json.dumps(value))
    os.replace(f"{path}.tmp", path)


def make_data(device: str, n: int = 2048, dim: int = 32, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    y = (x @ torch.randn(dim, classes, generator=g)).argmax(dim=1)
    return x.to(device), y.to(device)


def make_model(device: str, dim: int = 32, classes: int = 4, hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)  # the same start on every peer
    model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))
    return model.to(device)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()  # forward calls in eval mode are not counted as samples
    loss = float(F.cross_entropy(model(x).float(), y))
    model.train(was_training)
    return loss


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


class Tracker:
    """Per case: the finish line shared through progress files, the parameters after each epoch change, and whether
    they were finite."""

    def __init__(self, cfg: dict[str, Any], case: str, model: torch.nn.Module):
        self.cfg, self.case, self.model = cfg, case, model
        self.dir, self.index = Path(cfg["dir"]), cfg["index"]
        self.epoch: int | None = None
        self.epochs: dict[int, dict[str, torch.Tensor]] = {}
        self.all_finite = True
        self.deadline = time.monotonic() + cfg["case_seconds"]
        self.steps = 0

    def progress_file(self, index: int) -> Path:
        return self.dir / f"{slug(self.case)}.{index}.progress"

    def after_step(self, copt: Any) -> bool:
        """Call after every optimizer step; True once this peer and all others reached the last epoch in sync."""
        self.steps += 1
        epoch = copt.local_epoch
        if epoch != self.epoch:
            self.epoch = epoch
            params = snapshot(self.model)
            self.epochs[epoch] = params
            self.all_finite &= all(bool(torch.isfinite(p).all()) for p in params.values())
        in_sync = not copt.out_of_sync
        write_json(self.progress_file(self.index), {"epoch": epoch, "in_sync": in_sync})
        if time.monotonic() > self.deadline:
            return True
        if epoch < self.cfg["epochs"] or not in_sync:
            return False
        for other in range(self.cfg["peers"]):
            try:
                progress = json.loads(self.progress_file(other).read_text())
            except (OSError, ValueError):
                return False
            if progress["epoch"] < self.cfg["epochs"] or not progress["in_sync"]:
                return False
        return True

    def overflow_now(self) -> bool:
        return self.steps == self.cfg["overflow_step"]


def autocast_dtype(amp: str, cuda: bool) -> torch.dtype:
    return torch.float16 if amp == "fp16" and cuda else torch.bfloat16


def swarm_options(cfg: dict[str, Any], case: str) -> dict[str, Any]:
    return dict(run_id=f"{cfg['run_prefix']}_{slug(case)}", target_batch_size=cfg["target_batch_size"],
                host_maddrs=["/ip4/127.0.0.1/tcp/0"], matchmaking_time=cfg["matchmaking_time"],
                averaging_timeout=cfg["averaging_timeout"], verbose=True)


def outer_sgd() -> Callable[..., torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def plain_case(cfg: dict[str, Any], case: str, device: str) -> dict[str, Any]:
    """The plain loop (``collaborate``), fp16 or bf16 autocast, with a GradScaler for fp16; DiLoCo if named."""
    from collabopt.integrations.pytorch import collaborate

    cuda = device == "cuda"
    amp = "bf16" if "bf16" in case else "fp16"
    dtype = autocast_dtype(amp, cuda)
    x_all, y_all = make_data(device)
    model = make_model(device)
    start_loss = eval_loss(model, x_all, y_all)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10) if amp == "fp16" else None
    extra = {"outer_optimizer": outer_sgd()} if case.startswith("diloco") else {}
    g = torch.Generator().manual_seed(100 + cfg["index"])
    tracker = Tracker(cfg, case, model)
    result: dict[str, Any] = {"autocast": str(dtype).replace("torch.", ""), "scaler": scaler is not None}
    with collaborate(model, opt, scaler=scaler, **swarm_options(cfg, case), **extra) as copt:
        assert copt.wait_for_peers(cfg["peers"], timeout=60), "the other peers did not come"
        done = False
        while not done:
            idx = torch.randint(0, len(x_all), (cfg["batch"],), generator=g).to(device)
            with torch.autocast(device, dtype=dtype):
                loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
            if tracker.steps + 1 == cfg["overflow_step"]:
                loss = loss * float("inf")
                result["scale_before"] = scaler.get_scale() if scaler is not None else None
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(copt)
                scaler.update()
            else:
                loss.backward()
                copt.step()
            copt.zero_grad()
            if tracker.steps + 1 == cfg["overflow_step"]:
                result["scale_after"] = scaler.get_scale() if scaler is not None else None
            done = tracker.after_step(copt)
            time.sleep(cfg["step_sleep"])
        copt.flush()
        result.update(samples_skipped=copt.samples_skipped, nonfinite_steps=copt.nonfinite_steps,
                      samples_reported=copt.samples_reported, num_peers=copt.num_peers)
    return finish(result, tracker, start_loss, eval_loss(model, x_all, y_all))


def lightning_case(cfg: dict[str, Any], case: str, device: str) -> dict[str, Any]:
    """A Lightning Trainer with ``CollaborativeStrategy`` and ``precision="16-mixed"``."""
    import lightning.pytorch as pl
    from collabopt.integrations.lightning import CollaborativeStrategy
    from torch.utils.data import DataLoader, TensorDataset

    x_all, y_all = make_data(device)
    strategy = CollaborativeStrategy(**swarm_options(cfg, case))
    result: dict[str, Any] = {}

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model("cpu")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            if tracker.steps + 1 == cfg["overflow_step"]:
                result["scale_before"] = scaler_scale(self.trainer)
                loss = loss * float("inf")
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=cfg["lr"])

    class Finish(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if tracker.steps == 0 and tracker.epoch is None:
                assert strategy.collaborative_optimizer.wait_for_peers(cfg["peers"], timeout=60), "no other peers"

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if tracker.steps + 1 == cfg["overflow_step"]:
                result["scale_after"] = scaler_scale(trainer)
            trainer.should_stop = tracker.after_step(strategy.collaborative_optimizer)
            time.sleep(cfg["step_sleep"])

    module = Net()
    tracker = Tracker(cfg, case, module.net)
    start_loss = eval_loss(module.net.to(device), x_all, y_all)
    if device == "cuda":
        precision: dict[str, Any] = {"accelerator": "gpu", "precision": "16-mixed"}
    else:  # the 16-mixed code path (GradScaler) on a CPU: Lightning's own plugin with a CPU scaler
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        precision = {"accelerator": "cpu",
                     "plugins": [pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    g = torch.Generator().manual_seed(100 + cfg["index"])
    loader = DataLoader(TensorDataset(x_all.cpu(), y_all.cpu()), batch_size=cfg["batch"], shuffle=True, generator=g)
    trainer = pl.Trainer(strategy=strategy, devices=1, max_epochs=10_000, callbacks=[Finish()], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         **precision)
    trainer.fit(module, loader)
    copt = strategy.collaborative_optimizer
    result.update(autocast="float16", scaler=True, samples_skipped=copt.samples_skipped,
                  nonfinite_steps=copt.nonfinite_steps, samples_reported=copt.samples_reported,
                  num_peers=copt.num_peers)
    return finish(result, tracker, start_loss, eval_loss(module.net.to(device), x_all, y_all))


def scaler_scale(trainer: Any) -> float | None:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler.get_scale() if scaler is not None else None


def accelerate_case(cfg: dict[str, Any], case: str, device: str) -> dict[str, Any]:
    """``CollaborativeAccelerator(mixed_precision="fp16")`` (bf16 on CPU)."""
    from collabopt.integrations.accelerate import CollaborativeAccelerator
    from torch.utils.data import DataLoader, TensorDataset

    cuda = device == "cuda"
    accelerator = CollaborativeAccelerator(cpu=not cuda, mixed_precision="fp16" if cuda else "bf16",
                                           **swarm_options(cfg, case))
    x_all, y_all = make_data(device)
    model = make_model(device)
    start_loss = eval_loss(model, x_all, y_all)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    g = torch.Generator().manual_seed(100 + cfg["index"])
    loader = DataLoader(TensorDataset(x_all.cpu(), y_all.cpu()), batch_size=cfg["batch"], shuffle=True, generator=g)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    copt = accelerator.collaborative_optimizer
    tracker = Tracker(cfg, case, accelerator.unwrap_model(model))
    scaler = accelerator.scaler
    result: dict[str, Any] = {"autocast": "float16" if cuda else "bfloat16", "scaler": scaler is not None}
    assert copt.wait_for_peers(cfg["peers"], timeout=60), "the other peers did not come"
    done = False
    while not done:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            if tracker.steps + 1 == cfg["overflow_step"]:
                result["scale_before"] = scaler.get_scale() if scaler is not None else None
                loss = loss * float("inf")
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            if tracker.steps + 1 == cfg["overflow_step"]:
                result["scale_after"] = scaler.get_scale() if scaler is not None else None
            done = tracker.after_step(copt)
            time.sleep(cfg["step_sleep"])
            if done:
                break
    copt.flush()
    result.update(samples_skipped=copt.samples_skipped, nonfinite_steps=copt.nonfinite_steps,
                  samples_reported=copt.samples_reported, num_peers=copt.num_peers)
    final_loss = eval_loss(accelerator.unwrap_model(model), x_all, y_all)
    accelerator.end_training()
    copt.close()
    return finish(result, tracker, start_loss, final_loss)


def finish(result: dict[str, Any], tracker: Tracker, start_loss: float, final_loss: float) -> dict[str, Any]:
    final = snapshot(tracker.model)
    torch.save(tracker.epochs, Path(tracker.cfg["dir"]) / f"{slug(tracker.case)}.{tracker.index}.pt")
    result.update(start_loss=start_loss, final_loss=final_loss, local_steps=tracker.steps,
                  final_epoch=tracker.epoch, timed_out=time.monotonic() > tracker.deadline,
                  finite_after_every_round=tracker.all_finite,
                  finite_at_end=all(bool(torch.isfinite(p).all()) for p in final.values()))
    return result


RUNNERS = {"plain": plain_case, "diloco": plain_case, "lightning": lightning_case, "accelerate": accelerate_case}


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    device = "cuda" if cfg.get("cuda") else "cpu"
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    out = Path(cfg["dir"]) / f"{cfg.get('out', 'peer' + str(cfg['index']))}.json"
    for case in cfg["cases"]:
        started = time.monotonic()
        try:
            results[case] = RUNNERS[case.split()[0]](cfg, case, device)
        except Exception as error:  # noqa: BLE001 - one case failing must not hide the others' results
            import traceback

            traceback.print_exc()
            results[case] = {"error": f"{type(error).__name__}: {error}"}
        results[case]["seconds"] = round(time.monotonic() - started, 1)
        print(f"peer {cfg['index']}: {case} done in {results[case]['seconds']} s", flush=True)
        write_json(out, results)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip hivemind's noisy interpreter-exit finalizers; every optimizer was closed above
