"""Each side on its own defaults: 2 collabopt peers against 2 raw ``hivemind.Optimizer`` peers, as a new user writes
them (issue 45's check "2 peers on each side's defaults").

B1 (benchmarks/overhead.py) gives both sides the same settings; here each side gets only what its documentation
asks for. raw hivemind::

    dht = hivemind.DHT(start=True, initial_peers=[...])
    opt = hivemind.Optimizer(dht=dht, run_id=..., batch_size_per_step=32, target_batch_size=T,
                             optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), verbose=False)

collabopt, the plain PyTorch adapter of README.md (samples counted from the model's forward calls)::

    copt = collaborate(model, torch.optim.Adam(model.parameters(), lr=1e-3), run_id=..., target_batch_size=T,
                       initial_peers=[...])

Both swarms train B1's model (the ~0.93M-parameter MLP of benchmarks/peer.py, one fixed random batch of 32 per peer)
with **real** forward and backward passes (one intra-op thread per peer), at the same time against one bootstrap DHT
on loopback, so that whatever else the machine does slows both alike. Each swarm is pinned to its own half of the
CPUs (``taskset``, swapped every session): side by side on shared cores, the time one side spends waiting (for its
matchmaking) would otherwise go to the other side's compute. Each peer measures ``measure_epochs`` whole
global epochs after ``warmup_epochs``; every peer keeps training until all four have finished their windows, so that
the load stays the same for both swarms to the end. Per side: samples/s = the sum over its peers of (samples in the
window / the window's seconds). At every epoch a peer reaches it saves its parameters; the runner compares the two
peers of each side at every epoch both reached (max |difference|).

    python -m benchmarks.defaults            # 3 sessions, about 12 minutes; writes benchmarks/results/defaults.*
    python -m benchmarks.defaults --quick    # checks the harness (writes nothing)
    python -m benchmarks.defaults --peer CONFIG.json   # one peer (the runner starts them)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, child_env, machine_info, make_mlp, median, num_params, worst, write_json
from benchmarks.swarmrun import (
    SWARM_ROUNDING,
    compare_snapshots,
    let_exit,
    remove_snapshots,
    save_snapshot,
    start_bootstrap,
    wait_for_files,
)
from collabopt.processes import Process

RESULTS = ROOT / "benchmarks" / "results"
IMPLS = ("hivemind", "collabopt")
GOAL = 1.0  # collabopt's samples/s over hivemind's

# target_batch_size: a collabopt epoch of about 8 s here (twice its matchmaking_time) and about 8 s of compute per
# hivemind epoch; hivemind's own waits come on top of that (its matchmaking_time is 15 s)
FULL: dict[str, Any] = dict(params=1_000_000, width=512, in_dim=256, batch=32, lr=1e-3, target_batch_size=40_000,
                            peers=2, warmup_epochs=1, measure_epochs=10, sessions=3, max_seconds=330)
QUICK: dict[str, Any] = dict(FULL, params=100_000, width=256, target_batch_size=3_000, measure_epochs=2, sessions=1,
                             max_seconds=120)


# ---------------------------------------------------------------- one peer (its own process)

def peer_main(config_path: str) -> None:
    import torch
    import torch.nn.functional as F

    cfg = json.loads(Path(config_path).read_text())
    torch.manual_seed(0)
    model = make_mlp(cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"])
    g = torch.Generator().manual_seed(cfg["seed"])
    x, y = torch.randn(cfg["batch"], cfg["in_dim"], generator=g), torch.randint(0, 16, (cfg["batch"],), generator=g)
    inner = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    if cfg["impl"] == "hivemind":
        import hivemind

        dht = hivemind.DHT(start=True, initial_peers=[cfg["initial_peers"]])
        opt = hivemind.Optimizer(dht=dht, run_id=cfg["run_id"], batch_size_per_step=cfg["batch"],
                                 target_batch_size=cfg["target_batch_size"], optimizer=inner, verbose=False)

        def close() -> None:
            opt.shutdown()
            dht.shutdown()
    else:
        from collabopt.integrations.pytorch import collaborate

        opt = collaborate(model, inner, run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"],
                          initial_peers=[cfg["initial_peers"]])
        close = opt.close
    Path(cfg["ready_file"]).touch()
    go, stop = Path(cfg["go_file"]), Path(cfg["stop_file"])
    deadline = time.monotonic() + cfg["max_seconds"]
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    steps: list[tuple[float, float]] = []  # (wall time the step ended, samples)
    epochs: list[tuple[float, int]] = []  # (wall time, epoch reached)
    window: list[float] = []
    start_epoch = -1
    done = False
    try:
        while time.monotonic() < deadline and not stop.exists():
            F.cross_entropy(model(x), y).backward()
            before = opt.local_epoch
            opt.step()
            opt.zero_grad()
            now, epoch = time.time(), opt.local_epoch
            if not done:
                steps.append((now, cfg["batch"]))
            if epoch == before:
                continue
            epochs.append((now, epoch))
            save_snapshot(cfg["snapshots"], epoch, list(model.parameters()))
            if not window and epoch >= cfg["warmup_epochs"]:
                window.append(now)
                start_epoch = epoch
            elif window and not done and epoch >= start_epoch + cfg["measure_epochs"]:
                window.append(now)
                done = True
                write_json(cfg["out"], dict(impl=cfg["impl"], steps=steps, epochs=epochs, window=window,
                                            window_epochs=[start_epoch, epoch]))
        if not done:
            write_json(cfg["out"], dict(impl=cfg["impl"], epochs=epochs,
                                        error=f"the window did not end (final epoch {opt.local_epoch})"))
    finally:
        close()


# ---------------------------------------------------------------- figures (pure: unit-tested)

def window_rate(record: dict[str, Any]) -> float:
    """A peer's samples/s over its window: the samples of the steps that ended in (start, end], over end - start."""
    start, end = record["window"]
    samples = sum(n for t, n in record["steps"] if start < t <= end + 1e-6)
    return samples / (end - start)


