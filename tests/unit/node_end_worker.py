"""One rank of a 2-rank gloo job ending a node's run, rank 0's core on a fake peer (see test_node_end.py)."""

from __future__ import annotations

import datetime
import functools
import gc
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from fakes import fake_core, model_and_optimizer

from collabopt.node import NodeOptimizer


def outcome(call) -> str:
    try:
        return f"returned {call()!r}"
    except BaseException as e:  # Terminated is a SystemExit
        return type(e).__name__


def start(rank: int, workdir: str) -> None:
    # a collective left waiting on the default group fails after 10 s here (its default is 30 minutes)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=10))


def node() -> NodeOptimizer:
    return NodeOptimizer(model_and_optimizer()[1], run_id="unit", target_batch_size=24, handle_signals=False,
                         core_factory=fake_core, node_timeout=60.0)


def core_calls(node: NodeOptimizer) -> list[str] | None:
    return node.collaborative_optimizer._peer.calls if node.collaborative_optimizer is not None else None


def finish(rank: int, workdir: str, record: dict) -> None:
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    gc.collect()


def end_run(rank: int, workdir: str) -> None:
    """Two runs, one after the other: in the first, rank 1's loop raised (its adapter passes serve=False) while
    rank 0's ended normally; in the second, both ended normally."""
    start(rank, workdir)
    record = {}
    for case, serve in (("one_rank_raised", rank == 0), ("every_rank_finished", True)):
        run = node()
        record[case] = {"end_run": outcome(functools.partial(run.end_run, serve=serve)), "closed": run.closed,
                        "core_calls": core_calls(run)}
    finish(rank, workdir, record)


def sigterm_both_when_ready(ready: list[Path]) -> None:
    """SIGTERM to both ranks, rank 1 first (as torchrun sends it to every process), once both are in their final
    wait. Each rank timing its own signal raced: where rank 0's Terminated ended rank 1's wait first, rank 1's own
    SIGTERM came after its handler was restored and killed it."""
    while not all(path.exists() for path in ready):
        time.sleep(0.05)
    for path in reversed(ready):
        os.kill(int(path.read_text()), signal.SIGTERM)


def sigterm_in_lightning_wait(rank: int, workdir: str) -> None:
    """Lightning's SIGTERM handler is set on both ranks (as Trainer.fit sets it); rank 0 serves (its fake core
    waits 60 s), rank 1 waits for it in the wait group; SIGTERM reaches both once both wait."""
    from collabopt.integrations._lightning_signals import sigterm_ends_final_wait  # Lightning's import: here only
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    start(rank, workdir)
    run = node()
    trainer = SimpleNamespace(local_rank=rank, world_size=2,
                              strategy=SimpleNamespace(launcher=None, root_device=torch.device("cpu")))
    connector = _SignalConnector(trainer)
    trainer._signal_connector = connector
    previous = signal.signal(signal.SIGTERM, connector._sigterm_notifier_fn)
    ready = [Path(workdir, f"ready{r}") for r in (0, 1)]

    def say_ready() -> None:
        ready[rank].with_suffix(".tmp").write_text(str(os.getpid()))
        ready[rank].with_suffix(".tmp").rename(ready[rank])  # whole, for the other rank's reader

    if run.collaborative_optimizer is not None:  # rank 0: ready once inside the core's wait (within the node's try)
        run.collaborative_optimizer._peer.serve_final_state = lambda _=None: say_ready() or time.sleep(60) or "bound"
    if rank == 0:
        threading.Thread(target=sigterm_both_when_ready, args=(ready,), daemon=True).start()

    def wait() -> str:
        with sigterm_ends_final_wait(trainer, several_processes=True, global_rank=rank):
            if rank != 0:  # (its handler only records: ready anywhere in the block)
                say_ready()
            return run.serve_final_state()

    record = {"wait": outcome(wait), "received_sigterm": connector.received_sigterm,
              "handler_restored": signal.getsignal(signal.SIGTERM) == connector._sigterm_notifier_fn}
    signal.signal(signal.SIGTERM, previous)
    run.close()
    finish(rank, workdir, record)
