"""One node of a swarm: every rank of ``torchrun --nproc_per_node N`` runs this with the plain adapter.

Usage: ``torchrun --standalone --nproc_per_node 2 tests/node_torchrun_worker.py config.json``. Each rank writes
``<out>.rank<R>.json`` (what it fed and saw) and ``<out>.rank<R>.pt`` (final parameters).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from collabopt.integrations.pytorch import collaborate
from peer_worker import at_finish_line, make_data, make_model, progress_of, rank0_decides, write_json

from collabopt import ConfigurationError


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    # a short default-group timeout: waiting for rank 0 must not go through it (see collabopt.node)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.get("pg_timeout", 30)))
    rank = dist.get_rank()
    out = f"{cfg['out']}.rank{rank}"
    torch.manual_seed(100 + rank)
    x_all, y_all = make_data(cfg.get("data_seed", 0))
    model = torch.nn.parallel.DistributedDataParallel(make_model(cfg.get("model_seed", 0)))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.5))
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=cfg["gamma"]) if cfg.get("gamma") else None
    options = dict(cfg.get("options", {}))
    options.setdefault("host_maddrs", ["/ip4/127.0.0.1/tcp/0"])
    options.setdefault("verbose", True)  # hivemind logs each round: what a failure report needs
    options.setdefault("matchmaking_time", 2.0)
    options.setdefault("averaging_timeout", 15.0)
    result = {"rank": rank, "samples_fed": 0, "lrs": {}, "epochs_seen": [], "num_peers_seen": []}
    try:  # several processes, model not wrapped in DDP: refused before anything starts
        collaborate(model.module, optimizer, run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"])
    except ConfigurationError as e:
        result["refused_unwrapped_model"] = "DistributedDataParallel" in str(e)
    with collaborate(model, optimizer, run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"],
                     scheduler=scheduler, **options) as copt:
        result["type"] = type(copt).__name__
        if rank == 0:
            Path(out + ".ready").write_text("ready")
        if cfg.get("wait_peers"):  # start once the other peer is there (a node alone would race through the epochs)
            # collective, in collabopt's long-timeout group: the default group times out after pg_timeout seconds
            assert copt.wait_for_peers(cfg["wait_peers"], timeout=60), "no other peer"
        if rank == 0 and cfg.get("rank0_delay_s"):  # simulate slow matchmaking inside rank 0's swarm step
            inner = copt.collaborative_optimizer
            original_step, delayed = inner.step, [False]

            def slow_step(*args, **kwargs):
                if not delayed[0]:
                    delayed[0] = True
                    time.sleep(cfg["rank0_delay_s"])
                return original_step(*args, **kwargs)

            inner.step = slow_step
        result["lrs"][str(copt.local_epoch)] = optimizer.param_groups[0]["lr"]
        steps = 0
        progress = progress_of(copt)
        while (not rank0_decides(at_finish_line(cfg, copt.local_epoch, cfg["epochs"], progress["in_sync"]))
               and steps < cfg.get("max_steps", 2000)):
            n = cfg.get("batch_sizes", [8, 12])[(steps + rank) % len(cfg.get("batch_sizes", [8, 12]))]
            idx = torch.randint(0, len(x_all), (n,))
            F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            result["samples_fed"] += n
            before = copt.local_epoch
            copt.step()
            copt.zero_grad()
            steps += 1
            result["max_num_peers"] = max(result.get("max_num_peers", 0), copt.num_peers)
            now = progress_of(copt)
            if now != progress and rank == 0:
                write_json(cfg["out"] + ".progress", now)
            progress = now
            if copt.local_epoch != before:
                result["epochs_seen"].append(copt.local_epoch)
                result["lrs"][str(copt.local_epoch)] = optimizer.param_groups[0]["lr"]
                result["num_peers_seen"].append(copt.num_peers)
            if cfg.get("check_every_step"):  # are the ranks' parameters identical after this step?
                digest = torch.cat([p.detach().double().flatten() for p in model.parameters()])
                gathered = [torch.zeros_like(digest) for _ in range(dist.get_world_size())]
                dist.all_gather(gathered, digest)
                result["steps_out_of_sync"] = result.get("steps_out_of_sync", 0) + int(
                    any(not torch.equal(gathered[0], g) for g in gathered[1:]))
                changed = not torch.equal(digest, result.pop("_last", digest))
                result["_last"] = digest
                if changed and copt.local_epoch == before:
                    result["param_changes_without_epoch_change"] = result.get("param_changes_without_epoch_change",
                                                                              0) + 1
            time.sleep(cfg.get("step_sleep", 0.05))
        result["final_state"] = copt.serve_final_state()  # collective: flushes, rank 0 serves peers still behind
        result.pop("_last", None)
        result.update(final_epoch=copt.local_epoch, samples_reported=copt.samples_reported, steps=steps,
                      get_lr=copt.get_lr()[0], scheduler_lr=scheduler.get_last_lr()[0] if scheduler else None)
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, out + ".pt")
        if cfg.get("linger", 0):
            time.sleep(cfg["linger"])
    write_json(out + ".json", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
