"""B3 WAN: collabopt peers in their own network namespaces, every link limited with ``tc tbf``.

Each peer "computes" by sleeping (a stand-in for GPU work that leaves the shared CPUs to networking) and reports
fixed gradients. Two figures per configuration:

- all-reduce time of the gradients (from the last peer's trigger to the last peer done) against the link bound
  ``2 (N-1)/N * S / B`` of a butterfly all-reduce with S gradient bytes and B bits/s per peer;
- compute utilization: seconds spent computing / wall seconds, per peer, in the measured window.

Parameter averaging is set to every 1000 epochs so that only gradient averaging uses the links.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from benchmarks import wan_allreduce
from benchmarks.common import median, spread
from benchmarks.swarmrun import allreduce_seconds, run_peers, start_bootstrap, utilization
from harness.testnet import TestNet, unavailable_reason

OVERLAP = {"offload_optimizer": True, "delay_optimizer_step": True, "delay_grad_averaging": True,
           "delay_state_averaging": True}
VARIANTS: dict[str, tuple[dict[str, Any], str | None]] = {
    "no overlap": ({}, None),
    "overlap": (OVERLAP, None),
    "overlap + fp16": (OVERLAP, "fp16"),
    "overlap + 8-bit": (OVERLAP, "8bit"),
    "overlap + PowerSGD": (OVERLAP, "powersgd"),
}


def bound_seconds(n: int, grad_bytes: int, rate_mbit: float) -> float:
    """Lower bound of a butterfly all-reduce: each peer sends and receives 2 (N-1)/N of the data over its link."""
    return 2 * (n - 1) / n * grad_bytes * 8 / (rate_mbit * 1e6)


def run_case(workdir: Path, name: str, n: int, rate_mbit: float, params: int, variant: str,
             cfg: dict[str, Any], impl: str = "collabopt") -> dict[str, Any]:
    """One swarm of ``n`` peers at ``rate_mbit`` per link; returns the figures of this case."""
    options, compression = VARIANTS[variant]
    compute = cfg["compute_seconds"]
    steps_per_epoch = cfg["steps_per_epoch"]
    row: dict[str, Any] = dict(case=name, peers=n, mbit=rate_mbit, variant=variant, impl=impl)
    with TestNet(n, rate_mbit, fair=cfg.get("fair", False), congestion=cfg.get("congestion")) as net:
        bootstrap, initial_peers = start_bootstrap(workdir, host=net.bootstrap_addr, netns=net.bootstrap)
        try:
            peer = dict(impl=impl, run_id=f"bench_b3_{uuid.uuid4().hex[:8]}", initial_peers=initial_peers,
                        params=params, width=cfg["width"], in_dim=cfg["in_dim"], batch=cfg["batch"],
                        compute="sleep", compute_seconds=compute,
                        target_batch_size=n * cfg["batch"] * steps_per_epoch, matchmaking_time=cfg["matchmaking_time"],
                        averaging_timeout=cfg["averaging_timeout"], average_state_every=1000, options=options,
                        compression=compression, warmup_epochs=cfg["warmup_epochs"],
                        measure_seconds=cfg["measure_seconds"], max_seconds=cfg["max_seconds"])
            records = run_peers(workdir, f"b3_{name}", [dict(peer, host=net.addr[i], seed=i) for i in range(n)],
                                timeout=cfg["max_seconds"] + 90, netns=net.peers)
        finally:
            bootstrap.kill_tree()
    grad_bytes = records[0]["grad_bytes"]
    durations = allreduce_seconds(records)
    bound = bound_seconds(n, grad_bytes, rate_mbit)
    allreduce = median(durations)
    row.update(grad_mb=grad_bytes / 1e6, bound_s=bound, allreduce_s=allreduce, rounds=len(durations),
               allreduce_range=spread(durations), bound_over_allreduce=bound / allreduce if durations else float("nan"),
               utilization=utilization(records, cfg["warmup_epochs"]),
               epoch_compute_s=compute * steps_per_epoch)
    return row


def run(cfg: dict[str, Any], workdir: Path, log: Any = print) -> dict[str, Any]:
    """Run every configured case; a case that fails is reported with its error, the others still run."""
    reason = unavailable_reason()
    if reason:
        log(f"B3 WAN skipped: {reason}")
        return dict(skipped=reason, rows=[])
    rows = []
    for case in cfg["cases"]:
        impl = case.get("impl", "collabopt")
        name = f"{case['peers']}p_{case['mbit']}mbit_{case['variant'].replace(' ', '').replace('+', '_')}"
        name += f"_{impl}" if impl == "hivemind" or impl in wan_allreduce.PEER_MODULES else ""
        log(f"B3 {name} ...")
        try:
            if impl in wan_allreduce.PEER_MODULES:  # the all-reduce alone: collabopt's runner, or its traffic alone
                row = wan_allreduce.run_case(workdir, name, case["peers"], case["mbit"], case["params"],
                                             dict(cfg, **case.get("overrides", {})), bound_seconds, impl=impl)
            else:
                row = run_case(workdir, name, case["peers"], case["mbit"], case["params"], case["variant"],
                               dict(cfg, **case.get("overrides", {})), impl=impl)
        except Exception as e:  # keep going: one broken configuration must not hide the others
            row = dict(case=name, peers=case["peers"], mbit=case["mbit"], variant=case["variant"], impl=impl,
                       error=str(e).splitlines()[0][:300])
            (workdir / f"b3_{name}.error.txt").write_text(str(e))
        log(f"B3 {name}: {row}")
        rows.append(row)
    return dict(rows=rows)
