"""One training peer, run as its own OS process by the swarm tests.

Usage: ``python tests/peer_worker.py config.json``. The config (written by ``tests/swarm.py``) says what to train
and how; the peer writes ``<out>.json`` (metrics), ``<out>.pt`` (final parameters) and ``<out>.progress`` (its
epoch, updated as it trains).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from schedulers import make_scheduler

from collabopt import CollaborativeOptimizer


def make_data(seed: int = 0, n: int = 4096, dim: int = 16, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    return x, (x @ w).argmax(dim=1)


def make_model(seed: int, dim: int = 16, classes: int = 4, hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


@torch.no_grad()
def full_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(F.cross_entropy(model(x), y))


def batch_size_sequence(spec, rng: random.Random):
    """``[8, 16]`` cycles; ``{"random": [lo, hi]}`` draws uniformly."""
    i = 0
    while True:
        if isinstance(spec, dict):
            yield rng.randint(*spec["random"])
        else:
            yield spec[i % len(spec)]
        i += 1


def write_json(path: str, value) -> None:
    Path(path + ".tmp").write_text(json.dumps(value))
    os.replace(path + ".tmp", path)


def exit_now() -> None:
    """End this worker once its results are written and its swarm left: atexit handlers and stdio flushed, then
    ``os._exit(0)``. It skips the interpreter's teardown (finalizers, which Python does not promise at exit), which
    writes to every object a forked worker inherited from the launcher (docs/decisions.md, "Exit")."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def progress_of(copt) -> dict:
    """What a worker writes to its ``<out>.progress`` file for the others' finish line (see :func:`at_finish_line`)."""
    return {"epoch": copt.local_epoch, "in_sync": not copt.out_of_sync}


def at_finish_line(cfg: dict, epoch: int, target: int, in_sync: bool = True) -> bool:
    """Whether this peer (at ``epoch``) and every peer named in ``cfg["finish_with"]`` reached ``target``, none of
    them out of sync (``CollaborativeOptimizer.out_of_sync``).

    Peers that got there keep training until all did. hivemind matches averaging rounds by time, not by epoch: a
    peer that missed the start of one round joins the next one and from then on counts every round one epoch
    later than the others. Stopping at a fixed epoch, the others would be gone when it takes its last step, which
    it would take alone (with its own gradients). And a peer whose last round was partial re-synchronizes at its
    next round, which needs the others. Each peer's epoch is read from its ``<out>.progress`` file.
    """
    if epoch < target or not in_sync:
        return False
    # the first time here at an epoch, wait a moment for peers that reached it in the same round (they write their
    # progress milliseconds later): in short epochs this peer's next step would otherwise start a round they have
    # left, and wait for it until averaging_timeout (seen: 15 s of the Trainer's DiLoCo test)
    deadline = time.monotonic() + (0.0 if epoch in _settled else FINISH_SETTLE)
    _settled.add(epoch)
    while not all(_reached(prefix, target) for prefix in cfg.get("finish_with", [])):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


FINISH_SETTLE = 1.0  # seconds
_settled: set[int] = set()  # epochs at which this peer already waited


def wait_to_start(cfg: dict, deadline: float) -> None:
    """A late joiner (``start_after``: a ``progress_file`` and an ``epoch``): its process starts with the others and
    waits here, its imports done, until that progress file shows the epoch; only then does it join the swarm. (The
    Lightning late joiner's test took 3.5 s less: its imports beyond the launcher's, Lightning's, no longer lie
    between that epoch and its join)"""
    if not cfg.get("start_after"):
        return
    trigger, min_epoch = Path(cfg["start_after"]["progress_file"]), cfg["start_after"]["epoch"]
    while time.monotonic() < deadline:
        try:
            if json.loads(trigger.read_text())["epoch"] >= min_epoch:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)


def _reached(prefix: str, target: int) -> bool:
    try:
        progress = json.loads(Path(prefix + ".progress").read_text())
        return progress["epoch"] >= target and progress.get("in_sync", True)
    except (OSError, ValueError, KeyError):
        return False


