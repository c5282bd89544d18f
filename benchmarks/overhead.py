"""B1 wrapper overhead: swarm samples/s of 2 collabopt peers against 2 raw ``hivemind.Optimizer`` peers.

Both use the same configuration (same MLP, batch, target batch size, timeouts), run on loopback, one swarm at a
time, alternating hivemind / collabopt / hivemind / collabopt..., all against one bootstrap DHT. Each round's
collabopt throughput is divided by the mean of the hivemind rounds around it.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import median, seconds_per_step, spread
from benchmarks.swarmrun import run_peers, start_bootstrap, throughput


def run(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    step = seconds_per_step(cfg["params"], cfg["width"], cfg["in_dim"], cfg["batch"])
    # epochs of about epoch_seconds: hivemind needs a few seconds per epoch for peers to meet
    # (two peers share the machine's cores, so each runs at most at this rate)
    target = max(cfg["batch"] * 4, int(2 * cfg["batch"] * cfg["epoch_seconds"] / step / 2))
    bootstrap, initial_peers = start_bootstrap(workdir)
    rates: dict[str, list[float]] = {"hivemind": [], "collabopt": []}
    order = []
    try:
        impls = ["hivemind", "collabopt"] * cfg["rounds"] + ["hivemind"]
        for i, impl in enumerate(impls):
            run_id = f"bench_b1_{uuid.uuid4().hex[:8]}"
            peer = dict(impl=impl, run_id=run_id, initial_peers=initial_peers, params=cfg["params"],
                        width=cfg["width"], in_dim=cfg["in_dim"], batch=cfg["batch"], compute="real",
                        target_batch_size=target, num_peers=2, matchmaking_time=cfg["matchmaking_time"],
                        warmup_epochs=cfg["warmup_epochs"], measure_seconds=cfg["measure_seconds"],
                        max_seconds=cfg["max_seconds"],
                        # the same config on both sides, spelled out: hivemind's default background averaging
                        options=dict(delay_state_averaging=True))
            records = run_peers(workdir, f"b1_{i}_{impl}", [dict(peer, seed=s) for s in range(2)],
                                timeout=cfg["max_seconds"] + 60)
            rate = throughput(records, cfg["batch"], warmup_epochs=cfg["warmup_epochs"])
            rates[impl].append(rate)
            order.append((impl, rate, min(r["num_peers"] for r in records)))
    finally:
        bootstrap.kill_tree()
    hm = rates["hivemind"]
    ratios = [c / ((hm[i] + hm[i + 1]) / 2) for i, c in enumerate(rates["collabopt"])]
    return dict(target_batch_size=target, seconds_per_step_alone=step, ratio=median(ratios),
                ratio_range=spread(ratios), rounds=order,
                hivemind_samples_per_s=median(hm), collabopt_samples_per_s=median(rates["collabopt"]))
