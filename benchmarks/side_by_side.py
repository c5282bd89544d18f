"""Two collabopt swarms of B1's peers run at the same time, differing in one setting, so that whatever else the machine
does slows both alike (benchmarks/aggregation.py, benchmarks/membership.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import median, spread
from benchmarks.overhead import swarm_rates
from benchmarks.swarmrun import run_peers


def step_seconds(records: list[dict[str, Any]]) -> float:
    """Mean seconds inside ``step()`` per local step over the peers' measured windows."""
    times = [s[2] for r in records for s in r["steps"] if r["window"][0] < s[0] + s[1] + s[2] <= r["window"][1]]
    return sum(times) / len(times) if times else float("nan")


def compare_swarms(cfg: dict[str, Any], workdir: Path, name: str, peers: int,
                   arms: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Run ``cfg["sessions"]`` sessions of two swarms of ``peers`` B1 peers side by side, one per arm
    (``{kind: (initial_peers, options)}``, the baseline first). Per global epoch both completed: the second arm's
    samples/s over the baseline's; per arm: its samples/s and its mean time inside ``step()``."""
    (base, _), (other, _) = arms.items()
    batch = cfg["batch"]
    target = int(peers * batch * cfg["epoch_seconds"] / cfg["compute_seconds"])
    ratios: list[float] = []
    rates: dict[str, list[float]] = {kind: [] for kind in arms}
    steps: dict[str, list[float]] = {kind: [] for kind in arms}
    for session in range(cfg["sessions"]):
        configs = []
        for kind, (initial_peers, options) in arms.items():
            peer = dict(impl="collabopt", run_id=f"bench_{name}_{kind}_{uuid.uuid4().hex[:8]}",
                        initial_peers=initial_peers, params=cfg["params"], width=cfg["width"],
                        in_dim=cfg["in_dim"], batch=batch, compute="sleep", compute_seconds=cfg["compute_seconds"],
                        target_batch_size=target, matchmaking_time=cfg["matchmaking_time"],
                        averaging_timeout=cfg["averaging_timeout"], warmup_epochs=cfg["warmup_epochs"],
                        measure_seconds=(cfg["rounds_per_session"] + 1) * cfg["epoch_seconds"] * 1.3,
                        max_seconds=cfg["max_seconds"], options=options)
            configs += [dict(peer, seed=s) for s in range(peers)]
        records = run_peers(workdir, f"{name}_{session}", configs, timeout=cfg["max_seconds"] + 60)
        by_kind = {base: records[:peers], other: records[peers:]}
        per_epoch = {kind: swarm_rates(rs, batch, cfg["warmup_epochs"]) for kind, rs in by_kind.items()}
        n = min(len(v) for v in per_epoch.values())
        for kind in arms:
            rates[kind] += per_epoch[kind][:n]
            steps[kind].append(step_seconds(by_kind[kind]))
        ratios += [o / b for o, b in zip(per_epoch[other][:n], per_epoch[base][:n], strict=True)]
    if not ratios:
        raise RuntimeError("no epoch completed by both swarms in the measured windows")
    return {"target_batch_size": target, "rounds": len(ratios), "samples_per_s_ratio": median(ratios),
            "ratio_range": spread(ratios), "round_ratios": ratios,
            **{f"{kind}_samples_per_s": median(rates[kind]) for kind in arms},
            **{f"{kind}_step_ms": 1000 * median(steps[kind]) for kind in arms},
            "step_time_ratio": median(steps[other]) / median(steps[base])}
