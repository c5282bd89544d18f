"""B7 scale: what a swarm of N peers costs each peer (N = 2, 4, 8, 16 on loopback), and how each cost grows in N.

    python -m benchmarks.scale                  # N = 2, 4, 8, 16 (about 10 minutes on 2 cores)
    python -m benchmarks.scale --sizes 16 --update   # one size, keeping the other sizes' rows of scale.json
    python -m benchmarks.scale --smoke          # N = 2 and 4, very short (the test's version; figures mean little)
    python -m benchmarks.scale --report         # only write scale.md and scale.png again from scale.json

Each swarm trains a tiny model (``Linear(16, 4)``: the swarm machinery is measured, not compute) with
:class:`~collabopt.CollaborativeOptimizer` in the synchronous mode, compute simulated by sleeping, every peer a full
DHT peer (no ``client_mode``), epochs of a fixed ``target_batch_size`` for every N. Each peer is an OS process
(:mod:`benchmarks.scale_peer`) and measures a window of whole global epochs after a warm-up: its DHT traffic by key
(:mod:`benchmarks.dht_traffic`), the CPU seconds of its DHT, averager, p2pd and training processes, its boundaries and
the group sizes of its rounds. Then 4 late joiners start at once and time their download of the swarm's state.
Every figure is then fitted as ``a * N^b`` (least squares on log-log); :mod:`benchmarks.scale_report` writes
``benchmarks/results/scale.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from benchmarks import scale_report
from benchmarks.common import ROOT, child_env, machine_info, spawner, write_json
from benchmarks.swarmrun import start_bootstrap
from collabopt.processes import Process

RESULTS = ROOT / "benchmarks" / "results"
# every peer: 16 samples per step of 0.1 s of simulated compute (160 samples/s); the target fills in 4 s at N = 16,
# 32 s at N = 2 (more than a matchmaking_time: the gradient round is pre-scheduled at every N)
FULL: dict[str, Any] = dict(sizes=[2, 4, 8, 16], joiners=4, batch=16, compute_seconds=0.1, target_batch_size=10240,
                            matchmaking_time=3.0, averaging_timeout=20.0, warmup_epochs=1, measure_epochs=3,
                            max_seconds=330, join_seconds=120)
# the smoke version (the test's): 2 joiners, not 4 (every process's start, imports included, costs 1.5 s on 2 cores)
SMOKE: dict[str, Any] = dict(FULL, sizes=[2, 4], joiners=2, target_batch_size=480, matchmaking_time=1.0,
                             averaging_timeout=10.0, measure_epochs=1, max_seconds=60, join_seconds=40)


def _start(workdir: Path, name: str, config: dict[str, Any]) -> Process:
    path = workdir / f"{name}.config.json"
    write_json(path, config)
    return Process([sys.executable, "-m", "benchmarks.scale_peer", str(path)], workdir / f"{name}.log",
                   env=child_env(), cwd=ROOT, spawn=spawner())


def _wait(paths: list[Path], procs: list[Process], timeout: float) -> bool:
    """Wait until every path exists (or its process exited); whether every path exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() or proc.poll() is not None for p, proc in zip(paths, procs, strict=True)):
            break
        time.sleep(0.2)
    return all(p.exists() for p in paths)


def _read(path: Path, proc: Process, name: str) -> dict[str, Any]:
    if not path.exists():
        return dict(error=f"{name} wrote no record (exit {proc.poll()}); log ends with: {proc.tail()[-600:]}")
    return json.loads(path.read_text())


def _busy_share(before: Any, after: Any) -> float:
    """The share of the machine's CPU time that was busy between two ``psutil.cpu_times()``."""
    total = sum(after) - sum(before)
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0.0) - getattr(before, "iowait", 0.0))
    return 1.0 - idle / total if total > 0 else float("nan")