def stall_reducer(seconds: float) -> Callable[[], None]:
    """Fault injection: once armed (call the function returned), in the next gradient round in which others send this
    peer parts to reduce, its reducer answers them ``seconds`` late, past their reducer timeout: they keep their own
    values for its slice (a partial round: their evidence's ``received`` is below 1), while this peer's own round is
    whole. Patched on collabopt's all-reduce handlers (its gradient rounds run in this process)."""
    import asyncio
    import functools

    from hivemind.utils.asyncio import achain, anext, as_aiter

    from collabopt.engine.allreduce import AllReduceService

    original = AllReduceService.rpc_aggregate_part
    armed: list[bool] = []
    stalled: list[bytes] = []

    @functools.wraps(original)
    async def rpc_aggregate_part(self, stream, context):
        request = await anext(stream)
        if armed and not stalled:
            stalled.append(request.group_id)
        if request.group_id in stalled:
            print(f"stalling the reducer of a gradient round for {seconds} s", flush=True)
            await asyncio.sleep(seconds)
        async for message in original(self, achain(as_aiter(request), stream), context):
            yield message

    AllReduceService.rpc_aggregate_part = rpc_aggregate_part
    return lambda: armed.append(True)


@torch.no_grad()
def attack(spec: dict, model: torch.nn.Module, samples: int) -> dict:
    """A hostile peer's step: its gradients times ``spec["scale"]``, plus Gaussian noise of ``spec["noise"]`` times
    the gradient's norm; with ``spec["claim"]`` the keyword arguments of ``step()`` claiming that many times its
    real samples (its config needs ``count="claimed"``)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
    size = sum(g.numel() for g in grads)
    for grad in grads:
        noise = torch.randn_like(grad) * (spec.get("noise", 0.0) * norm / size ** 0.5)
        grad.mul_(spec.get("scale", 1.0)).add_(noise)
    return dict(batch_size=samples * spec["claim"]) if spec.get("claim") else {}


def corrupt_reducer(scale: float) -> None:
    """Fault injection: every part this peer reduces with ``aggregation="centered_clip"`` (gradients and parameters)
    is sent back times ``scale`` (patched before the averager processes are forked)."""
    from collabopt.engine import clipping

    honest = clipping.ClippedPart.div_
    clipping.ClippedPart.div_ = lambda self, denominator: honest(self, denominator) * scale


def serve_altered(constant: float | str) -> None:
    """Fault injection: this peer serves its parameters plus ``constant`` (``"permuted"``: each tensor's values in
    reverse order, whose fingerprint is the honest one) to those that download its state, never declines one, and asks
    to be their first source (its priority raised by 1e6); it trains, and votes (``aggregation="centered_clip"``),
    with its real parameters, so its vote claims the honest peers' fingerprint (tests/swarm/test_download_votes.py)."""
    from collabopt.engine.state import ConsistentStateAverager

    priority = ConsistentStateAverager.state_sharing_priority

    def served_state(self):
        # it answers every download at once, also while it ends an epoch (an honest peer declines then), with the
        # parameters its vote names: it waits only for a parameter round to be applied
        self._no_boundary.wait(30.0)
        metadata, tensors, infos = self.state_copy()
        count = sum(len(group["params"]) for group in self.optimizer.param_groups)
        if constant == "permuted":  # the honest values, each tensor's in another order: the same three sums
            return metadata, [t.reshape(-1).flip(0).reshape(t.shape) if i < count else t
                              for i, t in enumerate(tensors)], infos
        return metadata, [t + constant if i < count else t for i, t in enumerate(tensors)], infos

    ConsistentStateAverager.served_state = served_state
    ConsistentStateAverager.state_sharing_priority = property(
        priority.fget, lambda self, value: priority.fset(self, value + 1e6))


def target_epoch(cfg: dict, epochs: int) -> int:
    """``epochs``, or the number in ``cfg["epochs_file"]`` if set (a driver writes it when the run may end; no such
    file yet: train on)."""
    if not cfg.get("epochs_file"):
        return epochs
    try:
        return int(Path(cfg["epochs_file"]).read_text())
    except (OSError, ValueError):
        return 1 << 30


