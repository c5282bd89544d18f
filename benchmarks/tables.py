"""Write the results tables of README.md and the docs from ``benchmarks/results/*.json``.

    python -m benchmarks.tables           # rewrite every block between its markers
    python -m benchmarks.tables --check   # exit 1 if a file differs from what this would write

A block is the text between ``<!-- results:NAME:begin -->`` and ``<!-- results:NAME:end -->``; NAME picks the
function of ``BLOCKS`` that writes it. Every figure in a block comes from a results file, so README and docs cannot
disagree with the results or with each other: a unit test runs ``--check``. The blocks carry no date or commit (the
results files keep those); after a benchmark writes new results, run this and commit both.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FILES = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in ("performance", "faults", "scale"))]
MARKER = re.compile(r"(<!-- results:([\w-]+):begin -->\n)(.*?)(<!-- results:\2:end -->)", re.S)


@cache
def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def machine(m: dict[str, Any]) -> str:
    """The machine a results file was measured on, without its date or commit."""
    return (f"*Measured on {m['cpus']} CPUs ({m['cpu']}), Python {m['python']}, torch {m['torch']}, "
            f"hivemind {m['hivemind']}, collabopt {m['collabopt']}.*")


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def x(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}×"


def b2_row(variant: str) -> dict[str, Any]:
    return next(row for row in load("results")["b2"]["rows"] if row["variant"] == variant)


def b3_row(peers: int, mbit: int, variant: str, impl: str = "collabopt", grad_mb: float | None = None) -> dict:
    return next(row for row in load("results")["b3"]["rows"]
                if (row["peers"], row["mbit"], row["variant"], row.get("impl", "collabopt")) == (peers, mbit, variant,
                                                                                                    impl)
                and (grad_mb is None or row["grad_mb"] > grad_mb))


def b5_row(peers: int, variant: str, factor: int) -> dict[str, Any]:
    return next(row for row in load("results")["b5"]["rows"]
                if (row["peers"], row["variant"], row["epoch_factor"]) == (peers, variant, factor))


def wan_row(mode: str, mbit: int) -> dict[str, Any]:
    return next(row for row in load("diloco")["wan"]["rows"] if (row["mode"], row["mbit"]) == (mode, mbit))


def scale_row(name: str, peers: int) -> dict[str, Any]:
    return next(row for row in load(name)["rows"] if row["peers"] == peers)


def gpu_step(variant: str) -> dict[str, Any]:
    return next(row for row in load("gpu")["step"]["rows"] if row["variant"] == variant)


def gpu_memory(mode: str) -> dict[str, Any]:
    return next(row for row in load("gpu")["memory"]["rows"] if row["mode"] == mode)


def readme() -> list[str]:
    r = load("results")
    b4 = {row["mode"]: row["extra_over_params"] for row in r["b4"]["rows"]}
    plain, default, reuse = b4["plain torch"], b4["none"], b4["reuse"]
    wan = [wan_row(mode, mbit) for mode in ("diloco + overlap",) for mbit in (20, 100)]
    fewer = [row["fewer_bytes_than_synchronous"] for row in load("diloco")["wan"]["rows"]
             if row["mode"].startswith("diloco")]
    sparse = [row["fewer_bytes_than_fp16"] for row in load("diloco")["wan"]["rows"] if "fewer_bytes_than_fp16" in row]
    at4, at16 = scale_row("scale", 4), scale_row("scale", 16)
    rows = [
        ["B1 swarm samples/s against raw hivemind, same settings", x(r["b1"]["ratio"]), "≥ 0.99×"],
        ["Swarm samples/s against raw hivemind, 2 peers, each on its own defaults",
         x(load("defaults")["ratio_median"]), "≥ 1×"],
        ["B2 local step time against a plain torch loop (CPU)", x(b2_row("collabopt")["ratio"]), "≤ 1.02×"],
        ["B3 compute utilization, 4 peers at 100 Mbit/s, overlap settings",
         f"{b3_row(4, 100, 'overlap')['utilization']:.2f}", "≥ 0.95"],
        ["B4 memory beyond the parameters (plain Adam: " + f"{plain:.0f}×)", f"{default:.0f}×", f"≤ {plain + 1:.0f}×"],
        ["B5 idle share of an epoch of 4× `matchmaking_time`, 3 / 4 peers",
         f"{b5_row(3, 'default', 4)['idle_share']:.1%} / {b5_row(4, 'default', 4)['idle_share']:.1%}", "≤ 5%"],
        ["B6 DiLoCo compute utilization at 20 / 100 Mbit/s, `overlap_rounds`",
         " / ".join(f"{row['utilization']:.3f}" for row in wan), "≥ 0.98"],
        ["B6 DiLoCo bytes sent per sample, fewer than the synchronous mode",
         f"{min(fewer):.0f}–{max(fewer):.0f}×", "≥ 100×"],
        *([["B6 compressed DiLoCo (`SparseLoCo()`) bytes sent per sample, fewer than fp16 DiLoCo",
            f"{min(sparse):.1f}–{max(sparse):.1f}×", "≥ 20×"]] if sparse else []),
        ["B7 DHT bytes sent per peer per epoch, 16 peers against 4",
         x(at16["dht_sent_per_epoch"] / at4["dht_sent_per_epoch"]), "≤ 2×"],
        ["GPU local step against plain torch, fp16 / bf16 (110M parameters)",
         f"{x(gpu_step('collabopt fp16')['ratio'])} / {x(gpu_step('collabopt bf16')['ratio'])}", "≤ 1.01×"],
    ]
    assert f"{reuse:.0f}" == f"{default:.0f}", \
        "B4: the README's row assumes reuse_grad_buffers costs what the default mode does"  # (as the row shows it)
    return table(["benchmark", "result", "goal"], rows) + ["", machine(r["machine"]) + " GPU row: one NVIDIA H200."]


def b1() -> list[str]:
    r, c = load("results")["b1"], load("results")["config"]["b1"]
    return [f"2 swarms of 2 peers at once, MLP of {c['params']:,} parameters, {c['compute_seconds']} s of simulated "
            f"compute per step of {c['batch']} samples, epochs of about {c['epoch_seconds']} s, "
            f"`matchmaking_time` {c['matchmaking_time']} s; {r['rounds']} one-epoch rounds.", ""] + table(
        ["figure", "raw hivemind", "collabopt", "collabopt / hivemind (median)", "range over rounds"],
        [["swarm samples/s", f"{r['hivemind_samples_per_s']:.0f}", f"{r['collabopt_samples_per_s']:.0f}",
          f"{r['ratio']:.3f}", r["ratio_range"].replace("..", "–")],
         ["CPU ms per sample", f"{r['hivemind_cpu_ms_per_sample']:.3f}", f"{r['collabopt_cpu_ms_per_sample']:.3f}",
          f"{r['cpu_ratio']:.3f}", r["cpu_ratio_range"].replace("..", "–")]]) + [
        "", machine(load("results")["machine"])]


def defaults() -> list[str]:
    d = load("defaults")
    c = d["config"]
    rows = [[k, f"{s['hivemind']['samples_per_s']:.0f}", f"{s['collabopt']['samples_per_s']:.0f}", f"{s['ratio']:.3f}",
             f"{s['hivemind']['epoch_seconds']:.1f} / {s['collabopt']['epoch_seconds']:.1f}"]
            for k, s in enumerate(d["sessions"], 1)]
    return [f"2 peers a side, B1's MLP (real forward and backward passes), Adam lr "
            f"{c['lr']}, batch {c['batch']}, `target_batch_size` {c['target_batch_size']:,}, {c['sessions']} sessions "
            f"of {c['measure_epochs']} measured epochs. Median ratio {d['ratio_median']:.3f}; collabopt's peers at "
            f"every epoch both reached: max parameter difference {d['collabopt_max_param_diff']:.3g} over "
            f"{d['collabopt_epochs_compared']} epochs.", ""] + table(
        ["session", "raw hivemind samples/s", "collabopt samples/s", "collabopt / hivemind",
         "epoch s (hivemind / collabopt)"], rows) + ["", machine(d["machine"])]


def b2() -> list[str]:
    r = load("results")["b2"]
    rows = [[row["variant"], f"{row['ratio']:.3f}", row["ratio_range"].replace("..", "–"), f"{row['ms_per_step']:.1f}",
             "" if row.get("guard_share") is None else f"{row['guard_share']:.2%}"] for row in r["rows"]]
    return [f"MLP of {r['params']:,} parameters, Adam, batch {r['batch']}, one thread, an epoch every "
            f"{r['steps_per_epoch']} steps, {r['rounds']} interleaved rounds, each variant in a process of its own.",
            ""] + table(["variant", "time / plain torch (median)", "range", "ms per step", "guard's share"],
                        rows) + ["", machine(load("results")["machine"])]


B3_CODE = {"engine": "collabopt, the all-reduce alone"}  # (no training: no compute utilization)


def b3() -> list[str]:
    rows = [[row["peers"], row["mbit"], B3_CODE.get(row.get("impl", "collabopt"), row.get("impl", "collabopt")),
             row["variant"], f"{row['grad_mb']:.1f}", f"{row['bound_over_allreduce']:.2f}",
             "–" if row["utilization"] != row["utilization"] else f"{row['utilization']:.3f}"]
            for row in load("results")["b3"]["rows"]]
    return table(["peers", "Mbit/s", "code", "variant", "gradients MB", "link bound / all-reduce time",
                  "compute utilization"], rows) + ["", machine(load("results")["machine"])]


def b4() -> list[str]:
    r = load("results")["b4"]
    names = {"plain torch": "plain torch (Adam)", "none": "collabopt, default mode", "reuse": "`reuse_grad_buffers`",
             "offload": "`offload_optimizer`", "both": "both"}
    return [f"MLP of {r['params']:,} parameters, Adam, on the {r['device'].upper()}, measured mid-epoch.", ""] + table(
        ["mode", "tensor bytes beyond the parameters, × the parameters"],
        [[names.get(row["mode"], row["mode"]), f"{row['extra_over_params']:.2f}"] for row in r["rows"]]) + [
        "", machine(load("results")["machine"])]


def b5() -> list[str]:
    c = load("results")["config"]["b5"]
    rows = [[row["peers"], f"{row['epoch_factor']}×", row["variant"], f"{row['epoch_s']:.0f}",
             f"{row['idle_per_epoch_s']:.2f}", f"{row['idle_share']:.1%}", _s(row.get("wait_grads_s")),
             _s(row.get("step_state_s"))] for row in load("results")["b5"]["rows"]]
    return [f"MLP of {c['params']:,} parameters, {c['compute_seconds']} s of simulated compute per step, "
            f"`matchmaking_time` {c['matchmaking_time']} s, {c['measure_epochs']} epochs measured after "
            f"{c['warmup_epochs']} of warm-up; median over the peers.", ""] + table(
        ["peers", "epoch / `matchmaking_time`", "mode", "epoch s", "idle s per epoch", "idle share",
         "waiting for gradients s", "optimizer step + parameter round s"], rows) + ["",
                                                                                   machine(load("results")["machine"])]


def _s(value: float | None) -> str:
    return "–" if value is None or value != value else f"{value:.2f}"


def b6() -> list[str]:
    q = load("diloco")["quality"]
    earlier_runs = {f"{row['machine']['cpus']} CPUs ({row['machine']['cpu']})" for row in load("diloco")["wan"]["rows"]
                    if row.get("machine")}
    quality = [[mode, f"{v['samples']:.0f}", f"{v['loss']:.3f}", f"{v['sync_loss']:.3f}", f"{v['ratio']:.3f}",
                q["modes"][mode]["rounds_failed"]] for mode, v in q["vs_sync"].items()]
    wan = [[f"{row['mbit']}{'†' if row.get('machine') else ''}", row["mode"], f"{row['utilization']:.3f}",
            f"{row['step_overhead_ms']:.1f}",
            f"{row['bytes_per_sample']:.0f}",
            "" if row.get("fewer_bytes_than_synchronous") is None else f"{row['fewer_bytes_than_synchronous']:.0f}×"]
           for row in load("diloco")["wan"]["rows"]]
    return [f"Quality: a character-level LM on {q['corpus_chars']:,} characters, {q['peers']} peers on loopback, "
            f"batch {q['batch']} per step; loss at equal samples against the synchronous mode.", ""] + table(
        ["mode", "samples", "loss", "synchronous mode's loss", "ratio", "rounds not applied"], quality) + [
        "", "WAN bed: 4 peers in network namespaces, about 5M parameters, simulated compute.", ""] + table(
        ["Mbit/s", "mode", "compute utilization", "`step()` overhead ms", "bytes sent per sample",
         "fewer bytes than synchronous"], wan) + ["", machine(load("diloco")["machine"])] + (
        [("Rows marked † were measured in earlier runs, on " if len(earlier_runs) > 1 else
          "Rows marked † were measured in an earlier run, on ") + " and ".join(sorted(earlier_runs)) + "."]
        if earlier_runs else [])


def b7() -> list[str]:
    rows = []
    for name in ("scale", "scale_16cpu"):
        m = load(name)["machine"]
        for row in load(name)["rows"]:
            rows.append([row["peers"], m["cpus"], f"{row['epoch_s']:.1f}", f"{row['dht_sent_per_epoch'] / 1e3:.0f}",
                         f"{row['dht_received_per_epoch'] / 1e3:.0f}", f"{row['boundary_s']:.2f}",
                         f"{row['epoch_fill']:.3f}", f"{row['group_size_median']:g}",
                         f"{row['joiner_download_median_s']:.2f}", f"{row['machine_busy']:.0%}"])
    return table(["peers", "CPUs", "epoch s", "DHT kB sent / epoch", "DHT kB received / epoch", "boundary s",
                  "samples / target", "group size (median)", "joiner download s", "machine busy"], rows) + [
        "", machine(load("scale")["machine"]), "", "The 16-CPU row: " + machine(load("scale_16cpu")["machine"])]


def gpu() -> list[str]:
    g = load("gpu")
    swarms = [[row["case"], f"{row['max_param_diff']:g}", " → ".join(f"{v:.3f}" for v in (row["loss_start"][0],
                                                                                       row["loss_end"][0])),
               "ok" if row["ok"] else "failed"] for row in g["swarms"]["rows"]]
    step = [[row["variant"], f"{row['ratio']:.3f}", row["ratio_range"].replace("..", "–"), f"{row['ms_per_step']:.1f}"]
            for row in g["step"]["rows"]]
    memory = [[row["mode"], f"{row['gpu_peak_over_plain']:.3f}", f"{row['host_extra_over_params']:+.2f}"]
              for row in g["memory"]["rows"]]
    return [f"Card: {g['card']}.", "", "AMP swarms (3 peers sharing the GPU, one injected overflow each):", ""] + table(
        ["case", "max parameter difference", "loss (peer 0)", "result"], swarms) + [
        "", "Local step, a 110M-parameter GPT-like model, CUDA events:", ""] + table(
        ["variant", "time / plain torch (median)", "range", "ms per step"], step) + [
        "", "Memory of a lone peer (`max_memory_allocated`):", ""] + table(
        ["mode", "peak GPU memory / plain torch", "host tensors beyond plain, × the parameters"], memory) + [
        "", machine(g["machine"])]


def small_runs() -> list[str]:
    a, m, t = load("aggregation"), load("membership"), load("trainer_overhead")
    rows = [["`aggregation=\"centered_clip\"` against `\"mean\"`, 2 swarms of 4 peers (B1's settings)",
             "swarm samples/s", f"{a['samples_per_s_ratio']:.3f}", a["ratio_range"].replace("..", "–")],
            ["`swarm_key` against an open swarm, 2 swarms of 2 peers (B1's settings)", "swarm samples/s",
             f"{m['samples_per_s_ratio']:.3f}", m["ratio_range"].replace("..", "–")],
            ["`CollaborativeTrainer` against a plain `Trainer`, lone peer", "median step time",
             f"{t['median_step_ratio']:.3f}",
             f"{min(t['median_step_ratios']):.3f}–{max(t['median_step_ratios']):.3f}"]]
    return table(["comparison", "figure", "ratio (median)", "range"], rows)


def churn() -> list[str]:
    c = load("churn")
    k, f = c["churn"], c["churn_free"]
    close = sum(1 for r in k["restarts"] if r["diff_before_first_step"] <= 1e-8)
    rows = [["peers, seconds", f"{k['peers']}, {k['seconds']:.0f}", f"{f['peers']}, {f['seconds']:.0f}"],
            ["SIGKILLs (each peer restarted with its identity)", k["kills"], f["kills"]],
            ["global epochs reached", k["epochs_reached"], f["epochs_reached"]],
            ["restarts equal to the swarm (1e-8) before their first step", f"{close} of {len(k['restarts'])}", "–"],
            ["max parameter difference at the end", f"{k['final_diff']:g}", f"{f['final_diff']:g}"],
            ["final loss", f"{k['final_loss']:.3f}", f"{f['final_loss']:.3f}"],
            ["processes left behind", len(k["orphans"]), len(f["orphans"])]]
    return table(["", "with churn", "without"], rows)


BLOCKS: dict[str, Callable[[], list[str]]] = {
    "readme": readme, "b1": b1, "defaults": defaults, "b2": b2, "b3": b3, "b4": b4, "b5": b5, "b6": b6, "b7": b7,
    "gpu": gpu, "small": small_runs, "churn": churn,
}


def render(text: str, path: Path) -> str:
    def block(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in BLOCKS:
            raise SystemExit(f"{path}: unknown results block {name!r}; known: {', '.join(BLOCKS)}")
        return match.group(1) + "\n".join(BLOCKS[name]()) + "\n" + match.group(4)

    return MARKER.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is not up to date")
    args = parser.parse_args(argv)
    stale = []
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        new = render(text, path)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "out of date (run python -m benchmarks.tables)" if args.check else "rewritten"
    for path in stale:
        print(f"{path}: {verb}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
