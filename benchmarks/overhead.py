"""B1 wrapper overhead: swarm samples/s of collabopt peers against raw ``hivemind.Optimizer`` peers, side by side.

Two swarms of 2 peers each, one of collabopt and one of raw hivemind with the same configuration (same MLP,
batch, target batch size, timeouts, background parameter averaging), run **at the same time** against one
bootstrap DHT, so that whatever else the machine does slows both alike. Peers "compute" by sleeping (a stand-in
for GPU work: the result does not depend on how busy the shared CPUs are) and report fixed gradients.

A round is one global epoch: for the k-th measured epoch of each swarm, samples/s = sum over its peers of
(samples computed in that epoch / the epoch's wall time on that peer), and the round's figure is collabopt / hivemind.
Epochs give many short rounds that are aligned with what a swarm does (an epoch always contains one boundary), so the
boundaries do not add the quantization noise of fixed time windows. ``sessions`` repeats this with fresh swarms.

Second figure: CPU time (user + system of each peer's process tree: main process, averagers, DHT daemons) per
sample over the measured window, collabopt / hivemind.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import median, spread
from benchmarks.swarmrun import compare_snapshots, param_summary, rounds_not_averaged, run_peers, start_bootstrap


def epoch_rates(record: dict[str, Any], batch: int, first_epoch: int) -> dict[int, float]:
    """This peer's samples/s in each complete epoch >= ``first_epoch`` before its window ended."""
    transitions = {epoch: t for t, epoch in record["epochs"]}
    end = record["window"][1]
    rates = {}
    for epoch in sorted(transitions):
        if epoch < first_epoch or epoch + 1 not in transitions or transitions[epoch + 1] > end:
            continue
        start, stop = transitions[epoch], transitions[epoch + 1]
        # steps that finished in (start, stop]: the epoch's own steps and the step that ended it
        n = sum(1 for s in record["steps"] if start < s[0] + s[1] + s[2] <= stop + 1e-6)
        rates[epoch] = n * batch / (stop - start)
    return rates


def swarm_rates(records: list[dict[str, Any]], batch: int, first_epoch: int) -> list[float]:
    """Samples/s of the swarm per epoch (the epochs every peer completed), in epoch order."""
    per_peer = [epoch_rates(r, batch, first_epoch) for r in records]
    common = sorted(set.intersection(*(set(p) for p in per_peer)))
    return [sum(p[e] for p in per_peer) for e in common]


def cpu_per_sample(records: list[dict[str, Any]], batch: int) -> float:
    """CPU seconds of the swarm's process trees per sample, over the peers' measured windows."""
    cpu = samples = 0.0
    for r in records:
        if len(r.get("cpu", [])) != 2:
            return float("nan")
        start, end = r["window"]
        cpu += r["cpu"][1] - r["cpu"][0]
        samples += batch * sum(1 for s in r["steps"] if start < s[0] + s[1] + s[2] <= end + 1e-6)
    return cpu / samples if samples else float("nan")


def run(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    batch, compute = cfg["batch"], cfg["compute_seconds"]
    peers = cfg.get("peers", 2)
    target = int(peers * batch * cfg["epoch_seconds"] / compute)
    bootstrap, initial_peers = start_bootstrap(workdir)
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    rates: dict[str, list[float]] = {"hivemind": [], "collabopt": []}
    cpu: dict[str, list[float]] = {"hivemind": [], "collabopt": []}
    apart: dict[str, dict[str, float]] = {"hivemind": {}, "collabopt": {}}  # {session.epoch: max difference}
    not_averaged = 0  # collabopt's rounds whose update was not the swarm's average (its peers step apart)
    try:
        for session in range(cfg["sessions"]):
            configs = []
            for impl in ("hivemind", "collabopt"):
                peer = dict(impl=impl, run_id=f"bench_b1_{impl}_{uuid.uuid4().hex[:8]}", initial_peers=initial_peers,
                            params=cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"], batch=batch,
                            compute="sleep", compute_seconds=compute, target_batch_size=target,
                            matchmaking_time=cfg["matchmaking_time"], averaging_timeout=cfg["averaging_timeout"],
                            warmup_epochs=cfg["warmup_epochs"],
                            measure_seconds=(cfg["rounds_per_session"] + 1) * cfg["epoch_seconds"] * 1.3,
                            measure_epochs=cfg.get("measure_epochs"),  # (if set: whole epochs, not seconds)
                            max_seconds=cfg["max_seconds"],
                            # the same config on both sides, spelled out: hivemind's default background averaging
                            options=dict(delay_state_averaging=True))
                configs += [dict(peer, seed=s, snapshots=str(workdir / f"b1_{session}_{impl}_{s}"))
                            for s in range(peers)]
            records = run_peers(workdir, f"b1_{session}", configs, timeout=cfg["max_seconds"] + 60)
            by_impl = {"hivemind": records[:peers], "collabopt": records[peers:]}
            per_epoch = {impl: swarm_rates(rs, batch, cfg["warmup_epochs"]) for impl, rs in by_impl.items()}
            n = min(len(v) for v in per_epoch.values())
            for impl in per_epoch:
                rates[impl] += per_epoch[impl][:n]
                cpu[impl].append(cpu_per_sample(by_impl[impl], batch))
            for impl in apart:
                diffs = compare_snapshots([c["snapshots"] for c in configs if c["impl"] == impl])
                apart[impl].update({f"{session}.{epoch}": d for epoch, d in diffs.items()})
            not_averaged += rounds_not_averaged(by_impl["collabopt"])
            ratios += [c / h for c, h in zip(per_epoch["collabopt"][:n], per_epoch["hivemind"][:n], strict=True)]
            cpu_ratios.append(cpu["collabopt"][-1] / cpu["hivemind"][-1])
    finally:
        bootstrap.kill_tree()
    if len(ratios) < 1:
        raise RuntimeError("no epoch completed by both swarms in the measured windows")
    return dict(target_batch_size=target, rounds=len(ratios), ratio=median(ratios), ratio_range=spread(ratios),
                round_ratios=ratios, hivemind_samples_per_s=median(rates["hivemind"]),
                collabopt_samples_per_s=median(rates["collabopt"]),
                cpu_ratio=median(cpu_ratios), cpu_ratio_range=spread(cpu_ratios),
                hivemind_cpu_ms_per_sample=1000 * median(cpu["hivemind"]),
                collabopt_cpu_ms_per_sample=1000 * median(cpu["collabopt"]),
                collabopt_rounds_not_averaged=not_averaged,
                **{f"{impl}_{key}": value for impl in apart for key, value in param_summary(apart[impl]).items()})
