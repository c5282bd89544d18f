"""B5 idle time at epoch boundaries: how long a peer cannot compute per global epoch because it waits for
matchmaking, the gradient all-reduce, the optimizer step or parameter averaging.

N peers on loopback "compute" by sleeping (a stand-in for GPU work that leaves the shared CPUs to hivemind) and
report fixed gradients; the target batch size makes a global epoch last about ``epoch_factor x matchmaking_time``.
Each peer records every ``step()`` call (start and duration) and its loop's status lines with their wall times
(``verbose=True``; collabopt's or, for raw hivemind peers, hivemind's: see ``_STATUS``), and its progress tracker's
fetches.

Figures per case, over the measured window (from the first epoch >= ``warmup_epochs`` to the end):

- **idle / epoch**: the time spent inside ``step()`` beyond a plain local step (the median of the steps that
  change no epoch), summed over the window and divided by the global epochs in it; **idle share** = idle / window;
- the boundary step split, from the status lines: **matchmaking lead** (from the gradient round scheduled to the
  boundary begun: how long before this peer reached the boundary its group search began; a group forms
  ``matchmaking_time`` after the search began, so a lead below it is waited for), **wait for gradients** (boundary
  begun to gradients in), **step + state** (gradients in to the next epoch begun: optimizer step, foreground
  parameter averaging), and the **arrival skew** (the spread of the peers' boundary times in one epoch: early peers
  wait in the all-reduce for the last one).
"""

from __future__ import annotations

import concurrent.futures
import re
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import median, spread
from benchmarks.swarmrun import compare_snapshots, param_summary, rounds_not_averaged, run_peers, start_bootstrap

OVERLAP = {"offload_optimizer": True, "delay_optimizer_step": True, "delay_grad_averaging": True,
           "delay_state_averaging": True}
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "delay_state_averaging": {"delay_state_averaging": True},
    "overlap": OVERLAP,
}
# the status lines of a boundary, as hivemind's optimizer (impl=hivemind) or collabopt's loop (engine/sync_round.py)
# logs them with verbose=True: the round scheduled, the boundary begun, the gradients in, the next epoch begun
_STATUS = {
    "scheduled": re.compile(r"Pre-scheduling gradient|collabopt: gradient round scheduled"),
    "begin": re.compile(r"Beginning optimizer step #(\d+)|collabopt: epoch (\d+) ends"),
    "grads": re.compile(r"Averaged gradients|Averaging gradients failed|Skipped averaging|collabopt: gradients "
                        r"averaged|collabopt: the gradient round failed|collabopt: no gradient round"),
    "next": re.compile(r"Transitioning to epoch|collabopt: now at epoch"),
}


def _kind(message: str) -> str | None:
    return next((kind for kind, pattern in _STATUS.items() if pattern.match(message)), None)


def _begun_epoch(message: str) -> int:
    match = _STATUS["begin"].match(message)
    return int(match.group(1) or match.group(2))


def _events(record: dict[str, Any], start: float, end: float) -> list[tuple[float, str]]:
    return [(t, m) for t, m in record.get("status", []) if start <= t <= end]


def boundary_split(record: dict[str, Any], start: float, end: float) -> dict[str, list[float]]:
    """Per boundary of this peer in [start, end]: matchmaking lead, wait for gradients, step + state (seconds)."""
    out: dict[str, list[float]] = {"lead": [], "wait_grads": [], "step_state": [], "boundary": []}
    events = record.get("status", [])
    prescheduled = None
    begin = grads = None
    for t, message in events:
        kind = _kind(message)
        if kind == "scheduled":
            prescheduled = t
        elif kind == "begin":
            begin, grads = t, None
            if prescheduled is not None and start <= t <= end:
                out["lead"].append(t - prescheduled)
            prescheduled = None
        elif kind == "grads":
            grads = t
        elif kind == "next" and begin is not None:
            if start <= begin <= end:
                out["boundary"].append(t - begin)
                if grads is not None:
                    out["wait_grads"].append(grads - begin)
                    out["step_state"].append(t - grads)
            begin = grads = None
    return out


def arrival_skew(records: list[dict[str, Any]], start: float, end: float) -> list[float]:
    """Per epoch reached by every peer: the spread of the peers' times of beginning its boundary."""
    begins: dict[int, list[float]] = {}
    for record in records:
        for t, message in _events(record, start, end):
            if _kind(message) == "begin":
                begins.setdefault(_begun_epoch(message), []).append(t)
    return [max(ts) - min(ts) for ts in begins.values() if len(ts) == len(records)]


def peer_idle(record: dict[str, Any], warmup_epochs: int) -> dict[str, float]:
    """Idle seconds of one peer in its measured window: time in ``step()`` beyond a plain local step."""
    if len(record["window"]) != 2:
        raise RuntimeError(f"peer reached no epoch >= {warmup_epochs} (final epoch {record['final_epoch']})")
    start, end = record["window"]
    steps = [s for s in record["steps"] if start <= s[0] + s[1] <= end]
    plain = median([b[2] for a, b in zip(steps, steps[1:], strict=False) if a[3] == b[3]])
    boundary = [s[2] - plain for a, s in zip(steps, steps[1:], strict=False) if a[3] != s[3]]
    idle = sum(max(0.0, s[2] - plain) for s in steps)
    epochs = max(1, steps[-1][3] - steps[0][3]) if steps else 1
    wall = end - start
    return dict(wall=wall, epochs=epochs, idle=idle, idle_boundary=sum(boundary), plain_step=plain,
                compute=sum(s[1] for s in steps))


