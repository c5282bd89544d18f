"""``python3 scripts/dev.py gpu-check``: the prepared check for a lent GPU machine (issue 34).

Three parts, each a ratio against a baseline of the same run on the same card (the card is named in the report):

1. **AMP swarms** (:mod:`benchmarks.gpu_swarm`): 3 peer processes share the GPU through 5 cases (plain loop with
   fp16 autocast and ``torch.amp.GradScaler``, bf16 autocast, Lightning ``16-mixed``, Accelerate ``fp16``, DiLoCo
   with fp16 autocast); each peer injects one overflow. Checked per case: the peers end in sync (their parameters
   right after the last common epoch within :data:`SYNC_TOLERANCE`), every peer's loss fell, every peer skipped
   samples (its overflow step), and every peer's parameters were finite after every round (no inf/NaN reached it).
2. **Local-step cost** (:mod:`benchmarks.gpu_step`): a ~100M-parameter GPT-like transformer, timed with CUDA events,
   collabopt (default, ``reuse_grad_buffers``) and raw hivemind against plain torch in fp16 and bf16, interleaved.
3. **GPU memory** (:mod:`benchmarks.gpu_memory`): ``torch.cuda.max_memory_allocated`` against plain torch for the
   default mode, ``offload_optimizer`` and DiLoCo, with collabopt's documented buffers and where they live.

With CUDA it writes ``benchmarks/results/gpu.md`` and ``gpu.json`` (or into ``--out``). Without CUDA it runs the
**CPU smoke version** (tiny models, 2 peers, few steps, bf16 autocast standing in for fp16) and writes into a
temporary folder (or ``--out``), never over the committed results; tests/swarm/test_gpu_check.py runs it. The smoke
version runs its three parts at once, and its AMP cases in two groups of peer processes at once (none of its figures
is timed against another part's; on a GPU one part runs after the other, each with the card to itself).
Exit status 1 if an AMP swarm check failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_memory, gpu_step
from benchmarks.common import ROOT, child_env, machine_info, spawner, worst, write_json
from benchmarks.gpu_swarm import CASES, slug
from collabopt import processes

RESULTS = ROOT / "benchmarks" / "results"
SYNC_TOLERANCE = 1e-6  # float rounding of the all-reduce (see tests/swarm/helpers.py SWARM_ROUNDING)

SWARM_SETTINGS = {  # per version: peers, global epochs per case, the swarm's timing
    "gpu": dict(peers=3, epochs=4, batch=64, target_batch_size=3 * 64 * 4, overflow_step=3, lr=0.02,
                matchmaking_time=1.0, averaging_timeout=15.0, step_sleep=0.0, case_seconds=60),
    "smoke": dict(peers=2, epochs=2, batch=16, target_batch_size=2 * 16 * 4, overflow_step=2, lr=0.02,
                  matchmaking_time=0.5, averaging_timeout=10.0, step_sleep=0.01, case_seconds=40),
}
# The smoke version runs its cases in two groups of peer processes at once (each case is a swarm of its own either
# way; its peers mostly wait for their rounds): one after the other they were the check's longest part. The plain
# loop's cases (plain, DiLoCo) in one group, the framework adapters' (Lightning, Accelerate: 5-6 s of imports in the
# first) in the other: 15 s each, where halves of the list took 12 s and 18 s. (1 epoch is too few: in the cases
# without a scaler, bf16 and Accelerate, the loss had not moved at epoch 1 in 2 of 2 runs)


def card_name() -> str:
    if not torch.cuda.is_available():
        return "none (CPU smoke version)"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda})"


def run_swarms(workdir: Path, smoke: bool, cases: list[str], timeout: float) -> dict[str, Any]:
    """Start a bootstrap DHT and the peers, wait for them; return the checks per case and the peers' results."""
    settings = dict(SWARM_SETTINGS["smoke" if smoke else "gpu"])
    workdir.mkdir(parents=True, exist_ok=True)
    env = child_env()
    bootstrap, initial_peers = processes.start_bootstrap(workdir, env=env, cwd=ROOT, spawn=spawner())
    # the peer processes' case lists (in order: Accelerate's case stays the last of its process)
    groups = [cases]
    if smoke:
        plain = [case for case in cases if case.split()[0] in ("plain", "diloco")]
        groups = [group for group in (plain, [case for case in cases if case not in plain]) if group]
    peers: list[tuple[processes.Process, int, str]] = []  # (process, peer index, its result file's name)
    codes: list[int | None] = []
    run_prefix = f"gpucheck_{uuid.uuid4().hex[:8]}"  # a new run id per case and run: stale DHT records confuse peers
    try:
        for group, group_cases in enumerate(groups):
            for index in range(settings["peers"]):
                name = f"peer{index}" if len(groups) == 1 else f"peer{index}.group{group}"
                cfg = dict(settings, index=index, dir=str(workdir), cases=group_cases, cuda=not smoke,
                           run_prefix=run_prefix, out=name)
                path = workdir / f"{name}.config.json"
                write_json(path, cfg)
                proc = processes.Process([sys.executable, "-m", "benchmarks.gpu_swarm", str(path)],
                                         workdir / f"{name}.log", env=dict(env, INITIAL_PEERS=initial_peers),
                                         cwd=ROOT, spawn=spawner())
                peers.append((proc, index, name))
        deadline = time.monotonic() + timeout
        codes = [proc.wait(max(0.1, deadline - time.monotonic())) for proc, _, _ in peers]
    finally:
        for proc, _, _ in peers:
            proc.kill_tree()
        bootstrap.kill_tree()
    results: list[dict[str, Any]] = [{} for _ in range(settings["peers"])]  # per peer index: its cases' results
    for (proc, index, name), code in zip(peers, codes, strict=True):
        path = workdir / f"{name}.json"
        results[index].update(json.loads(path.read_text()) if path.exists() else {})
        if code != 0:
            print(f"{name} exited with {code}; log: {proc.log_path}\n{proc.tail(2000)}", flush=True)
    rows = [check_case(workdir, case, results, settings) for case in cases]
    if not all(row["ok"] for row in rows):  # the working folder stays behind on a lent machine: show the logs' ends
        for proc, _, _ in peers:
            print(f"--- the end of {proc.log_path}:\n{proc.tail(3000)}", flush=True)
    return dict(settings=settings, rows=rows, ok=all(row["ok"] for row in rows), peers=results)


