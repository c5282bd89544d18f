"""A member of two rounds of collabopt's averaging service, run as its own OS process by
tests/swarm/test_allreduce_service.py (a frozen member holds the DHT's lookups up).

Usage: ``python search_worker.py config.json`` (INITIAL_PEERS in the environment). Config: ``run_id``, ``seed``,
``out``, ``start_after``. Once it wrote ``<out>.ready``, the members meet: at the wall time in the test's file
``go.<k>`` (k = 1, 2, ...) each averages with the others, a group of 3 wanted, and writes its group's size to
``<out>.met.<k>``; the test writes the next ``go.<k>`` until one meeting had all 3, then ``go2`` (t1). It schedules
a round at t1 + ``start_after`` among 2 or more, as the product's gradient round does (``matchmaking_time`` 2 s,
``request_timeout`` 1 s, 10 s timeout), and writes ``<out>.json`` (the round's error, group in base58 and seconds)
and ``<out>.pt`` (its inputs and the averaged tensors).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
from allreduce_worker import honest_inputs

from collabopt.engine import protocol
from collabopt.engine.averager import AveragingService
from collabopt.engine.p2p import start_dht


def wall_time_in(*paths: Path) -> tuple[Path, float]:
    """The first of ``paths`` the test writes (it renames a written file into place), and the time in it."""
    while True:
        for path in paths:
            if path.exists():
                return path, float(path.read_text())
        time.sleep(0.02)


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    peers = [p for p in os.environ.get("INITIAL_PEERS", "").split(",") if p]
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    service = AveragingService(dht, prefix=cfg["run_id"], target_group_size=None, min_group_size=2,
                               matchmaking_time=2.0, request_timeout=1.0, sender_timeout=2.0, reducer_timeout=4.0)
    tensors = honest_inputs(cfg["seed"], 1000)
    Path(f"{out}.ready").touch()
    meeting = 1
    while True:
        path, t0 = wall_time_in(out.parent / f"go.{meeting}", out.parent / "go2")
        if path.name == "go2":
            break
        time.sleep(max(0.0, t0 - time.time()))
        scheduled = service.schedule(tensors, timeout=5.0, target_group_size=3)
        scheduled.run(tensors, 1.0)
        Path(f"{out}.met.tmp").write_text(str(len(scheduled.result().group)))
        Path(f"{out}.met.tmp").rename(f"{out}.met.{meeting}")
        meeting += 1
    time.sleep(max(0.0, t0 + cfg["start_after"] - time.time()))
    start, epoch = time.monotonic(), dict(epoch=2)
    scheduled = service.schedule(tensors, timeout=10.0, gather=epoch,
                                 contributes=functools.partial(protocol.sync_contributes, epoch),
                                 admits=functools.partial(protocol.sync_admits, epoch))
    scheduled.run(tensors, 1.0)
    result = scheduled.result()
    record = dict(me=dht.peer_id.to_base58(), error=result.error, seconds=time.monotonic() - start,
                  group=[peer.to_base58() for peer in result.group])
    torch.save(dict(inputs=tensors, tensors=result.tensors), f"{out}.pt")
    Path(f"{out}.json").write_text(json.dumps(record))
    print(f"second round in {record['seconds']:.2f} s: {record}", flush=True)
    service.close()
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
