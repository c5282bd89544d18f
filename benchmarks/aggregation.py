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
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine_info, write_json
from benchmarks.run import FULL as B1
from benchmarks.run import QUICK as B1_QUICK
from benchmarks.side_by_side import compare_swarms
from benchmarks.swarmrun import start_bootstrap

FULL = dict(B1["b1"], peers=4, sessions=1, rounds_per_session=6)
QUICK = dict(B1_QUICK["b1"], peers=4, epoch_seconds=3)  # (as before B1's quick epochs became 2 s)
KINDS = ("mean", "centered_clip")


def run(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    bootstrap, initial_peers = start_bootstrap(workdir)
    try:
        return compare_swarms(cfg, workdir, "aggregation", cfg["peers"], {
            kind: (initial_peers, dict(delay_state_averaging=True, aggregation=kind)) for kind in KINDS})
    finally:
        bootstrap.kill_tree()


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