def check_case(workdir: Path, case: str, results: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The checks of one case over every peer's result; ``problems`` says what failed."""
    per_peer = [r.get(case, {"error": "no result (the peer died or timed out)"}) for r in results]
    row: dict[str, Any] = {"case": case, "problems": []}
    problems = row["problems"]
    for index, r in enumerate(per_peer):
        if "error" in r:
            problems.append(f"peer {index}: {r['error']}")
    if problems:
        row["ok"] = False
        return row
    epochs = [torch.load(workdir / f"{slug(case)}.{i}.pt") for i in range(len(per_peer))]
    common = set.intersection(*(set(e) for e in epochs))
    common.discard(0)
    if not common:
        problems.append("no epoch after the start that every peer reached")
        diff = float("nan")
    else:
        last = max(common)
        diff = worst(float((e[last][k].double() - epochs[0][last][k].double()).abs().max())
                     for e in epochs[1:] for k in epochs[0][last])
        row["compared_at_epoch"] = last
        if not diff <= SYNC_TOLERANCE:
            problems.append(f"peers apart by {diff:.3g} at epoch {last}")
    row["max_param_diff"] = diff
    row["loss_start"] = [round(r["start_loss"], 4) for r in per_peer]
    row["loss_end"] = [round(r["final_loss"], 4) for r in per_peer]
    row["samples_skipped"] = [r["samples_skipped"] for r in per_peer]
    row["scale_before_after"] = [(r.get("scale_before"), r.get("scale_after")) for r in per_peer]
    row["final_epochs"] = [r["final_epoch"] for r in per_peer]
    row["autocast"] = per_peer[0]["autocast"]
    row["scaler"] = per_peer[0]["scaler"]
    row["seconds"] = max(r["seconds"] for r in per_peer)
    for index, r in enumerate(per_peer):
        if r["timed_out"]:
            problems.append(f"peer {index} did not reach epoch {settings['epochs']} in time (epoch {r['final_epoch']})")
        if not r["final_loss"] < r["start_loss"]:
            problems.append(f"peer {index}: loss did not fall ({r['start_loss']:.4f} -> {r['final_loss']:.4f})")
        if r["samples_skipped"] < settings["batch"]:
            problems.append(f"peer {index}: its overflow step was not skipped (samples_skipped {r['samples_skipped']})")
        if not (r["finite_after_every_round"] and r["finite_at_end"]):
            problems.append(f"peer {index}: non-finite parameters after a round")
        if r["scaler"] and r.get("scale_before") is not None and not r["scale_after"] < r["scale_before"]:
            problems.append(f"peer {index}: the loss scale did not back off at the overflow")
    row["ok"] = not problems
    return row


def swarm_table(swarms: dict[str, Any]) -> list[str]:
    lines = ["| case | autocast / scaler | in sync (max diff, epoch) | loss start → end (per peer) | "
             "samples skipped (overflow) | loss scale at the overflow | result |", "|---|---|---|---|---|---|---|"]
    for row in swarms["rows"]:
        if "loss_start" not in row:
            lines.append(f"| {row['case']} | | | | | | failed: {'; '.join(row['problems'])} |")
            continue
        losses = ", ".join(f"{a:.3f} → {b:.3f}" for a, b in zip(row["loss_start"], row["loss_end"], strict=True))
        scales = ", ".join(f"{a:g} → {b:g}" if a is not None else "—" for a, b in row["scale_before_after"])
        verdict = "ok" if row["ok"] else "FAILED: " + "; ".join(row["problems"])
        lines.append(f"| {row['case']} | {row['autocast']} / {'GradScaler' if row['scaler'] else 'none'} | "
                     f"{row['max_param_diff']:.2g} at {row.get('compared_at_epoch')} | {losses} | "
                     f"{row['samples_skipped']} | {scales} | {verdict} |")
    return lines


def report(result: dict[str, Any]) -> str:
    info = result["machine"]
    smoke = result["smoke"]
    lines = [f"# GPU check{' — CPU SMOKE VERSION (no GPU: these are not GPU figures)' if smoke else ''}", "",
             f"Card: **{result['card']}**. Run {info['date_utc']} on {info['cpu']} ({info['cpus']} CPUs), "
             f"torch {info['torch']}, hivemind {info['hivemind']}, commit {info['git_commit']}; "
             f"{result['seconds']:.0f} s in all. Written by `python3 scripts/dev.py gpu-check` "
             "(benchmarks/gpu_check.py); every figure is a ratio against a baseline of this run.", "",
             f"## AMP swarms ({result['swarms']['settings']['peers']} peers sharing the "
             f"{'CPU' if smoke else 'GPU'}, one injected overflow each)", ""]
    lines += swarm_table(result["swarms"])
    lines += ["", "## Local-step cost", ""] + gpu_step.table(result["step"])
    lines += ["", "## GPU memory", ""] + gpu_memory.table(result["memory"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the GPU check of issue 34 (CPU smoke version without CUDA)")
    parser.add_argument("--out", type=Path, help="folder for gpu.md / gpu.json (default: benchmarks/results on a "
                        "GPU, a new temporary folder for the CPU smoke version)")
    parser.add_argument("--smoke", action="store_true", help="the CPU smoke version even where CUDA is available")
    parser.add_argument("--parts", default="swarms,step,memory", help="comma-separated subset of swarms,step,memory")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of the AMP swarm cases")
    args = parser.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    out = args.out or (Path(tempfile.mkdtemp(prefix="collabopt-gpu-check-")) if smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="collabopt-gpu-work-"))
    parts = set(args.parts.split(","))
    if smoke:
        print("gpu-check: no CUDA device (or --smoke): running the CPU SMOKE VERSION (tiny models, 2 peers, bf16 "
              f"autocast standing in for fp16); results go to {out}, not to benchmarks/results", flush=True)
    else:
        print(f"gpu-check on {card_name()}; results go to {out}", flush=True)
    started = time.monotonic()
    empty = {"rows": [], "skipped": True}
    result: dict[str, Any] = dict(smoke=smoke, card=card_name(), machine=machine_info(), seconds=0.0,
                                  swarms=dict(empty, settings=SWARM_SETTINGS["smoke" if smoke else "gpu"], ok=True),
                                  step=empty, memory=empty)
    cases = [c for c in args.cases.split(",") if c]
    runs = {"swarms": lambda: run_swarms(work / "swarms", smoke, cases, 150 if smoke else 300),
            "step": lambda: gpu_step.run(work / "step", smoke),
            "memory": lambda: gpu_memory.run(work / "memory", smoke)}
    runs = {part: run for part, run in runs.items() if part in parts}
    written = threading.Lock()

    def run_part(part: str) -> None:
        value = runs[part]()
        with written:
            result[part] = value
            result["seconds"] = time.monotonic() - started
            write_json(out / "gpu.json", result)  # after each part: a run stopped later still leaves these
            (out / "gpu.md").write_text(report(result))
            print(f"gpu-check: {part} done after {result['seconds']:.0f} s", flush=True)

    if smoke:  # the parts at once: each is a few processes that mostly wait (no figure of the smoke version is timed
        # against another part's), and the smoke is the swarm tests' (tests/swarm/test_gpu_check.py)
        with concurrent.futures.ThreadPoolExecutor(max(1, len(runs))) as pool:
            for future in [pool.submit(run_part, part) for part in runs]:
                future.result()
    else:  # one part after the other: the step timings and the memory peaks must have the GPU to themselves
        for part in runs:
            run_part(part)
    print(report(result), flush=True)
    print(f"wrote {out / 'gpu.md'} and {out / 'gpu.json'}; working files in {work}", flush=True)
    return 0 if result["swarms"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
