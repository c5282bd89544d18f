"""One member of a round of collabopt's own averaging service (collabopt.engine.averager), run as its own OS process
by tests/swarm/test_allreduce_service.py.

Usage: ``python allreduce_worker.py config.json`` (INITIAL_PEERS in the environment). Config: ``run_id`` (the
service's prefix), ``group_size``, ``seed``, ``numel``, ``weight``, ``aggregation``, ``role`` ("honest"; "hostile":
sends its inputs times -20; "victim": SIGKILLs itself ``kill_after`` seconds after its group is assembled;
"tag_along": takes part with nothing), ``out``. With ``epoch``: the round is scheduled (``AveragingService.schedule``,
gathering the epoch; as in the product, a member not at its group's epoch contributes nothing and a leader takes no
member of a later epoch: ``collabopt.engine.protocol``) and its tensors come
``trigger_after`` seconds later; with ``go`` too (a file the test writes with a wall time t0 once every member is
ready), matchmaking begins at t0 + ``start_after`` for a round scheduled at t0 + ``scheduled_after`` (default: its
``matchmaking_time`` from its start), among ``min_group_size`` or more (``group_size`` None: no target).
Writes ``<out>.pt`` (its inputs as sent, and the averaged tensors) and ``<out>.json`` (the round's evidence, peer ids
in base58).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from collabopt.engine import protocol
from collabopt.engine.averager import AveragingService
from collabopt.engine.p2p import start_dht

HOSTILE_FACTOR = -20.0


def honest_inputs(seed: int, numel: int) -> list[torch.Tensor]:
    """A member's tensors: a part all members share plus a small one of its own (so that a clip has an honest
    spread to keep), and a second, small tensor."""
    common = torch.Generator().manual_seed(1234)
    own = torch.Generator().manual_seed(seed)
    big = torch.randn(numel, generator=common) + 0.05 * torch.randn(numel, generator=own)
    small = torch.randn(7, 5, generator=common) + 0.05 * torch.randn(7, 5, generator=own)
    return [big, small]


def inputs_of(cfg: dict) -> list[torch.Tensor]:
    tensors = honest_inputs(cfg["seed"], cfg["numel"])
    return [HOSTILE_FACTOR * t for t in tensors] if cfg.get("role") == "hostile" else tensors


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    peers = [p for p in os.environ.get("INITIAL_PEERS", "").split(",") if p]
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    def on_group(group):
        print(f"group of {len(group)} assembled", flush=True)
        if cfg.get("role") == "victim":
            threading.Timer(cfg.get("kill_after", 0.3), os.kill, (os.getpid(), signal.SIGKILL)).start()

    n = cfg["group_size"]
    service = AveragingService(dht, prefix=cfg["run_id"], target_group_size=n,
                               min_group_size=cfg.get("min_group_size", n),
                               matchmaking_time=cfg.get("matchmaking_time", 3.0), request_timeout=1.0,
                               sender_timeout=cfg.get("sender_timeout", 5.0),
                               reducer_timeout=cfg.get("reducer_timeout", 10.0),
                               aggregation=cfg.get("aggregation", "mean"), on_group=on_group)
    tensors = inputs_of(cfg)
    scheduled_time = None
    if "go" in cfg:  # (every member waits for the others to be ready, then begins on the common clock)
        Path(f"{out}.ready").touch()
        while not Path(cfg["go"]).exists():
            time.sleep(0.05)
        t0 = float(Path(cfg["go"]).read_text())
        time.sleep(max(0.0, t0 + cfg.get("start_after", 0.0) - time.time()))
        scheduled_time = t0 + cfg["scheduled_after"] if "scheduled_after" in cfg else None
    start = time.monotonic()
    if "epoch" in cfg:  # scheduled: matchmaking now, the tensors once its epoch ends (stale members tag along)
        epoch = cfg["epoch"]
        scheduled = service.schedule(tensors, timeout=cfg.get("timeout", 60.0), gather=dict(epoch=epoch),
                                     scheduled_time=scheduled_time,
                                     contributes=functools.partial(protocol.sync_contributes, dict(epoch=epoch)),
                                     admits=functools.partial(protocol.sync_admits, dict(epoch=epoch)))
        time.sleep(cfg.get("trigger_after", 0.0))
        if cfg.get("role") == "tag_along":
            scheduled.tag_along()
        else:
            scheduled.run(tensors, cfg.get("weight", 1.0))
        result = scheduled.result()
    else:
        result = service.average(tensors, weight=cfg.get("weight", 1.0), timeout=cfg.get("timeout", 60.0))
    seconds = time.monotonic() - start
    if cfg.get("role") == "victim":  # (the round ended before the kill: wait for it, the test expects a death)
        time.sleep(30)
    evidence = result.evidence
    record = dict(me=dht.peer_id.to_base58(), error=result.error, seconds=seconds,
                  group=[peer.to_base58() for peer in result.group],
                  gathered={peer.to_base58(): value for peer, value in result.gathered.items()})
    if evidence is not None:
        record.update(received=evidence.received, contributions=list(evidence.contributions),
                      results_from={evidence.members[k].to_base58(): list(v) for k, v in evidence.results_from.items()},
                      missing=[list(r) for r in evidence.missing], errors={evidence.members[k].to_base58(): v
                                                                           for k, v in evidence.errors.items()},
                      absent=[peer.to_base58() for peer in evidence.absent()], complete=evidence.complete)
    torch.save(dict(inputs=tensors, tensors=result.tensors), f"{out}.pt")
    Path(f"{out}.json").write_text(json.dumps(record))
    print(f"round done in {seconds:.2f} s: {record}", flush=True)
    service.close()
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
