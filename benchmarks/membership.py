"""The swarm key's cost at ``step()`` (issue 35, goal: under 1%): two collabopt swarms of 2 peers side by side, one
with a swarm key (signed DHT requests and answers, member tokens in every round's gathered data, the group's tokens
checked before each all-reduce) and one without, the same configuration otherwise, run **at the same time**, each
against its own bootstrap DHT, so that whatever else the machine does slows both alike. Peers "compute" by sleeping,
as in B1 (benchmarks/overhead.py).

Figures, keyed / open: the swarm's samples/s per global epoch (B1's measure; median over the epochs both swarms
completed) and the mean time inside ``step()`` per local step over each peer's measured window.

    python -m benchmarks.membership            # about 2 minutes; writes benchmarks/results/membership.json
    python -m benchmarks.membership --quick    # checks the harness
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, child_env, machine_info, write_json
from benchmarks.side_by_side import compare_swarms
from benchmarks.swarmrun import start_bootstrap
from collabopt import processes
from collabopt.membership import new_swarm_key

FULL = dict(params=1_000_000, width=512, in_dim=256, batch=32, compute_seconds=0.05, epoch_seconds=8,
            matchmaking_time=2.0, averaging_timeout=30.0, warmup_epochs=1, rounds_per_session=5, sessions=1,
            max_seconds=200)
QUICK = dict(FULL, params=100_000, width=256, epoch_seconds=3, matchmaking_time=1.0, rounds_per_session=1,
             max_seconds=60)
KINDS = ("open", "keyed")


def run(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    key = new_swarm_key()
    key_file = workdir / "swarm.key"
    key_file.write_text(key)
    bootstraps = []
    try:
        bootstraps.append(start_bootstrap(workdir))
        bootstraps.append(processes.start_bootstrap(workdir, name="bootstrap_keyed", dht_args=[
            "--no-relay", "--swarm-key-file", str(key_file)], env=child_env(), cwd=ROOT))
        return compare_swarms(cfg, workdir, "membership", 2, {
            kind: (initial_peers, dict(delay_state_averaging=True, **(dict(swarm_key=key) if kind == "keyed" else {})))
            for kind, (_, initial_peers) in zip(KINDS, bootstraps, strict=True)})
    finally:
        for proc, _ in bootstraps:
            proc.kill_tree()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="collabopt_membership_") as workdir:
        result = dict(run(cfg, Path(workdir)), config=cfg, machine=machine_info())
    print(json.dumps({k: v for k, v in result.items() if k not in ("config", "machine")}, indent=1))
    if not args.quick:
        write_json(ROOT / "benchmarks" / "results" / "membership.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