def epoch_seconds(record: dict[str, Any]) -> float:
    """Median seconds between this peer's epoch transitions inside its window."""
    start, end = record["window"]
    times = [t for t, _ in record["epochs"] if start - 1e-6 <= t <= end + 1e-6]
    return median([b - a for a, b in zip(times[:-1], times[1:], strict=True)])


def summarize(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [s["ratio"] for s in sessions]
    largest = worst(s["collabopt"]["max_param_diff"] for s in sessions)
    compared = sum(s["collabopt"]["epochs_compared"] for s in sessions)
    return dict(ratio_median=median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                collabopt_max_param_diff=largest, collabopt_epochs_compared=compared,
                ratio_met=median(ratios) >= GOAL and min(ratios) >= GOAL,
                params_met=compared > 0 and largest <= SWARM_ROUNDING)


# ---------------------------------------------------------------- the runner

def cpu_halves(session: int) -> dict[str, list[int]]:
    """The CPUs of each side's peers: each swarm gets its own half of this process's CPUs (swapped every session),
    so that one side's idle waits (matchmaking) do not hand CPU time to the other side's real compute. Empty lists
    (no pinning) on a single CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {impl: [] for impl in IMPLS}
    halves = [cpus[:len(cpus) // 2], cpus[len(cpus) // 2:]]
    if session % 2:
        halves.reverse()
    return dict(zip(IMPLS, halves, strict=True))


def run_session(cfg: dict[str, Any], workdir: Path, initial_peers: str, session: int) -> dict[str, Any]:
    name = f"defaults_{session}"
    pinned = cpu_halves(session) if cfg.get("pin_cpus", True) else {impl: [] for impl in IMPLS}
    go, stop = workdir / f"{name}.go", workdir / f"{name}.stop"
    procs, outs, ready, snaps = [], [], [], []
    try:
        for impl in IMPLS:
            run_id = f"bench_defaults_{impl}_{uuid.uuid4().hex[:8]}"
            for seed in range(cfg["peers"]):
                tag = f"{name}_{impl}_{seed}"
                peer = dict({k: cfg[k] for k in ("params", "width", "in_dim", "batch", "lr", "target_batch_size",
                                                 "warmup_epochs", "measure_epochs", "max_seconds")},
                            impl=impl, run_id=run_id, seed=seed, initial_peers=initial_peers,
                            out=str(workdir / f"{tag}.json"), ready_file=str(workdir / f"{tag}.ready"),
                            go_file=str(go), stop_file=str(stop), snapshots=str(workdir / tag))
                remove_snapshots(peer["snapshots"])  # (none of an earlier run in this folder)
                write_json(workdir / f"{tag}.config.json", peer)
                pin = ["taskset", "-c", ",".join(map(str, pinned[impl]))] if pinned[impl] else []
                procs.append(Process([*pin, sys.executable, "-m", "benchmarks.defaults", "--peer",
                                      str(workdir / f"{tag}.config.json")], workdir / f"{tag}.log",
                                     env=child_env(), cwd=ROOT))
                outs.append(Path(peer["out"]))
                ready.append(Path(peer["ready_file"]))
                snaps.append(peer["snapshots"])
        deadline = time.monotonic() + cfg["max_seconds"] + 60
        wait_for_files(procs, ready, deadline, poll=0.1)
        go.touch()  # both swarms start training together
        wait_for_files(procs, outs, deadline)
        stop.touch()  # every window has ended: all peers stop together
        let_exit(procs, 20)
    finally:
        for p in procs:
            p.kill_tree()
    records = []
    for proc, out in zip(procs, outs, strict=True):
        record = json.loads(out.read_text()) if out.exists() else dict(error="wrote no record")
        if record.get("error"):
            raise RuntimeError(f"{out.stem}: {record['error']}; log ends with:\n{proc.tail()}")
        records.append(record)
    result: dict[str, Any] = {}
    peers = cfg["peers"]
    for k, impl in enumerate(IMPLS):
        own, prefixes = records[k * peers:(k + 1) * peers], snaps[k * peers:(k + 1) * peers]
        diffs = compare_snapshots(prefixes)
        result[impl] = dict(samples_per_s=sum(window_rate(r) for r in own),
                            epoch_seconds=median([epoch_seconds(r) for r in own]),
                            windows=[r["window_epochs"] for r in own], epochs_compared=len(diffs),
                            max_param_diff=worst(diffs.values()),
                            epochs_apart=[e for e, d in diffs.items() if d > SWARM_ROUNDING],
                            param_diffs={str(e): d for e, d in diffs.items()})
    result["ratio"] = result["collabopt"]["samples_per_s"] / result["hivemind"]["samples_per_s"]
    result["cpus"] = pinned
    return result


def run(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    bootstrap, initial_peers = start_bootstrap(workdir)
    sessions = []
    try:
        for session in range(cfg["sessions"]):
            sessions.append(run_session(cfg, workdir, initial_peers, session))
            print(json.dumps({k: sessions[-1][k] if k == "ratio" else
                              {f: v for f, v in sessions[-1][k].items() if f != "param_diffs"}
                              for k in ("ratio", *IMPLS)}), flush=True)
    finally:
        bootstrap.kill_tree()
    return dict(sessions=sessions, **summarize(sessions))


def dirty_code() -> list[str]:
    """Uncommitted changes to the code under measure (the working tree is shared by several writers)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "collabopt", "integrations"], cwd=ROOT,
                         capture_output=True, text=True, timeout=10).stdout
    return [line[3:] for line in out.splitlines()]