def run_size(workdir: Path, n: int, cfg: dict[str, Any], initial_peers: str) -> dict[str, Any]:
    """A swarm of ``n`` peers and then its ``cfg['joiners']`` late joiners; returns the size's row."""
    workdir.mkdir(parents=True, exist_ok=True)
    files = {name: workdir / name for name in ("go", "join", "stop")}
    for path in files.values():
        path.unlink(missing_ok=True)
    base = dict(run_id=f"bench_b7_{n}_{uuid.uuid4().hex[:8]}", initial_peers=initial_peers,
                **{k: cfg[k] for k in ("batch", "compute_seconds", "target_batch_size", "matchmaking_time",
                                       "averaging_timeout", "warmup_epochs", "measure_epochs", "max_seconds")},
                peers=n, stop_file=str(files["stop"]), join_timeout=cfg["max_seconds"] + 300)
    names = [f"m{i}" for i in range(n)] + [f"j{i}" for i in range(cfg["joiners"])]
    outs = {name: workdir / f"{name}.json" for name in names}
    ready = {name: workdir / f"{name}.ready" for name in names}
    procs: dict[str, Process] = {}
    started = time.monotonic()
    try:
        for name in names:  # the joiners start now too, and wait for the join file with torch and hivemind loaded
            member = name.startswith("m")
            outs[name].unlink(missing_ok=True)
            ready[name].unlink(missing_ok=True)
            procs[name] = _start(workdir, name, dict(
                base, role="member" if member else "joiner", seed=len(procs), out=str(outs[name]),
                ready_file=str(ready[name]), go_file=str(files["go" if member else "join"])))
        members, joiners = names[:n], names[n:]
        startup = 60.0 + 10.0 * len(names)
        if not _wait([ready[m] for m in names], [procs[m] for m in names], startup):
            late = [m for m in names if not ready[m].exists()]
            why = _read(outs[late[0]], procs[late[0]], late[0]).get("error")
            return dict(peers=n, error=f"not started in {startup:.0f} s: {late}; {why}")
        joined_at, load, cpu = time.monotonic(), os.getloadavg()[0], psutil.cpu_times()
        files["go"].touch()
        _wait([outs[m] for m in members], [procs[m] for m in members], cfg["max_seconds"] + 30)
        measured, busy = time.monotonic(), _busy_share(cpu, psutil.cpu_times())
        files["join"].touch()  # the late joiners start at once
        _wait([outs[j] for j in joiners], [procs[j] for j in joiners], cfg["join_seconds"])
        files["stop"].touch()
        done = time.monotonic()
    finally:
        for proc in procs.values():
            proc.kill_tree()
    records = [_read(outs[m], procs[m], m) for m in members]
    late = [_read(outs[j], procs[j], j) for j in joiners]
    row = scale_report.summarize(n, records, late)
    row["wall_s"] = dict(start=round(joined_at - started, 1), train=round(measured - joined_at, 1),
                         join=round(done - measured, 1))
    row["machine_busy"], row["load_avg_at_go"] = busy, load  # (the whole machine's, other users' work included)
    return row


def run(cfg: dict[str, Any], workdir: Path, log: Any = print) -> dict[str, Any]:
    """Every size of ``cfg['sizes']`` against one bootstrap DHT, smallest first; a size that fails gets its error.
    The smoke runs its sizes at once, each swarm with a bootstrap DHT of its own (its figures mean little; 23 s ->
    14 s on 2 cores)."""
    results: dict[str, Any] = dict(machine=machine_info(), config=cfg, rows=[])

    def one(n: int, initial_peers: str) -> dict[str, Any]:
        start = time.monotonic()
        try:
            row = run_size(workdir / f"n{n}", n, cfg, initial_peers)
        except Exception as e:  # keep going: a size that breaks must not hide the others
            row = dict(peers=n, error=f"{type(e).__name__}: {e}"[:600])
        row["seconds"] = round(time.monotonic() - start, 1)
        log(f"B7 N={n}: {scale_report.one_line(row)} ({row['seconds']} s)")
        return row

    if cfg.get("smoke"):
        def alone(n: int) -> dict[str, Any]:
            bootstrap, initial_peers = start_bootstrap(workdir / f"n{n}")
            try:
                return one(n, initial_peers)
            finally:
                bootstrap.kill_tree()

        for n in cfg["sizes"]:
            (workdir / f"n{n}").mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(len(cfg["sizes"])) as pool:
            results["rows"] = list(pool.map(alone, cfg["sizes"]))
        return results
    bootstrap, initial_peers = start_bootstrap(workdir)
    try:
        results["rows"] = [one(n, initial_peers) for n in cfg["sizes"]]
    finally:
        bootstrap.kill_tree()
    return results


def merge(results: dict[str, Any], previous: Path) -> dict[str, Any]:
    """``results`` with the rows of the sizes it did not run taken from ``previous`` (an earlier scale.json)."""
    if not previous.exists():
        return results
    old = json.loads(previous.read_text())
    ran = {row["peers"] for row in results["rows"]}
    kept = [row for row in old.get("rows", []) if row["peers"] not in ran]
    if kept:
        results["rows"] = sorted(results["rows"] + kept, key=lambda row: row["peers"])
        results["machine"]["earlier_runs"] = sorted({*old["machine"].get("earlier_runs", []),
                                                     old["machine"]["date_utc"]})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="N = 2 and 4, very short (checks the harness only)")
    parser.add_argument("--sizes", default=None, help="comma-separated swarm sizes (default: 2,4,8,16; smoke 2,4)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write scale.{json,md,png} (default: benchmarks/results; smoke: --workdir)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and records here")
    parser.add_argument("--update", action="store_true", help="keep the rows of other sizes from --out's scale.json")
    parser.add_argument("--report", action="store_true", help="only write the report again from --out's scale.json")
    args = parser.parse_args(argv)
    if args.report:
        out = args.out or RESULTS
        scale_report.write(json.loads((out / "scale.json").read_text()), out)
        return 0
    cfg = dict(SMOKE if args.smoke else FULL, smoke=args.smoke)
    if args.sizes:
        cfg["sizes"] = sorted(int(s) for s in args.sizes.split(",") if s.strip())

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    with tempfile.TemporaryDirectory(prefix="collabopt-scale-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        out = args.out or (workdir if args.smoke else RESULTS)
        results = run(cfg, workdir, log)
        if args.update:
            results = merge(results, out / "scale.json")
        for path in scale_report.write(results, out):
            log(f"wrote {path}")
        print(scale_report.markdown(results))
    return 1 if any("error" in row for row in results["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
