"""Starting benchmark swarms (bootstrap DHT + peer processes, with :mod:`collabopt.processes`) and turning peer
records into figures."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, child_env, median, spawner, worst, write_json
from collabopt import processes
from collabopt.processes import Process


def start_bootstrap(workdir: Path, host: str = "127.0.0.1", netns: str | None = None) -> tuple[Process, str]:
    """Start ``collabopt dht`` (no relay) listening on ``host``; return it and its INITIAL_PEERS value."""
    return processes.start_bootstrap(workdir, name=f"bootstrap_{netns or 'lo'}", host=host, dht_args=["--no-relay"],
                                     env=child_env(), cwd=ROOT, netns=netns, spawn=spawner(netns))


def run_peers(workdir: Path, name: str, configs: list[dict[str, Any]], timeout: float,
              netns: list[str | None] | None = None, linger: float = 0.0) -> list[dict[str, Any]]:
    """Run one ``benchmarks.peer`` process per config at once; return their records (raises if one failed).

    The peers are killed as soon as every record is written (or after ``linger`` more seconds): a peer lingers
    after its own window only for the peers whose windows end later, and once every record is in, none does."""
    procs, outs, ready = [], [], []
    go = workdir / f"{name}.go"
    go.unlink(missing_ok=True)
    try:
        for i, cfg in enumerate(configs):
            if cfg.get("snapshots"):
                remove_snapshots(cfg["snapshots"])
            out = workdir / f"{name}_{i}.json"
            out.unlink(missing_ok=True)
            ready.append(workdir / f"{name}_{i}.ready")
            ready[-1].unlink(missing_ok=True)
            config_path = workdir / f"{name}_{i}.config.json"
            write_json(config_path, dict(cfg, out=str(out), ready_file=str(ready[-1]), go_file=str(go),
                                         launched=time.time()))
            ns = netns[i] if netns else None
            procs.append(Process([sys.executable, "-m", "benchmarks.peer", str(config_path)],
                                 workdir / f"{name}_{i}.log", env=child_env(), cwd=ROOT, netns=ns,
                                 spawn=spawner(ns)))
            outs.append(out)
        deadline = time.monotonic() + timeout
        wait_for_files(procs, ready, deadline, poll=0.1)
        go.touch()  # every peer has joined: start training together
        # a peer writes its record when its window ends, then lingers and leaves; don't wait for its shutdown (the
        # records hold everything measured: its CPU time and status lines were read at its window's end)
        wait_for_files(procs, outs, deadline)
        let_exit(procs, linger)
    finally:
        for p in procs:
            p.kill_tree()
    records = []
    for i, out in enumerate(outs):
        if not out.exists():
            raise RuntimeError(f"peer {name}_{i} wrote no record; log ends with:\n{procs[i].tail()}")
        records.append(json.loads(out.read_text()))
        if records[-1].get("error"):
            raise RuntimeError(f"peer {name}_{i}: {records[-1]['error']}; log ends with:\n{procs[i].tail()}")
    return records


def wait_for_files(procs: list[Process], files: list[Path], deadline: float, poll: float = 0.5) -> None:
    """Wait until each process wrote its file or ended, or until ``deadline`` (time.monotonic())."""
    while time.monotonic() < deadline and not all(f.exists() or p.poll() is not None
                                                  for p, f in zip(procs, files, strict=True)):
        time.sleep(poll)


def let_exit(procs: list[Process], seconds: float) -> None:
    """Give the processes up to ``seconds`` to exit by themselves (the caller kills what is left)."""
    grace = time.monotonic() + seconds
    while time.monotonic() < grace and any(p.poll() is None for p in procs):
        time.sleep(0.5)


# Peers of a swarm agree to float rounding: collabopt's all-reduce sends every member the same bytes of each averaged
# part (peers that apply the same rounds in the default mode end bit-identical), but where a round's result is added
# to a peer's local progress (the delta rule: use_local_updates with delay_state_averaging) peers can end ulps apart.
# One tolerance for every mode. Ranks of one node (parameters broadcast) and single-process equivalences are compared
# exactly.
SWARM_ROUNDING = 1e-6


def save_snapshot(prefix: str, epoch: int, params: list[Any]) -> None:
    """Write a peer's parameters (flattened, in order) as ``<prefix>_e<epoch>.pt``: the runner compares the peers'
    files at every epoch they all saved (:func:`parameter_differences`). Written whole or not at all (the runner
    kills the peers once their records are in, maybe during a write)."""
    import torch

    torch.save(torch.cat([p.detach().reshape(-1) for p in params]), f"{prefix}_e{epoch}.pt.tmp")
    os.replace(f"{prefix}_e{epoch}.pt.tmp", f"{prefix}_e{epoch}.pt")


def snapshot_paths(prefix: str) -> dict[int, Path]:
    """{epoch: file} of the snapshots :func:`save_snapshot` wrote as ``prefix`` (a path)."""
    return {int(p.stem.rsplit("_e", 1)[1]): p for p in Path(prefix).parent.glob(f"{Path(prefix).name}_e*.pt")}


def parameter_differences(paths: list[dict[int, Path]]) -> dict[int, float]:
    """{epoch: max |difference| between the peers' saved parameters} at every epoch all peers saved; NaN where a
    peer's parameters hold a NaN (:func:`worst`)."""
    import torch

    common = sorted(set.intersection(*(set(p) for p in paths)))
    diffs = {}
    for epoch in common:
        tensors = [torch.load(p[epoch]) for p in paths]
        diffs[epoch] = worst(float((t - tensors[0]).abs().max()) for t in tensors[1:]) if len(tensors) > 1 else 0.0
    return diffs


def remove_snapshots(prefix: str) -> None:
    """Remove the snapshots (and any half-written one) :func:`save_snapshot` wrote as ``prefix`` (a path): before a
    run (:func:`run_peers`), so that none of an earlier run in the same folder is compared, and after it."""
    for path in Path(prefix).parent.glob(f"{Path(prefix).name}_e*.pt*"):
        path.unlink(missing_ok=True)


def compare_snapshots(prefixes: list[str]) -> dict[int, float]:
    """:func:`parameter_differences` of the peers that saved snapshots as ``prefixes`` (their configs'
    ``snapshots``); their files are removed."""
    try:
        return parameter_differences([snapshot_paths(prefix) for prefix in prefixes])
    finally:
        for prefix in prefixes:
            remove_snapshots(prefix)


def param_summary(diffs: dict[Any, float]) -> dict[str, Any]:
    """The largest parameter difference between a swarm's peers over the epochs they all reached (:func:`worst`)
    and how many epochs were compared."""
    return dict(max_param_diff=worst(diffs.values()), epochs_compared=len(diffs))


def rounds_not_averaged(records: list[dict[str, Any]]) -> int:
    """The gradient rounds of collabopt peers (their records' ``rounds``) whose update was not the whole swarm's
    average ("no group", "alone", "partial", ...): after one, the peers step apart and are not expected equal."""
    return sum(1 for record in records for outcome in record.get("rounds", ())
               if outcome["reason"] != "averaged" or outcome["group_size"] < len(records))


def measured_window(record: dict[str, Any], warmup_epochs: int) -> tuple[float, float]:
    """(start, end) wall times of a peer's measured window: from its first epoch >= warmup to its last step."""
    if len(record["window"]) != 2:
        raise RuntimeError(f"peer reached no epoch >= {warmup_epochs} (final epoch {record['final_epoch']})")
    return record["window"][0], record["window"][1]


def throughput(records: list[dict[str, Any]], batch: int, warmup_epochs: int) -> float:
    """Samples per second of the swarm: the sum over peers of samples in their measured window / its length."""
    total = 0.0
    for record in records:
        start, end = measured_window(record, warmup_epochs)
        n = sum(1 for s in record["steps"] if s[0] >= start and s[0] + s[1] + s[2] <= end + 1e-6)
        total += n * batch / (end - start)
    return total


def utilization(records: list[dict[str, Any]], warmup_epochs: int) -> float:
    """Mean over peers of (seconds spent computing) / (wall seconds) in the measured window."""
    values = []
    for record in records:
        start, end = measured_window(record, warmup_epochs)
        values.append(sum(s[1] for s in record["steps"] if start <= s[0] <= end) / (end - start))
    return sum(values) / len(values)


def allreduce_seconds(records: list[dict[str, Any]], skip_first: int = 1) -> list[float]:
    """Durations of the gradient all-reduce rounds: from the last peer's trigger to the last peer done.

    A round is one event of every peer with triggers less than 10 s apart. The first ``skip_first`` events of
    each peer (joining, first matchmaking) and rounds that failed on some peer are left out.
    """
    per_peer = [[e for e in record["averaging"] if "done" in e][skip_first:] for record in records]
    durations = []
    for event in per_peer[0]:
        group = [event]
        for events in per_peer[1:]:
            close = [e for e in events if abs(e["trigger"] - event["trigger"]) < 10.0]
            if close:
                group.append(min(close, key=lambda e: abs(e["trigger"] - event["trigger"])))
        if len(group) == len(records) and all(e.get("ok") for e in group):
            durations.append(max(e["done"] for e in group) - max(e["trigger"] for e in group))
    return durations


def summarize_allreduce(durations: list[float]) -> float:
    return median(durations) if durations else float("nan")