def report(result: dict[str, Any]) -> str:
    m, c, s = result["machine"], result["config"], result
    dirty = result["dirty"]
    code = f"`{m['git_commit']}`" + (f" plus uncommitted changes to {', '.join(dirty)}" if dirty else "")
    lines = [
        "# Each side on its own defaults: collabopt against raw hivemind.Optimizer, 2 peers each", "",
        "`python -m benchmarks.defaults` (benchmarks/defaults.py; raw figures in `defaults.json`). Each side is "
        "written as its documentation shows, with nothing else set: `hivemind.Optimizer(dht=hivemind.DHT(start=True, "
        "initial_peers=...), run_id=..., batch_size_per_step=32, target_batch_size=T, "
        "optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), verbose=False)` against "
        "`collaborate(model, torch.optim.Adam(model.parameters(), lr=1e-3), run_id=..., target_batch_size=T, "
        "initial_peers=...)` (collabopt.integrations.pytorch). hivemind's defaults: `matchmaking_time` 15 s, "
        "`averaging_timeout` 60 s, `delay_state_averaging=True`; collabopt's: 5 s, 30 s, False.", "",
        f"Settings: the MLP of B1 ({num_params(make_mlp(c['params'], width=c['width'], in_dim=c['in_dim'])):,} "
        f"parameters), one fixed random batch of {c['batch']} per peer, **real** forward and backward passes (one "
        f"intra-op thread per peer), T = `target_batch_size` = {c['target_batch_size']:,}, {c['peers']} peers per "
        f"side, both swarms at the same time on loopback against one bootstrap DHT, each swarm pinned to its own "
        f"half of the CPUs (swapped every session: one side's waits do not lend CPU time to the other's compute), "
        f"{c['sessions']} sessions of "
        f"fresh swarms; each peer measures {c['measure_epochs']} whole global epochs after epoch "
        f"{c['warmup_epochs']}, and all peers keep training until every window has ended.", "",
        f"Host `{m['host']}` ({m['cpu']}, {m['cpus']} CPUs), {m['date_utc']}, load {m['load_avg_1m_at_start']} at "
        f"the start; torch {m['torch']}, hivemind {m['hivemind']}, collabopt {m['collabopt']}, code of {code}.", "",
        "| session | hivemind samples/s | collabopt samples/s | ratio collabopt/hivemind | epoch s (hivemind / "
        "collabopt) | collabopt peers: max abs param diff (epochs compared) | hivemind peers (record only) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(s["sessions"]):
        h, o = r["hivemind"], r["collabopt"]
        lines.append(f"| {i + 1} | {h['samples_per_s']:.0f} | {o['samples_per_s']:.0f} | {r['ratio']:.3f} | "
                     f"{h['epoch_seconds']:.1f} / {o['epoch_seconds']:.1f} | {o['max_param_diff']:.3g} "
                     f"({o['epochs_compared']}) | {h['max_param_diff']:.3g} ({h['epochs_compared']}; "
                     f"{len(h['epochs_apart'])} apart) |")
    verdict = {True: "met", False: "**not met**"}
    lines += [
        "",
        f"Median ratio **{s['ratio_median']:.3f}** (range {s['ratio_min']:.3f}–{s['ratio_max']:.3f}); goal ≥ {GOAL} "
        f"in every session: {verdict[s['ratio_met']]}. collabopt's peers, at every epoch both reached: max |param "
        f"difference| {s['collabopt_max_param_diff']:.3g} over {s['collabopt_epochs_compared']} epochs (goal: 0 or "
        f"≤ {SWARM_ROUNDING:g}, float rounding): {verdict[s['params_met']]}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 session: checks the harness")
    parser.add_argument("--peer", metavar="CONFIG", help="run one peer (started by the runner)")
    parser.add_argument("--trial", nargs=3, type=int, metavar=("SESSIONS", "EPOCHS", "TARGET"),
                        help="FULL with these sessions, measured epochs and target_batch_size (writes nothing)")
    args = parser.parse_args(argv)
    if args.peer:
        peer_main(args.peer)
        return 0
    cfg = QUICK if args.quick else FULL
    if args.trial:
        cfg = dict(FULL, sessions=args.trial[0], measure_epochs=args.trial[1], target_batch_size=args.trial[2])
    machine, dirty = machine_info(), dirty_code()
    with tempfile.TemporaryDirectory(prefix="collabopt_defaults_") as workdir:
        result = dict(run(cfg, Path(workdir)), config=cfg, machine=machine, dirty=dirty)
    print(report(result))
    if cfg is FULL:
        write_json(RESULTS / "defaults.json", result)
        (RESULTS / "defaults.md").write_text(report(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    if "--peer" in sys.argv:
        os._exit(code)  # skip hivemind's noisy interpreter-exit finalizers; everything was shut down
    raise SystemExit(code)
