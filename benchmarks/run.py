"""Run the benchmarks and write ``benchmarks/results/results.{md,png,json}``.

    python -m benchmarks.run                 # everything (about 20 minutes on 2 cores; B3 needs root + iproute2)
    python -m benchmarks.run --only b2,b4    # a subset
    python -m benchmarks.run --quick         # tiny sizes: checks the harness, the figures mean little
    python -m benchmarks.run --only b5       # idle time at epoch boundaries (about 20 minutes)

Every figure is a ratio against a baseline measured in the same run (interleaved where possible), so that the
noise of a shared machine cancels as far as it can. See docs/performance.md; `python -m benchmarks.tables` writes
the tables of README and docs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine_info, run_module
from benchmarks.results_plot import plot
from benchmarks.swarmrun import SWARM_ROUNDING

RESULTS = ROOT / "benchmarks" / "results"
GOALS = {"b1": 0.99, "b2": 1.02, "b3_bound": 0.9, "b3_util": 0.95, "b5_idle": 0.05}
BENCHMARKS = ("b1", "b2", "b3", "b4", "b5")
# the same traffic with nothing but sockets (the bed's ceiling) and on p2pd's byte streams (the transport's)
B3_PEERS_RUN = {"tcp": "plain TCP, the same traffic", "p2p": "p2pd streams, the same traffic"}

MLP = dict(width=1024, in_dim=256)
FULL: dict[str, Any] = {
    "b1": dict(params=1_000_000, width=512, in_dim=256, batch=32, compute_seconds=0.05, epoch_seconds=8,
               matchmaking_time=2.0, averaging_timeout=30.0, warmup_epochs=1, rounds_per_session=6, sessions=2,
               max_seconds=200),
    "b2": dict(params=6_000_000, **MLP, batch=32, steps_per_epoch=64, rounds=10,
               matchmaking_time=5.0),
    "b4": dict(params=6_000_000, **MLP, batch=32, steps_per_epoch=4, epochs=2, matchmaking_time=5.0),
    "b3": dict(**MLP, batch=32, compute_seconds=0.1, steps_per_epoch=50, matchmaking_time=3.0,
               averaging_timeout=60.0, warmup_epochs=2, measure_seconds=25, max_seconds=200,
               cases=[dict(peers=2, mbit=50, params=5_000_000, variant="no overlap", impl=impl,
                           overrides=dict(measure_seconds=30)) for impl in ("hivemind", "collabopt")]
               # the goal's 4 peers with large gradients (17.9 MB: the "5M" MLP has 4.48M parameters)
               + [dict(peers=4, mbit=100, params=5_000_000, variant="no overlap", impl=impl,
                       overrides=dict(measure_seconds=30)) for impl in ("hivemind", "collabopt")]
               # collabopt's own all-reduce runner (collabopt.engine.allreduce), the all-reduce alone
               + [dict(peers=4, mbit=100, params=5_000_000, variant="no overlap", impl="engine")]
               + [dict(peers=4, mbit=mbit, params=2_000_000, variant=variant)
                  for mbit in (100, 20)
                  for variant in ("no overlap", "overlap", "overlap + fp16", "overlap + 8-bit", "overlap + PowerSGD")]),
    # B5: epochs of about 4x and 8x matchmaking_time (hivemind's and collabopt's default 5 s), 3 and 4 peers, the
    # default mode and the recommended overlap settings (delay_state_averaging alone is a variant of boundary.py)
    "b5": dict(params=2_000_000, width=512, in_dim=256, batch=32, compute_seconds=0.1, matchmaking_time=5.0,
               averaging_timeout=60.0, warmup_epochs=1, measure_epochs=3, max_seconds=300,
               cases=[dict(peers=peers, variant=variant, epoch_factor=factor)
                      for factor in (4, 8) for peers in (3, 4) for variant in ("default", "overlap")]),
}
QUICK: dict[str, Any] = {
    # B1 measures whole epochs here: a window of seconds held no epoch of both swarms on a slow, loaded host, and the
    # quick run must produce a row wherever it runs
    "b1": dict(FULL["b1"], params=100_000, width=256, epoch_seconds=2, matchmaking_time=1.0, rounds_per_session=1,
               measure_epochs=2, sessions=1, max_seconds=90),
    "b2": dict(FULL["b2"], params=300_000, width=256, steps_per_epoch=16, rounds=2,
               variants=["plain torch", "collabopt", "collabopt reuse"]),
    "b4": dict(FULL["b4"], params=300_000, width=256, epochs=1, modes=["plain torch", "none", "reuse"]),
    "b3": dict(FULL["b3"], compute_seconds=0.05, steps_per_epoch=30, warmup_epochs=1, measure_seconds=4,
               max_seconds=60, cases=[dict(peers=2, mbit=100, params=200_000, variant="no overlap")]),
    # B5's two cases at once (each swarm's peers mostly wait for their rounds; one after the other they took 21 s)
    "b5": dict(FULL["b5"], params=100_000, width=256, compute_seconds=0.05, matchmaking_time=1.0, measure_epochs=2,
               max_seconds=90, cases_at_once=True,
               cases=[dict(peers=3, variant=variant, epoch_factor=2) for variant in ("default", "overlap")]),
}


def run_all(which: list[str], quick: bool, workdir: Path, log: Any = print) -> dict[str, Any]:
    """Run the selected benchmarks; return everything the report needs. One after the other: each needs the machine to
    itself, the quick run's too (run at once, its parts overran their limits on a slow host: docs/development.md)."""
    from benchmarks import boundary, overhead, wan

    cfg = QUICK if quick else FULL
    results: dict[str, Any] = {"machine": machine_info(), "quick": quick, "config": {k: cfg[k] for k in which}}

    def run_one(name: str) -> None:
        log(f"running {name.upper()} ...")
        start = time.monotonic()
        where = workdir / name if quick else workdir
        where.mkdir(parents=True, exist_ok=True)
        try:
            if name == "b1":
                result = overhead.run(cfg[name], where)
            elif name == "b2":
                result = run_module("benchmarks.local_step", cfg[name], where, timeout=900, name="b2")
            elif name == "b3":
                result = wan.run(cfg[name], where, log=log)
            elif name == "b4":
                result = run_module("benchmarks.memory", cfg[name], where, timeout=600, name="b4")
            else:
                result = boundary.run(cfg[name], where, log=log)
        except Exception as e:  # report the failure, keep the other benchmarks
            result = {"error": f"{type(e).__name__}: {e}"[:2000]}
        result["seconds"] = round(time.monotonic() - start, 1)
        results[name] = result
        log(f"{name.upper()} done in {result['seconds']} s")

    for name in which:
        run_one(name)
    results["machine"]["load_avg_1m_at_end"] = round(__import__("os").getloadavg()[0], 2)
    return results


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:.{digits}f}"
    return str(value)


