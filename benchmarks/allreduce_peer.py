"""One B3 peer of collabopt's own averaging service (:mod:`collabopt.engine.averager`): it averages the gradients of the
benchmark MLP (random values, the same bytes as benchmarks.peer's) with its group, ``rounds`` times in a row, each after
``idle_seconds`` of idle links (:data:`benchmarks.wan_allreduce.IDLE_SECONDS`), and records when each round's group was
assembled (the trigger) and when its result came (wall-clock, comparable across processes of one machine), in the record
format :func:`benchmarks.swarmrun.allreduce_seconds` reads.

Usage: ``python -m benchmarks.allreduce_peer config.json``; writes ``config['out']`` (JSON).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import make_mlp, write_json


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    from collabopt.engine.averager import AveragingService
    from collabopt.engine.p2p import start_dht

    host = cfg.get("host", "127.0.0.1")
    dht = start_dht(initial_peers=cfg["initial_peers"].split(","), host_maddrs=[f"/ip4/{host}/tcp/0"])
    torch.manual_seed(cfg.get("seed", 0))
    tensors = [torch.randn_like(p) for p in make_mlp(cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"])
               .parameters()]
    groups: list[float] = []
    service = AveragingService(dht, prefix=cfg["run_id"], target_group_size=cfg["peers"], min_group_size=cfg["peers"],
                               matchmaking_time=cfg["matchmaking_time"], request_timeout=1.0,
                               sender_timeout=cfg["averaging_timeout"] / 2, reducer_timeout=cfg["averaging_timeout"],
                               part_size_bytes=cfg.get("part_size_bytes", 2**19),
                               on_group=lambda group: groups.append(time.time()))
    Path(cfg["ready_file"]).touch()  # start together: the runner creates go_file once every peer is ready
    wait_until = time.monotonic() + 120
    while not Path(cfg["go_file"]).exists() and time.monotonic() < wait_until:
        time.sleep(0.05)
    events = []
    for _ in range(cfg["rounds"]):
        time.sleep(cfg.get("idle_seconds", 0.0))
        called = time.time()
        result = service.average(tensors, weight=1.0, timeout=cfg["averaging_timeout"])
        done = time.time()
        ok = result.evidence is not None and result.evidence.complete
        events.append(dict(called=called, trigger=groups[-1] if result.group else called, done=done, ok=ok,
                           error=result.error, received=result.evidence.received if result.evidence else 0.0))
    write_json(Path(cfg["out"]), dict(averaging=events, grad_bytes=sum(t.numel() * t.element_size() for t in tensors)))
    service.close()
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
