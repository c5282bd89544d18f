"""B1 with ``aggregation="centered_clip"`` against ``"mean"`` (issue 35, goal: >= 0.95x the samples/s): two collabopt
swarms of 4 peers side by side, the same configuration as B1 (benchmarks/overhead.py: peers "compute" by sleeping and
report fixed random gradients, 1M parameters) but for the aggregation, run **at the same time** against one
bootstrap DHT, so that whatever else the machine does slows both alike. 4 peers, not B1's 2: a reducer then clips
4 senders' parts (2 senders' parts lie within the radius of each other).

Figures, centered_clip / mean: the swarm's samples/s per global epoch (B1's measure; median over the epochs both
swarms completed), and the mean time inside ``step()`` per local step.

    python -m benchmarks.aggregation            # about 3 minutes; writes benchmarks/results/aggregation.json
    python -m benchmarks.aggregation --quick    # checks the harness
"""

from __future__ import annotations

import argparse
import json
import tempfile
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine_info, median, spread, write_json
from benchmarks.membership import step_seconds
from benchmarks.overhead import swarm_rates
from benchmarks.run import FULL as B1
from benchmarks.run import QUICK as B1_QUICK
from benchmarks.swarmrun import run_peers, start_bootstrap

FULL = dict(B1["b1"], peers=4, sessions=1, rounds_per_session=6)
QUICK = dict(B1_QUICK["b1"], peers=4)
KINDS = ("mean", "centered_clip")


def run(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    batch, peers = cfg["batch"], cfg["peers"]
    target = int(peers * batch * cfg["epoch_seconds"] / cfg["compute_seconds"])
    bootstrap, initial_peers = start_bootstrap(workdir)
    ratios: list[float] = []
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    steps: dict[str, list[float]] = {kind: [] for kind in KINDS}
    try:
        for session in range(cfg["sessions"]):
            configs = []
            for kind in KINDS:
                peer = dict(impl="collabopt", run_id=f"bench_agg_{kind}_{uuid.uuid4().hex[:8]}",
                            initial_peers=initial_peers, params=cfg["params"], width=cfg["width"],
                            in_dim=cfg["in_dim"], batch=batch, compute="sleep", compute_seconds=cfg["compute_seconds"],
                            target_batch_size=target, matchmaking_time=cfg["matchmaking_time"],
                            averaging_timeout=cfg["averaging_timeout"], warmup_epochs=cfg["warmup_epochs"],
                            measure_seconds=(cfg["rounds_per_session"] + 1) * cfg["epoch_seconds"] * 1.3,
                            max_seconds=cfg["max_seconds"],
                            options=dict(delay_state_averaging=True, aggregation=kind))
                configs += [dict(peer, seed=s) for s in range(peers)]
            records = run_peers(workdir, f"aggregation_{session}", configs, timeout=cfg["max_seconds"] + 60)
            by_kind = {"mean": records[:peers], "centered_clip": records[peers:]}
            per_epoch = {kind: swarm_rates(rs, batch, cfg["warmup_epochs"]) for kind, rs in by_kind.items()}
            n = min(len(v) for v in per_epoch.values())
            for kind in KINDS:
                rates[kind] += per_epoch[kind][:n]
                steps[kind].append(step_seconds(by_kind[kind]))
            ratios += [c / m for c, m in zip(per_epoch["centered_clip"][:n], per_epoch["mean"][:n], strict=True)]
    finally:
        bootstrap.kill_tree()
    if not ratios:
        raise RuntimeError("no epoch completed by both swarms in the measured windows")
    return dict(target_batch_size=target, rounds=len(ratios), samples_per_s_ratio=median(ratios),
                ratio_range=spread(ratios), round_ratios=ratios, mean_samples_per_s=median(rates["mean"]),
                centered_clip_samples_per_s=median(rates["centered_clip"]), mean_step_ms=1000 * median(steps["mean"]),
                centered_clip_step_ms=1000 * median(steps["centered_clip"]),
                step_time_ratio=median(steps["centered_clip"]) / median(steps["mean"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="collabopt_aggregation_") as workdir:
        result = dict(run(cfg, Path(workdir)), config=cfg, machine=machine_info())
    print(json.dumps({k: v for k, v in result.items() if k not in ("config", "machine")}, indent=1))
    if not args.quick:
        write_json(ROOT / "benchmarks" / "results" / "aggregation.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