def _fmt_share(value: float | None) -> str:
    return "" if value is None else f"{value:.2%}"


def _apart(r: dict[str, Any], prefix: str = "") -> str:
    """A swarm's largest parameter difference between peers and over how many common epochs (see swarmrun)."""
    diff, compared = r.get(prefix + "max_param_diff", float("nan")), r.get(prefix + "epochs_compared", 0)
    return f"{'-' if not compared else f'{diff:.3g}'} ({compared})"


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("met" if ok else "**missed**")


def markdown(results: dict[str, Any]) -> str:
    """The report: header (machine, versions, configuration) and one table per benchmark."""
    m = results["machine"]
    lines = [
        "# collabopt benchmarks" + (" (quick run: tiny sizes, figures not meaningful)" if results["quick"] else ""),
        "",
        f"{m['date_utc']} · {m['cpu']} · {m['cpus']} CPUs · load avg {m['load_avg_1m_at_start']} at start, "
        f"{m.get('load_avg_1m_at_end', '?')} at end · Linux {m['kernel']}",
        f"Python {m['python']} · torch {m['torch']} · hivemind {m['hivemind']} · collabopt {m['collabopt']} "
        f"(git {m['git_commit'] or '?'})",
        "",
        "Ratios are against a baseline measured in the same run; ranges are min..max over rounds."
        + (f" Some tables come from an earlier run ({m['earlier_run']}) on the same machine." if m.get("earlier_run")
           else ""),
        "",
    ]
    if "b1" in results:
        r, c = results["b1"], results["config"]["b1"]
        lines += ["## B1 wrapper overhead: 2 peers on loopback, collabopt vs raw hivemind.Optimizer", ""]
        if "error" in r:
            lines += [f"failed: {r['error']}", ""]
        else:
            lines += [
                f"Two swarms of 2 peers side by side (same config, background parameter averaging), MLP "
                f"{c['params']:,} params, batch {c['batch']}, {c['compute_seconds']} s of simulated compute per step "
                f"(sleep), target batch {r['target_batch_size']} (epochs of about {c['epoch_seconds']} s); "
                f"a round is one global epoch: {r['rounds']} rounds in {c['sessions']} sessions. CPU: user + "
                "system seconds of the peers' process trees per sample.",
                "",
                "| metric | hivemind | collabopt | collabopt / hivemind (median) | range | goal |",
                "|---|---|---|---|---|---|",
                f"| swarm samples/s | {r['hivemind_samples_per_s']:.0f} | {r['collabopt_samples_per_s']:.0f} | "
                f"{r['ratio']:.3f} | {r['ratio_range']} | ≥ {GOALS['b1']} {_verdict(r['ratio'] >= GOALS['b1'])} |",
                f"| CPU ms / sample | {_fmt(r['hivemind_cpu_ms_per_sample'], 3)} | "
                f"{_fmt(r['collabopt_cpu_ms_per_sample'], 3)} | {_fmt(r['cpu_ratio'])} | {r['cpu_ratio_range']} | |",
                f"| max parameter difference between peers at a common epoch | {_apart(r, 'hivemind_')} | "
                f"{_apart(r, 'collabopt_')} | | | collabopt ≤ {SWARM_ROUNDING:g} |",
                "",
            ]
    if "b2" in results:
        r = results["b2"]
        lines += ["## B2 local step cost: forward + backward + step vs a plain torch loop", ""]
        if "error" in r:
            lines += [f"failed: {r['error']}", ""]
        else:
            lines += [
                f"MLP {r['params']:,} params, Adam, batch {r['batch']}, optimizer step every {r['steps_per_epoch']} "
                f"local steps (a lone peer's epoch), {r['rounds']} interleaved rounds of {r['steps_per_round']} "
                "steps, 1 thread" + (", each variant in a process of its own." if r.get("processes") else "."),
                "",
                "| variant | time / plain torch (median) | range | main-thread CPU / plain | ms per step | "
                "global steps / local steps | guard's share of the time | goal |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for row in r["rows"]:
                goal = ""
                if row["variant"].startswith("collabopt") and not row["variant"].startswith("collabopt,"):
                    goal = f"≤ {GOALS['b2']} {_verdict(row['ratio'] <= GOALS['b2'])}"
                lines.append(f"| {row['variant']} | {row['ratio']:.3f} | {row['ratio_range']} | "
                             f"{row['cpu_ratio']:.3f} | {row['ms_per_step']:.1f} | "
                             f"{row.get('epochs', '?')} / {row.get('local_steps', '?')} | "
                             f"{_fmt_share(row.get('guard_share'))} | {goal} |")
            lines.append("")
    if "b3" in results:
        r = results["b3"]
        lines += ["## B3 WAN: peers in network namespaces, links limited with tc tbf", ""]
        if "error" in r:
            lines += [f"failed: {r['error']}", ""]
        elif r.get("skipped"):
            lines += [f"skipped: {r['skipped']}", ""]
        else:
            c = results["config"]["b3"]
            lines += [
                f"Simulated compute {c['compute_seconds']} s per step (sleep), {c['steps_per_epoch']} steps per peer "
                "per epoch; gradients only (parameter averaging every 1000 epochs); SGD. all-reduce time: from the "
                "last peer's trigger to the last peer done; bound = 2(N-1)/N·S/B.",
                "",
                "| peers | Mbit/s | peers run | variant | grads MB | all-reduce s | range | bound s | "
                "bound / all-reduce | compute utilization |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for row in r["rows"]:
                peers_run = B3_PEERS_RUN.get(row.get("impl"), row.get("impl", "collabopt"))
                if "error" in row:
                    lines.append(f"| {row['peers']} | {row['mbit']} | {peers_run} | "
                                 f"{row['variant']} | failed: {row['error']} | | | | | |")
                    continue
                lines.append(
                    f"| {row['peers']} | {row['mbit']} | {peers_run} | {row['variant']} | "
                    f"{row['grad_mb']:.1f} | "
                    f"{_fmt(row['allreduce_s'], 2)} | {row['allreduce_range']} | {row['bound_s']:.2f} | "
                    f"{_fmt(row['bound_over_allreduce'])} | {row['utilization']:.3f} |")
            lines += ["", f"Goals: bound / all-reduce ≥ {GOALS['b3_bound']} (uncompressed); compute utilization ≥ "
                      f"{GOALS['b3_util']} with overlap at 100 Mbit/s.", ""]
    if "b4" in results:
        r = results["b4"]
        lines += ["## B4 memory: tensor bytes held beyond the parameters, per mode", ""]
        if "error" in r:
            lines += [f"failed: {r['error']}", ""]
        else:
            cuda = any("cuda_max_allocated_over_params" in row for row in r["rows"])
            lines += [
                f"MLP {r['params']:,} params, Adam, device {r['device']}; measured mid-epoch (gradients accumulated).",
                "",
                "| mode | extra bytes / parameter bytes |"
                + (" CUDA max allocated / parameter bytes |" if cuda else ""),
                "|---|---|" + ("---|" if cuda else ""),
            ]
            for row in r["rows"]:
                extra = f" {row['cuda_max_allocated_over_params']:.2f} |" if cuda else ""
                lines.append(f"| {row['mode']} | {row['extra_over_params']:.2f} |{extra}")
            lines.append("")
    if "b5" in results:
        lines += b5_markdown(results["b5"], results["config"].get("b5", {}))
    return "\n".join(lines)


def b5_markdown(r: dict[str, Any], c: dict[str, Any]) -> list[str]:
    """B5's table: idle time per global epoch and how the boundary step splits."""
    lines = ["## B5 idle time at epoch boundaries: peers on loopback, compute simulated by sleeping", ""]
    if "error" in r:
        return lines + [f"failed: {r['error']}", ""]
    lines += [
        f"MLP {c.get('params', 0):,} params, batch {c.get('batch')}, {c.get('compute_seconds')} s of simulated "
        f"compute per step, matchmaking_time {c.get('matchmaking_time')} s, epochs of about factor × "
        f"matchmaking_time, {c.get('measure_epochs')} epochs measured after {c.get('warmup_epochs')} of warm-up. "
        "Idle: time inside step() beyond a plain local step, per global epoch (median over peers, range min..max). "
        "Lead: from pre-scheduling the gradient round to reaching the boundary (a group forms matchmaking_time "
        "after its search began). Skew: spread of the peers' arrival at the boundary.",
        "",
        "| peers | mode | epoch s | idle s / epoch | range | idle share | lead s | wait for grads s | "
        "step + state s | skew s | peers apart (epochs) | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r.get("rows", []):
        if "error" in row:
            lines.append(f"| {row['peers']} | {row['variant']} | failed: {row['error']} | | | | | | | | | |")
            continue
        goal = ""
        if row["variant"] == "default":
            goal = f"≤ {GOALS['b5_idle']:.0%} {_verdict(row['idle_share'] <= GOALS['b5_idle'])}"
        mode = row["variant"] + "".join(f" + {e}" for e in row.get("experiments", []))
        lines.append(
            f"| {row['peers']} | {mode} | {row['epoch_s']:.1f} | {row['idle_per_epoch_s']:.2f} | "
            f"{row['idle_per_epoch_range']} | {row['idle_share']:.1%} | {_fmt(row['lead_s'], 2)} | "
            f"{_fmt(row['wait_grads_s'], 2)} | {_fmt(row['step_state_s'], 2)} | {_fmt(row['arrival_skew_s'], 2)} | "
            f"{_apart(row)} | {goal} |")
    return lines + [""]


def write_report(results: dict[str, Any], out: Path) -> list[Path]:
    """Write results.json, results.md and results.png into ``out``; return the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(markdown(results))
    if plot(results, out / "results.png", GOALS):
        paths.append(out / "results.png")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help="comma-separated subset of " + ",".join(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (checks the harness only)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write results.{md,png,json}")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and raw records here")
    parser.add_argument("--update", action="store_true",
                        help="keep the other benchmarks' figures from the existing results.json in --out")
    args = parser.parse_args(argv)
    which = [name.strip().lower() for name in args.only.split(",") if name.strip()]
    unknown = set(which) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    with tempfile.TemporaryDirectory(prefix="collabopt-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_all(which, args.quick, workdir, log)
    previous = args.out / "results.json"
    if args.update and previous.exists():
        old = json.loads(previous.read_text())
        if old.get("quick") == results["quick"]:
            for name in set(BENCHMARKS) - set(which):
                if name in old:
                    results[name] = old[name]
                    results["config"][name] = old["config"][name]
            # (the oldest run whose tables are kept: an updated run keeps tables of the run before it)
            results["machine"]["earlier_run"] = old["machine"].get("earlier_run") or old["machine"]["date_utc"]
    for path in write_report(results, args.out):
        log(f"wrote {path}")
    print(markdown(results))
    return 1 if any("error" in results[k] for k in which) else 0


if __name__ == "__main__":
    sys.exit(main())
