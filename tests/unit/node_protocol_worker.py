"""One rank of a 2-rank gloo job whose rank 0 core runs on a fake peer (see test_node_protocol.py)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
from fakes import backward, fake_core, model_and_optimizer

from collabopt import ConfigurationError, guard
from collabopt.node import NodeOptimizer

guard.CHECK_INTERVAL, guard.CHECK_COST_SHARE = 0.0, 1.0  # the accumulation is checked at every step here


def outcome(call) -> str:
    try:
        call()
    except ConfigurationError as e:
        return f"ConfigurationError: {e.parameter}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def run(rank: int, world_size: int, workdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size)
    model, opt = model_and_optimizer()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    node = NodeOptimizer(opt, model=ddp, scheduler=scheduler, run_id="unit", target_batch_size=24,
                         handle_signals=False, core_factory=fake_core)
    record: dict = {"steps": []}
    for _ in range(2):  # 4 + 8 samples per step: the second step reaches the target of 24
        x = torch.randn(4 * (rank + 1), 3)
        ddp(x).pow(2).mean().backward()
        result = node.step()
        record["steps"].append([result.samples, result.epoch_changed])
        node.zero_grad()
    record["local_epoch"] = node.local_epoch
    record["lr"] = node.get_lr()
    record["scheduler_lr"] = node.scheduler.get_last_lr()
    record["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    record["samples_reported"] = node.samples_reported
    state = node.state_dict()
    record["state"] = [state["format"], state["local_epoch"], state["scheduler"]["epoch"]]

    # a rank that cannot count its samples fails every rank, before rank 0 touches the swarm
    def uncounted() -> None:
        if rank == 0:
            backward(model, 4)  # counted by the forward hook; rank 1 ran no forward and passes no count
        node.step()

    record["uncounted"] = outcome(uncounted)
    # rank 0's core fails: every rank raises, a ConfigurationError stays one
    if node.collaborative_optimizer is not None:
        node.collaborative_optimizer._peer.fail_next = ConfigurationError("grad", "broken", "fix it")
    record["rank0_config_error"] = outcome(lambda: node.step(batch_size=2))
    if node.collaborative_optimizer is not None:
        node.collaborative_optimizer._peer.fail_next = ValueError("boom")
    record["rank0_error"] = outcome(lambda: node.step(batch_size=2))
    record["after_errors"] = outcome(lambda: node.step(batch_size=2))  # the node still works
    # rank 0's core learns that its last round was partial: every rank hears it at the next step
    if node.collaborative_optimizer is not None:
        node.collaborative_optimizer._peer.out_of_sync = True
    # a NaN on one rank reaches every rank through DDP's all-reduce: the node contributes nothing
    node.zero_grad()
    loss = ddp(torch.randn(4, 3)).pow(2).mean()
    (loss * float("nan") if rank == 1 else loss).backward()
    reported = node.samples_reported
    nan_result = node.step()
    record["nan_step"] = [nan_result.samples, nan_result.skipped, node.samples_reported - reported,
                          node.nonfinite_steps]
    record["out_of_sync"] = node.out_of_sync
    # the end of a run: rank 0 flushes and serves the final state while rank 1 waits in the wait group
    record["final_state"] = node.serve_final_state(timeout=3.0)
    if node.collaborative_optimizer is not None:
        record["final_calls"] = node.collaborative_optimizer._peer.calls[-2:]
    node.close()

    def failing_core(*args, **kwargs):
        raise ConfigurationError("initial_peers", "nobody answered", "check the address")

    record["init_error"] = outcome(lambda: NodeOptimizer(opt, run_id="unit", target_batch_size=24,
                                                         core_factory=failing_core))
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    # DDP sits in reference cycles: free it (and the gloo group it holds) now, not during interpreter exit
    del ddp
    gc.collect()
