"""B6's WAN part (:mod:`benchmarks.diloco`): 4 peers in network namespaces, ~5M parameters, simulated compute, in
the synchronous mode, fp16 DiLoCo and compressed DiLoCo; compute utilization and bytes sent per sample."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import median

OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)  # the outer optimizer (DiLoCo's)
# steps_per_epoch: each peer's steps per round / epoch (the target is peers x batch x steps_per_epoch samples). The
# bytes-per-sample ratio to the synchronous mode is about steps per round / steps per epoch x 2 (fp16 against fp32)
# less the overheads: 600 steps per round measured 90-102x (2026-11-26 11:05 UTC), too near the goal of 100x for a
# single run to settle; 2000 gives ~300x
DILOCO_WAN = dict(steps_per_epoch=2000, warmup_epochs=1, measure_epochs=2, outer=OUTER)
# compressed DiLoCo: SparseLoCo's defaults (pseudo_gradient_compression=SparseLoCo()) and its own outer step
SPARSE_WAN = dict(DILOCO_WAN, outer="sparseloco", sparse={})
OVERLAP = dict(options=dict(overlap_rounds=True))
WAN = dict(width=1024, in_dim=256, batch=32, params=5_000_000, compute_seconds=0.05, matchmaking_time=3.0,
           averaging_timeout=120.0, max_seconds=600, peers=4, rates=(20, 100),
           modes={"synchronous": dict(steps_per_epoch=10, warmup_epochs=1, measure_epochs=5),
                  "diloco": DILOCO_WAN,
                  "diloco + overlap": dict(DILOCO_WAN, **OVERLAP),
                  "sparse": SPARSE_WAN,
                  "sparse + overlap": dict(SPARSE_WAN, **OVERLAP)})


def run_wan(cfg: dict[str, Any], workdir: Path, log: Any = print) -> dict[str, Any]:
    from harness.testnet import unavailable_reason

    reason = unavailable_reason()
    if reason:
        log(f"B6 WAN skipped: {reason}")
        return dict(skipped=reason, rows=[])
    rows = []
    n = cfg["peers"]
    for rate in cfg["rates"]:
        for mode, settings in cfg["modes"].items():
            steps = settings["steps_per_epoch"]
            row: dict[str, Any] = dict(mode=mode, mbit=rate, peers=n, steps_per_round=steps)
            started = time.time()
            try:
                records = run_swarm(cfg, settings, rate, workdir, f"b6_{rate}_{mode.replace(' ', '')}")
                row.update(wan_figures(records, settings["warmup_epochs"], cfg["batch"]))
                row["payload_bytes"] = payload_bytes(settings, records[0]["grad_bytes"] // 4)
            except Exception as e:  # a failed case is reported, the others still run
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["wall_seconds"] = time.time() - started
            log(f"B6 WAN {rate} Mbit/s {mode}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                           for k, v in row.items() if k not in ("mode", "mbit")))
            rows.append(row)
    return dict(rows=rows)


def run_swarm(cfg: dict[str, Any], settings: dict[str, Any], rate: float | None, workdir: Path,
              name: str) -> list[dict[str, Any]]:
    """One swarm of ``cfg['peers']`` :mod:`benchmarks.peer` processes, each in a network namespace of its own
    (links at ``rate`` Mbit/s), in the mode ``settings`` (a value of ``WAN['modes']``); the peers' records.
    ``cfg['startup_seconds']``: how long the peers may take to start (beyond ``max_seconds``; B6: 90, and a peer
    waits 120 s for the others); ``cfg['peer_options']``: more of every peer's config (:mod:`benchmarks.peer`)."""
    from benchmarks.swarmrun import run_peers, start_bootstrap
    from harness.testnet import TestNet

    n, steps = cfg["peers"], settings["steps_per_epoch"]
    with TestNet(n, rate) as net:
        bootstrap, initial_peers = start_bootstrap(workdir, host=net.bootstrap_addr, netns=net.bootstrap)
        try:
            peer = dict(impl="collabopt", run_id=f"b6w_{uuid.uuid4().hex[:8]}",
                        initial_peers=initial_peers, params=cfg["params"], width=cfg["width"],
                        in_dim=cfg["in_dim"], batch=cfg["batch"], compute="sleep",
                        compute_seconds=cfg["compute_seconds"], target_batch_size=n * cfg["batch"] * steps,
                        matchmaking_time=cfg["matchmaking_time"],
                        averaging_timeout=cfg["averaging_timeout"], average_state_every=1000,
                        options=settings.get("options", {}), outer=settings.get("outer"),
                        sparse=settings.get("sparse"), join_timeout=cfg.get("startup_seconds", 120),
                        count_bytes=True, write_grads=True, warmup_epochs=settings["warmup_epochs"],
                        measure_epochs=settings["measure_epochs"], max_seconds=cfg["max_seconds"],
                        **cfg.get("peer_options", {}))
            return run_peers(workdir, name, [dict(peer, host=net.addr[i], seed=i) for i in range(n)],
                             timeout=cfg["max_seconds"] + cfg.get("startup_seconds", 90), netns=net.peers)
        finally:
            bootstrap.kill_tree()


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Bytes per sample at the same rate of the synchronous row over each DiLoCo row's (``fewer_bytes_than_
    synchronous``), and of fp16 DiLoCo's over each compressed row's (``fewer_bytes_than_fp16``: "sparse" against
    "diloco", "sparse + overlap" against "diloco + overlap")."""
    for rate in sorted({r["mbit"] for r in rows}):
        by_mode = {r["mode"]: r for r in rows if r["mbit"] == rate and "bytes_per_sample" in r}
        for mode, row in by_mode.items():
            for key, other in (("fewer_bytes_than_synchronous", "synchronous"),
                               ("fewer_bytes_than_fp16", mode.replace("sparse", "diloco"))):
                row.pop(key, None)
                if other in by_mode and other != mode:
                    row[key] = by_mode[other]["bytes_per_sample"] / row["bytes_per_sample"]


def payload_bytes(settings: dict[str, Any], params: int) -> int | None:
    """Bytes of one peer's contribution to a DiLoCo round (None in the synchronous mode): fp16 pseudo-gradients, or
    the longest SparseLoCo payload, which every member sends to every other: an upper bound, since its Rice-coded
    index gaps vary in length (a payload of Gaussian values is about 4% shorter)."""
    from collabopt.diloco_options import SparseLoCo

    if not settings.get("outer"):
        return None
    if settings.get("sparse") is None:
        return 2 * params
    return SparseLoCo(**settings["sparse"]).codec.payload_bytes(params)


def sparse_goals(rows: list[dict[str, Any]]) -> list[str]:
    """One line per compressed (sparse) row with its figures against the goal: >= 20x fewer bytes sent per sample
    than fp16 DiLoCo at the same rate, and, with overlap, compute utilization >= 0.98 (the mean and the lowest
    peer)."""
    lines = []
    for r in rows:
        if not r["mode"].startswith("sparse") or "fewer_bytes_than_fp16" not in r:
            continue
        checks = [f"{r['fewer_bytes_than_fp16']:.1f}x fewer bytes per sample than fp16 DiLoCo (goal >= 20x: "
                  f"{'met' if r['fewer_bytes_than_fp16'] >= 20 else 'not met'})"]
        if "fewer_bytes_than_synchronous" in r:
            checks.append(f"{r['fewer_bytes_than_synchronous']:,.0f}x fewer than sync")
        if "overlap" in r["mode"]:
            met = min(r["utilization"], r["utilization_min"]) >= 0.98
            checks.append(f"utilization {r['utilization']:.3f} mean, {r['utilization_min']:.3f} lowest peer "
                          f"(goal >= 0.98: {'met' if met else 'not met'})")
        if r.get("payload_bytes"):  # what a peer sent per round, against the payload it sends to the others
            payload = (r["peers"] - 1) * r["payload_bytes"]
            checks.append(f"sent per peer and round {r['bytes_per_peer_round'] / 1e3:,.0f} kB, of which the payload "
                          f"to the {r['peers'] - 1} others at most {payload / 1e3:,.0f} kB")
        lines.append(f"- {r['mbit']} Mbit/s {r['mode']}: " + "; ".join(checks))
    return lines


def wan_figures(records: list[dict[str, Any]], warmup_epochs: int, batch: int) -> dict[str, Any]:
    """Utilization, bytes sent per sample and rounds of one swarm, from the peers' records (benchmarks.peer)."""
    utilizations, sent, samples, rounds, overheads, longest = [], [], [], [], [], []
    for record in records:
        start, end = record["window"]
        steps = [s for s in record["steps"] if start <= s[0] <= end]
        # step() time beside the inner optimizer's step: collabopt's and hivemind's per-step work (median), and
        # the longest step (a round, or a wait for the round in flight)
        overheads.append(median([s[2] - (s[4] if len(s) > 4 else 0.0) for s in steps]))
        longest.append(max(s[2] for s in steps))
        compute = sum(s[1] + (s[4] if len(s) > 4 else 0.0) for s in steps)  # simulated compute + inner step
        utilizations.append(compute / (end - start))
        sent.append(record["net_bytes"][1] - record["net_bytes"][0])
        samples.append(len(steps) * batch)
        rounds.append(sum(1 for t, _ in record["epochs"] if start < t <= end))
    return dict(utilization=sum(utilizations) / len(utilizations), utilization_min=min(utilizations),
                bytes_per_sample=sum(sent) / sum(samples), rounds_in_window=min(rounds),
                bytes_per_peer_round=sum(sent) / max(1, sum(rounds)),
                step_overhead_ms=1e3 * median(overheads), longest_step_s=max(longest),
                window_seconds=median([r["window"][1] - r["window"][0] for r in records]))