def rank0_decides(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank of a node (the ranks must stop at the same step); ``flag`` without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    box = torch.tensor([int(flag)])
    dist.broadcast(box, src=0)
    return bool(box.item())


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    if os.environ.get("COLLABOPT_TEST_DEBUG"):  # (set for a diagnosis: the rounds' matchmaking and groups, in the log)
        for name in ("collabopt.engine", "hivemind.averaging.matchmaking"):
            logging.getLogger(name).setLevel(logging.DEBUG)
    out = cfg["out"]
    seed = cfg.get("seed", 0)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    x_all, y_all = make_data(cfg.get("data_seed", 0))
    held_out = cfg.get("held_out", 0)  # the last samples of the data: never trained on, the final loss's too
    model = make_model(cfg.get("model_seed", seed), hidden=cfg.get("hidden", 32))
    lr = cfg.get("lr", 0.05)
    opt_name = cfg.get("optimizer", "SGD")
    if opt_name == "SGD":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.get("momentum", 0.0))
    else:
        optimizer = getattr(torch.optim, opt_name)(model.parameters(), lr=lr)
    scheduler = make_scheduler(cfg["scheduler"], optimizer) if cfg.get("scheduler") else None
    scaler = torch.amp.GradScaler("cpu", init_scale=cfg["amp_scale"]) if cfg.get("amp_scale") else None
    options = dict(cfg.get("options", {}))
    options.setdefault("host_maddrs", ["/ip4/127.0.0.1/tcp/0"])
    options.setdefault("verbose", True)  # hivemind logs each round: what a failure report needs
    options.setdefault("matchmaking_time", 2.0)
    options.setdefault("averaging_timeout", 30.0)
    if cfg.get("grad_compression"):  # the gradient rounds' compression, by name ("fp16", "8bit")
        from hivemind.compression import Float16Compression, Uniform8BitQuantization

        options["grad_compression"] = {"fp16": Float16Compression, "8bit": Uniform8BitQuantization}[
            cfg["grad_compression"]]()
    if cfg.get("state_compression") == "parameters_fp16":  # parameter rounds: parameters in fp16, the rest whole
        from hivemind.compression import Float16Compression, NoCompression, RoleAdaptiveCompression

        options["state_averaging_compression"] = RoleAdaptiveCompression(parameter=Float16Compression(),
                                                                         default=NoCompression())
    if cfg.get("powersgd_rank"):  # PowerSGD as users write it (collabopt runs its own PowerSGD round for it)
        from functools import partial

        from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

        options["grad_averager_factory"] = partial(PowerSGDGradientAverager, averager_rank=cfg["powersgd_rank"])
    count_mode = cfg.get("count", "forward")  # forward | batch | batch_size
    accumulate = cfg.get("accumulate", 1)
    epochs = cfg["epochs"]
    progress_file = cfg.get("progress_file", out + ".progress")
    step_sleep = cfg.get("step_sleep", 0.02)
    deadline = time.monotonic() + cfg.get("max_seconds", 120)
    plateau_metric = cfg.get("plateau_metric")

    wait_to_start(cfg, deadline)

    arm_stall = stall_reducer(cfg["stall_reducer"]["seconds"]) if cfg.get("stall_reducer") else None
    if cfg.get("attack", {}).get("reducer_scale"):  # a hostile reducer: what it sends back, times this
        corrupt_reducer(cfg["attack"]["reducer_scale"])
    if cfg.get("serve_altered"):  # a hostile server: what it sends joiners, plus this
        serve_altered(cfg["serve_altered"])
    # samples_dropped: fed in steps that contributed nothing and skipped nothing (hivemind dropped the step to
    # download the swarm's state first)
    result = {"samples_fed": 0, "samples_dropped": 0, "lrs": {}, "losses": [], "epochs_seen": [], "epoch_times": [],
              "rounds": [],  # each round's outcome (copt.last_round)
              "downloaded_epochs": [],  # epochs reached by a state download
              "max_step_wait": [0.0, 0.0]}  # the longest copt.step() in seconds, and when it ended (time.time())
    sizes = batch_size_sequence(cfg.get("batch_sizes", [16]), rng)
    with CollaborativeOptimizer(
        optimizer,
        run_id=cfg["run_id"],
        target_batch_size=cfg["target_batch_size"],
        scheduler=scheduler,
        model=model if count_mode == "forward" else None,
        scaler=scaler,
        **options,
    ) as copt:
        if cfg.get("wait_peers"):  # start together: a peer alone races through epochs the others then download
            assert copt.wait_for_peers(cfg["wait_peers"], timeout=90), "the other peers did not come"
        result["start_epoch"] = copt.local_epoch
        result["start_loss"] = full_loss(model, x_all, y_all)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out + ".start.pt")
        write_json(out + ".started", {"epoch": copt.local_epoch})  # for drivers that may kill it before the end
        result["lrs"][str(copt.local_epoch)] = copt.get_lr()[0]
        epoch_params = {}
        progress = {"epoch": copt.local_epoch, "in_sync": True}
        write_json(progress_file, progress)  # (a joiner that starts at the last epoch takes no step that writes it)
        while (not at_finish_line(cfg, copt.local_epoch, target_epoch(cfg, epochs), progress["in_sync"])
               and time.monotonic() < deadline):
            step_samples = 0
            for _ in range(accumulate):
                n = next(sizes)
                idx = torch.randint(0, len(x_all) - held_out, (n,))
                x, y = x_all[idx], y_all[idx]
                if cfg.get("attack", {}).get("wrong_labels"):  # a hostile peer's data: every label shifted by one
                    y = (y + 1) % 4
                loss = F.cross_entropy(model(x), y)
                if cfg.get("nan_every") and (len(result["losses"]) + 1) % cfg["nan_every"] == 0:
                    loss = loss * float("nan" if len(result["losses"]) % 2 else "inf")  # a bad batch
                (scaler.scale(loss) if scaler is not None else loss).backward()
                step_samples += n
                result["losses"].append(loss.item())
            result["samples_fed"] += step_samples
            if cfg.get("attack"):  # a hostile peer (tests/swarm/test_robustness.py)
                kwargs_attack = attack(cfg["attack"], model, step_samples)
            if plateau_metric is not None:
                scheduler.step(plateau_metric)
            kwargs = kwargs_attack if cfg.get("attack") else {}
            if count_mode == "batch":
                kwargs["batch"] = (x, y) if accumulate == 1 else None
            elif count_mode == "batch_size":
                kwargs["batch_size"] = step_samples
            before, downloaded = copt.local_epoch, False
            if scaler is not None:
                if cfg.get("unscale_first"):
                    scaler.unscale_(copt)
                scaler.step(copt, **kwargs)
                scaler.update()
            else:
                started = time.monotonic()
                outcome = copt.step(**kwargs)
                wait = time.monotonic() - started  # the longest step: what a fault makes this peer wait
                if wait > result["max_step_wait"][0]:
                    result["max_step_wait"] = [wait, time.time()]
                if outcome.samples == 0 and outcome.skipped == 0:
                    result["samples_dropped"] += step_samples
                    downloaded = True  # (hivemind dropped the step to download the swarm's state first)
            copt.zero_grad()
            last_round = copt.last_round
            if last_round is not None and (not result["rounds"] or result["rounds"][-1]["at"] != id(last_round)):
                result["rounds"].append(dict(at=id(last_round), epoch=last_round.epoch, applied=last_round.applied,
                                             reason=last_round.reason, resync=last_round.resync,
                                             group_size=last_round.group_size))
            if copt.local_epoch != before:
                if downloaded or (last_round is not None and last_round.reason == "behind"
                                  and last_round.epoch == before):
                    result["downloaded_epochs"].append(copt.local_epoch)  # reached by a download, not a round
                result["epochs_seen"].append(copt.local_epoch)
                result["epoch_times"].append(time.time())
                result["max_peers_seen"] = max(result.get("max_peers_seen", 0), copt.num_peers)
                result["lrs"][str(copt.local_epoch)] = copt.get_lr()[0]
                if cfg.get("save_epoch_params"):
                    epoch_params[copt.local_epoch] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if arm_stall is not None and copt.local_epoch >= cfg["stall_reducer"]["from_epoch"]:
                arm_stall()
            now = progress_of(copt)
            if progress != now:
                progress = now
                write_json(progress_file, progress)
            time.sleep(step_sleep)
        copt.flush()
        result.update(
            final_epoch=copt.local_epoch,
            final_loss=full_loss(model, x_all, y_all),
            held_out_loss=full_loss(model, x_all[len(x_all) - held_out:], y_all[len(x_all) - held_out:])
            if held_out else None,
            samples_reported=copt.samples_reported,
            samples_skipped=copt.samples_skipped,
            nonfinite_steps=copt.nonfinite_steps,
            final_lr=copt.get_lr()[0],
            num_peers=copt.num_peers,
            scheduler_lr=scheduler.get_last_lr()[0] if scheduler is not None else None,
        )
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out + ".pt")
        if epoch_params:
            torch.save(epoch_params, out + ".epochs.pt")
        if cfg.get("linger", 0):
            time.sleep(cfg["linger"])
    write_json(out + ".json", result)


if __name__ == "__main__":
    # like a script started from a terminal: a test run started in the background (``pytest &``) hands its children
    # SIGINT ignored, and the signal test would then wait for a Ctrl+C that cannot arrive
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to the log
    main(sys.argv[1])
    exit_now()
