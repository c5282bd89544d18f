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
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, child_env, machine_info, median, spread, write_json
from benchmarks.overhead import swarm_rates
from benchmarks.swarmrun import run_peers, start_bootstrap
from collabopt.membership import new_swarm_key
from collabopt.testing import processes

FULL = dict(params=1_000_000, width=512, in_dim=256, batch=32, compute_seconds=0.05, epoch_seconds=8,
            matchmaking_time=2.0, averaging_timeout=30.0, warmup_epochs=1, rounds_per_session=5, sessions=1,
            max_seconds=200)
QUICK = dict(FULL, params=100_000, width=256, epoch_seconds=3, matchmaking_time=1.0, rounds_per_session=1,
             max_seconds=60)
KINDS = ("open", "keyed")


def step_seconds(records: list[dict[str, Any]]) -> float:
    """Mean seconds inside ``step()`` per local step over the peers' measured windows."""
    times = [s[2] for r in records for s in r["steps"] if r["window"][0] < s[0] + s[1] + s[2] <= r["window"][1]]
    return sum(times) / len(times) if times else float("nan")


def run(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    batch, peers = cfg["batch"], 2
    target = int(peers * batch * cfg["epoch_seconds"] / cfg["compute_seconds"])
    key = new_swarm_key()
    key_file = workdir / "swarm.key"
    key_file.write_text(key)
    bootstraps = []
    ratios: list[float] = []
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    steps: dict[str, list[float]] = {kind: [] for kind in KINDS}
    try:
        bootstraps.append(start_bootstrap(workdir))
        bootstraps.append(processes.start_bootstrap(workdir, name="bootstrap_keyed", dht_args=[
            "--no-relay", "--swarm-key-file", str(key_file)], env=child_env(), cwd=ROOT))
        for session in range(cfg["sessions"]):
            configs = []
            for kind, (_, initial_peers) in zip(KINDS, bootstraps, strict=True):
                options = dict(delay_state_averaging=True, **(dict(swarm_key=key) if kind == "keyed" else {}))
                peer = dict(impl="collabopt", run_id=f"bench_key_{kind}_{uuid.uuid4().hex[:8]}",
                            initial_peers=initial_peers, params=cfg["params"], width=cfg["width"],
                            in_dim=cfg["in_dim"], batch=batch, compute="sleep", compute_seconds=cfg["compute_seconds"],
                            target_batch_size=target, matchmaking_time=cfg["matchmaking_time"],
                            averaging_timeout=cfg["averaging_timeout"], warmup_epochs=cfg["warmup_epochs"],
                            measure_seconds=(cfg["rounds_per_session"] + 1) * cfg["epoch_seconds"] * 1.3,
                            max_seconds=cfg["max_seconds"], options=options)
                configs += [dict(peer, seed=s) for s in range(peers)]
            records = run_peers(workdir, f"membership_{session}", configs, timeout=cfg["max_seconds"] + 60)
            by_kind = {"open": records[:peers], "keyed": records[peers:]}
            per_epoch = {kind: swarm_rates(rs, batch, cfg["warmup_epochs"]) for kind, rs in by_kind.items()}
            n = min(len(v) for v in per_epoch.values())
            for kind in KINDS:
                rates[kind] += per_epoch[kind][:n]
                steps[kind].append(step_seconds(by_kind[kind]))
            ratios += [k / o for k, o in zip(per_epoch["keyed"][:n], per_epoch["open"][:n], strict=True)]
    finally:
        for proc, _ in bootstraps:
            proc.kill_tree()
    if not ratios:
        raise RuntimeError("no epoch completed by both swarms in the measured windows")
    return dict(target_batch_size=target, rounds=len(ratios), samples_per_s_ratio=median(ratios),
                ratio_range=spread(ratios), round_ratios=ratios, open_samples_per_s=median(rates["open"]),
                keyed_samples_per_s=median(rates["keyed"]), open_step_ms=1000 * median(steps["open"]),
                keyed_step_ms=1000 * median(steps["keyed"]),
                step_time_ratio=median(steps["keyed"]) / median(steps["open"]))


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
