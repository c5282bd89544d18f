"""A training peer for the monitor tests: reports its loss, and logs what it knows of itself for the test to compare.

Usage: ``python tests/swarm/monitor_worker.py config.json``. It trains a small MLP (``copt.report_loss`` every
step) until it and every peer named in ``finish_with`` reached ``epochs``, then stays in the swarm (its metrics
record still published) until ``<out>.stop`` exists (with ``target_file``: not before that file exists, and at
least the epoch written in it). ``<out>.trace`` gets one JSON line per step and per second
while it lingers: its time (hivemind's clock), local epoch, own samples/s and samples contributed — the peer's own
numbers, which the tests compare with the monitor's. ``<out>.json``: its final values.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from peer_worker import at_finish_line, exit_now, make_data, make_model, progress_of, write_json

from collabopt import CollaborativeOptimizer
from collabopt.engine.compat import dht_time


def finished(cfg: dict, epoch: int, in_sync: bool) -> bool:
    """At the finish line: ``epochs`` reached here and by the peers of ``finish_with``; with ``target_file``, only
    once that file exists, and at least the epoch it holds."""
    target = cfg["epochs"]
    if cfg.get("target_file"):
        try:
            target = max(target, int(Path(cfg["target_file"]).read_text()))
        except (OSError, ValueError):
            return False
    return at_finish_line(cfg, epoch, target, in_sync)


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    out = cfg["out"]
    torch.manual_seed(cfg.get("seed", 0))
    x_all, y_all = make_data()
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    deadline = time.monotonic() + cfg.get("max_seconds", 120)

    def log(copt: CollaborativeOptimizer) -> None:
        tracker = copt.loop.tracker
        with open(out + ".trace", "a") as trace:
            trace.write(json.dumps(dict(t=dht_time(), epoch=copt.local_epoch, peer_id=copt.dht.peer_id.to_base58(),
                                        sps=tracker.performance_ema.samples_per_second,
                                        global_epoch=copt.global_epoch, num_peers=copt.num_peers,
                                        samples_reported=copt.samples_reported)) + "\n")

    with CollaborativeOptimizer(optimizer, run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"],
                                model=model, host_maddrs=["/ip4/127.0.0.1/tcp/0"], matchmaking_time=2.0,
                                averaging_timeout=15.0, print_join_message=False) as copt:
        assert copt.wait_for_peers(cfg.get("wait_peers", 1), timeout=60), "the other peers did not come"
        while not finished(cfg, copt.local_epoch, not copt.out_of_sync) and time.monotonic() < deadline:
            idx = torch.randint(0, len(x_all), (cfg.get("batch_size", 16),))
            loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
            loss.backward()
            copt.step()
            copt.zero_grad()
            copt.report_loss(loss)
            log(copt)
            write_json(out + ".progress", progress_of(copt))
            time.sleep(cfg.get("step_sleep", 0.05))
        Path(out + ".done").touch()
        while not Path(out + ".stop").exists() and time.monotonic() < deadline:
            log(copt)
            time.sleep(1.0)
        write_json(out + ".json", dict(final_epoch=copt.local_epoch, peer_id=copt.dht.peer_id.to_base58(),
                                       samples_reported=copt.samples_reported,
                                       params=[p.detach().flatten().tolist() for p in model.parameters()]))


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