# ---------------------------------------------------------------------------------------------- report


def steps_cell(row: dict[str, Any]) -> str:
    """A WAN row's steps per round (epoch): each peer's, and the swarm's (all peers compute at the same pace)."""
    return f"{row['steps_per_round']} / {row['steps_per_round'] * row['peers']}"


def report_lines(wan: dict[str, Any]) -> list[str]:
    """The WAN part of diloco.md."""
    lines: list[str] = []
    lines += ["## WAN bed: 4 peers in network namespaces, ~5M parameters, simulated compute", ""]
    if wan.get("skipped"):
        lines.append(f"Skipped: {wan['skipped']}")
    else:
        lines += ["| Mbit/s | mode | steps per round/epoch (each peer / swarm) | compute utilization (mean, min) "
                  "| step() overhead ms (median) | longest step s | bytes sent per sample "
                  "| fewer bytes per sample than sync | than fp16 DiLoCo |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in wan["rows"]:
            if "error" in r:
                lines.append(f"| {r['mbit']} | {r['mode']} | {steps_cell(r)} | error: "
                             f"{r['error'][:200]} | | | | | |")
                continue
            ratios = [f"{r[key]:,.{digits}f}x" if key in r else ""
                      for key, digits in (("fewer_bytes_than_synchronous", 0), ("fewer_bytes_than_fp16", 1))]
            lines.append(f"| {r['mbit']}{'†' if r.get('machine') else ''} | {r['mode']} | {steps_cell(r)} "
                         f"| {r['utilization']:.3f}, "
                         f"{r['utilization_min']:.3f} | {r['step_overhead_ms']:.1f} | {r['longest_step_s']:.1f} "
                         f"| {r['bytes_per_sample']:.1f} | {' | '.join(ratios)} |")
        lines += ["", "Goal: DiLoCo compute utilization >= 0.98 and >= 100x fewer bytes sent per sample. "
                  "Compute: the simulated compute (sleep) plus the inner optimizer's step() call (torch's "
                  "wrapper included, which a plain loop pays too); utilization: compute "
                  "over the wall time of a whole number of epochs / rounds after the first; bytes per sample: "
                  "what the 4 peers sent over the samples they trained on in those windows. Gradients travel in "
                  "fp32 in the synchronous mode (its default), pseudo-gradients in fp16 (DiLoCo's default)."]
        goals = sparse_goals(wan["rows"])
        if goals:
            lines += ["", "Compressed DiLoCo (\"sparse\": `SparseLoCo()`'s defaults and its outer step), goal: "
                      ">= 20x fewer bytes sent per sample than fp16 DiLoCo (\"diloco\", or \"diloco + overlap\" "
                      "for \"sparse + overlap\") and utilization >= 0.98 with overlap, lowest peer too:", "",
                      *goals]
        earlier = {str(r["machine"]) for r in wan["rows"] if r.get("machine")}
        if earlier:
            lines += ["", "Rows marked † are kept from an earlier run: " + "; ".join(sorted(earlier))
                      + ". Their ratios compare rows of two runs."]
    return lines