def run_case(workdir: Path, bootstrap_peers: str, n: int, variant: str, factor: float, cfg: dict[str, Any],
             impl: str = "collabopt") -> dict[str, Any]:
    """One swarm of ``n`` peers with epochs of about ``factor x matchmaking_time``; returns its row."""
    mm = cfg["matchmaking_time"]
    epoch_seconds = factor * mm
    compute = cfg["compute_seconds"]
    target = int(n * cfg["batch"] * epoch_seconds / compute)
    experiments = cfg.get("experiments", [])
    name = (f"b5_{n}p_{variant.replace(' ', '')}_{factor:g}x" + ("_hivemind" if impl != "collabopt" else "")
            + "".join(f"_{e}" for e in experiments))
    peer = dict(impl=impl, run_id=f"bench_b5_{uuid.uuid4().hex[:8]}", initial_peers=bootstrap_peers,
                params=cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"], batch=cfg["batch"], compute="sleep",
                compute_seconds=compute, target_batch_size=target, matchmaking_time=mm,
                averaging_timeout=cfg["averaging_timeout"], options=dict(VARIANTS[variant]), record_status=True,
                experiments=experiments,
                warmup_epochs=cfg["warmup_epochs"], measure_seconds=cfg["measure_epochs"] * epoch_seconds,
                max_seconds=cfg["max_seconds"], linger_seconds=min(epoch_seconds, 10.0))
    configs = [dict(peer, seed=i, snapshots=str(workdir / f"{name}_{i}")) for i in range(n)]
    records = run_peers(workdir, name, configs, timeout=cfg["max_seconds"] + 60)
    apart = dict(param_summary(compare_snapshots([c["snapshots"] for c in configs])),
                 rounds_not_averaged=rounds_not_averaged(records))
    idles = [peer_idle(r, cfg["warmup_epochs"]) for r in records]
    splits = [boundary_split(r, *r["window"]) for r in records]
    start = max(r["window"][0] for r in records)
    end = min(r["window"][1] for r in records)
    skews = arrival_skew(records, start, end)
    per_epoch = [i["idle"] / i["epochs"] for i in idles]
    shares = [i["idle"] / i["wall"] for i in idles]

    def pooled(key: str) -> list[float]:
        return [v for s in splits for v in s[key]]

    return dict(
        case=name, peers=n, variant=variant, impl=impl, experiments=experiments, matchmaking_time=mm,
        epoch_factor=factor,
        target_batch_size=target, epoch_s=median([i["wall"] / i["epochs"] for i in idles]),
        epochs=median([i["epochs"] for i in idles]),
        idle_per_epoch_s=median(per_epoch), idle_per_epoch_range=spread(per_epoch),
        idle_share=median(shares), idle_share_range=spread(shares),
        boundary_share=median([i["idle_boundary"] / i["idle"] if i["idle"] else 1.0 for i in idles]),
        plain_step_ms=1000 * median([i["plain_step"] for i in idles]),
        utilization=median([i["compute"] / i["wall"] for i in idles]),
        lead_s=median(pooled("lead")), lead_range=spread(pooled("lead")),
        wait_grads_s=median(pooled("wait_grads")), step_state_s=median(pooled("step_state")),
        boundary_s=median(pooled("boundary")), arrival_skew_s=median(skews), arrival_skew_range=spread(skews),
        out_of_sync=sum(1 for r in records for _, m in r.get("status", []) if m.startswith("Peer is out of sync")),
        **apart,
    )


def run(cfg: dict[str, Any], workdir: Path, log: Any = print) -> dict[str, Any]:
    """Every configured case against one bootstrap DHT, one after the other (``cases_at_once``: all at once, for the
    quick run, whose figures mean little and whose peers mostly wait for their rounds); a case that fails is reported
    with its error."""
    bootstrap, initial_peers = start_bootstrap(workdir)

    def one(case: dict[str, Any]) -> dict[str, Any]:
        try:
            row = run_case(workdir, initial_peers, case["peers"], case["variant"], case["epoch_factor"],
                           dict(cfg, **case.get("overrides", {})), impl=case.get("impl", "collabopt"))
        except Exception as e:  # keep going: one broken configuration must not hide the others
            row = dict(case, error=str(e).splitlines()[0][:300])
        log(f"B5 {row}")
        return row

    try:
        if cfg.get("cases_at_once"):
            with concurrent.futures.ThreadPoolExecutor(len(cfg["cases"])) as pool:
                rows = list(pool.map(one, cfg["cases"]))
        else:
            rows = [one(case) for case in cfg["cases"]]
    finally:
        bootstrap.kill_tree()
    return dict(rows=rows)
