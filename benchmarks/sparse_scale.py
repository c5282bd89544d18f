"""Compressed DiLoCo at 4, 8 and 16 peers: what the all-gather of the sparse payloads costs each peer per round,
and from which group size a reduce-scatter of the sparse parts would send less.

    python -m benchmarks.sparse_scale                 # N = 4, 8, 16 (about 15 minutes on 2 cores)
    python -m benchmarks.sparse_scale --sizes 16 --update   # one size, keeping the others' rows
    python -m benchmarks.sparse_scale --report        # only write sparse_scale.md again from sparse_scale.json
    python -m benchmarks.sparse_scale --no-unions; python -m benchmarks.sparse_scale --unions-only   # in two parts

Each swarm is B6's WAN bed (:func:`benchmarks.diloco_wan.run_swarm`: one network namespace per peer, links of
100 Mbit/s, bytes counted on the namespaces' interfaces) with B6's model (about 5M parameters) and
``pseudo_gradient_compression=SparseLoCo()`` at its defaults, but rounds of 40 inner steps of 0.5 s of simulated
compute instead of 2,000 of 0.05 s, so that 16 peers fit 2 cores: a payload's bytes do not depend on the inner
steps. Each peer (:mod:`benchmarks.peer`) counts, over a window of whole rounds, what its interfaces sent and what
its exchange sent (the bodies of the all-gather's messages: its payload to every other member, signatures, hashes
and the agreement), the length of its payloads, its rounds' group sizes and the share of the aggregate's entries
that are not zero (the union of the members' kept entries). Control bytes (DHT, matchmaking, the framing of every
message) are what the interfaces sent beyond the exchange's bodies. The total at B6's round length is given both
ways: control taken per second (``control/s x 116 s``, as B6's figure was split) and per round (as measured here).

The union on real pseudo-gradients comes from B6's quality bed (:func:`benchmarks.sparse_quality.run`, N workers in
one process): a reducer's result in a reduce-scatter is that dense.

Writes ``benchmarks/results/sparse_scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine_info, median, write_json
from benchmarks.diloco_wan import SPARSE_WAN, WAN
from benchmarks.sparse_reduce_scatter import break_even, contributors, reduce_scatter_bytes

RESULTS = ROOT / "benchmarks" / "results"
DHT_KEYS = ("progress", "metrics", "matchmaking", "state_lists", "routing")  # benchmarks.dht_traffic.CATEGORIES
B6_ROUND_SECONDS = 116.0  # B6's compressed round at 100 Mbit/s (2,000 inner steps of 0.05 s and the exchange)
SETTINGS = dict(SPARSE_WAN, warmup_epochs=1, measure_epochs=3)
CONFIG: dict[str, Any] = dict(
    {k: WAN[k] for k in ("width", "in_dim", "batch", "params", "matchmaking_time", "averaging_timeout")},
    sizes=[4, 8, 16], steps=[40, 100], rate=100, compute_seconds=0.5, max_seconds=420, startup_seconds=240,
    union=dict(variant="d0.02-b2-e0.95-sgd1.0", inner_steps=100, rounds=10, seed=0))


def run_size(n: int, steps: int, cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One swarm of ``n`` peers, rounds of ``steps`` inner steps; its row (or its error)."""
    from benchmarks.diloco_wan import run_swarm

    started, load = time.time(), os.getloadavg()[0]
    try:
        settings = dict(SETTINGS, steps_per_epoch=steps, warmup_epochs=cfg.get("warmup_epochs", 1))
        records = run_swarm(dict(cfg, peers=n), settings, cfg["rate"], workdir,
                            f"sparse{n}_{steps}")
        row = figures(n, records)
    except Exception as e:  # a size that fails is reported; the others still run
        row = dict(peers=n, error=f"{type(e).__name__}: {e}"[:2000])
    row.update(steps_per_round=steps, compute_seconds=cfg["compute_seconds"], code=cfg.get("code", ""),
               load_avg_at_start=round(load, 2),
               wall_seconds=round(time.time() - started, 1))
    return row


def in_window(record: dict[str, Any], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    start, end = record["window"]
    return [item for item in items if start < item["time"] <= end]


def figures(n: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """A size's row from its peers' records: per peer and round (means over the peers), the exchange's bytes, the
    interfaces' bytes and the rest (control); control per second; the rounds' group sizes and unions."""
    exchange, net, control_rate, seconds, rounds, payloads, groups, unions = [], [], [], [], [], [], [], []
    contributed = []
    for record in records:
        start, end = record["window"]
        count = sum(1 for t, _ in record["epochs"] if start < t <= end)
        sent = record["net_bytes"][1] - record["net_bytes"][0]
        bodies = record["exchange_bytes"][1] - record["exchange_bytes"][0]
        exchange.append(bodies / count)
        net.append(sent / count)
        control_rate.append((sent - bodies) / (end - start))
        seconds.append((end - start) / count)
        rounds.append(count)
        mine = in_window(record, record["exchanges"])
        payloads += [e["payload"] for e in mine if e["payload"]]
        unions += [e["union"] for e in mine if e["union"] is not None]
        contributed += [e.get("contributed", True) for e in mine if e.get("error") is None]
        groups += [r["group_size"] if r["applied"] else f"{r['group_size']} ({r['reason']})"
                   for r in in_window(record, record["rounds"])]
    mean = sum(exchange) / len(exchange)
    control = sum(control_rate) / len(control_rate)
    payload = median(payloads)
    k = contributors(n)
    return dict(peers=n, rounds=min(rounds), round_seconds=median(seconds), payload_bytes=payload,
                max_contributors=k, contributed_share=contributed.count(True) / max(1, len(contributed)),
                exchange_per_round=mean, exchange_over_payloads=mean / (k * (n - 1) / n * payload),
                sent_per_round=sum(net) / len(net), control_per_round=sum(net) / len(net) - mean,
                control_per_second=control, total_at_b6_round=mean + control * B6_ROUND_SECONDS,
                total_at_b6_round_control_per_round=sum(net) / len(net),
                group_sizes={str(k): v for k, v in sorted(Counter(groups).items(), key=str)},
                all_members=all(g == n for g in groups) and len(groups) == sum(rounds),
                union_median=median(unions), numel=records[0]["grad_bytes"] // 4, **dht_split(records))


def dht_split(records: list[dict[str, Any]]) -> dict[str, Any]:
    """With ``--breakdown`` (:mod:`benchmarks.dht_traffic` in every peer): the DHT protocol's bytes sent per peer
    and round by key (mean over the peers; protobuf bodies), and its calls by kind per peer and round."""
    from benchmarks import dht_traffic

    if not all(len(r.get("dht", [])) == 2 for r in records):
        return {}
    sent: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for record in records:
        start, end = record["window"]
        count = sum(1 for t, _ in record["epochs"] if start < t <= end) * len(records)
        for category, counts in dht_traffic.difference(record["dht"][1], record["dht"][0]).items():
            sent[category] += dht_traffic.sent(counts) / count
        for kind, value in record["dht_calls"][1].items():
            calls[kind] += (value - record["dht_calls"][0].get(kind, 0)) / count
    return dict(dht_sent_per_round=dict(sent), dht_calls_per_round=dict(calls))


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's totals and exchange bytes over those of the 4-peer row of the same steps and compute
    (``*_ratio_to_4``)."""
    for row in rows:
        base = next((r for r in rows if r["peers"] == 4 and _setting(r)[1:] == _setting(row)[1:]
                     and "error" not in r), None)
        if base is None or "error" in row:
            continue
        for key in ("total_at_b6_round", "total_at_b6_round_control_per_round", "exchange_per_round"):
            row[f"{key}_ratio_to_4"] = row[key] / base[key]


def control_fits(rows: list[dict[str, Any]], compute: float = CONFIG["compute_seconds"]) -> list[dict[str, Any]]:
    """Per size measured at two or more round lengths: control bytes per round as ``a + c * seconds`` (least
    squares: ``a`` what a round costs whatever its length, matchmaking and framing; ``c`` per second, the DHT's
    upkeep), and the total at B6's round: the exchange (mean of the rows) + ``a + c * 116``; its ratio to N=4's.
    Rows of ``compute`` seconds a step only (a round of more, shorter steps is another setting)."""
    fits = []
    for n, code in sorted({(r["peers"], r.get("code", "")) for r in rows if "error" not in r}):
        mine = [r for r in rows if _setting(r)[::3] == (n, code) and "error" not in r
                and r["compute_seconds"] == compute]
        if len({r["steps_per_round"] for r in mine}) < 2:
            continue
        t = [r["round_seconds"] for r in mine]
        y = [r["control_per_round"] for r in mine]
        t_mean, y_mean = sum(t) / len(t), sum(y) / len(y)
        c = sum((a - t_mean) * (b - y_mean) for a, b in zip(t, y, strict=True)) / sum((a - t_mean) ** 2 for a in t)
        a = y_mean - c * t_mean
        exchange = sum(r["exchange_per_round"] for r in mine) / len(mine)
        fits.append(dict(peers=n, code=code, per_round=a, per_second=c, exchange_per_round=exchange,
                         total_at_b6_round=exchange + a + c * B6_ROUND_SECONDS))
    for fit in fits:
        base = next((f for f in fits if f["peers"] == 4 and f["code"] == fit["code"]), None)
        if base is not None:
            fit["ratio_to_4"] = fit["total_at_b6_round"] / base["total_at_b6_round"]
    return fits


# -------------------------------------------------------------------------------- unions on the quality bed


def measure_unions(cfg: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """The aggregate's union on B6's quality bed (real pseudo-gradients, :func:`benchmarks.sparse_quality.run`) for
    every size: after each round; its last round's is the estimate."""
    import torch

    from benchmarks.sparse_quality import git, load_data, run

    torch.set_num_threads(1)
    data = load_data(git("rev-parse", "--short", "HEAD").decode().strip())
    u = cfg["union"]
    out = {str(n): run(u["variant"], u["inner_steps"], u["rounds"], u["seed"], data, workers=n) for n in sizes}
    return dict(settings=u, corpus=data["corpus"], numel=next(iter(out.values()))["numel"],
                union={n: r["union"] for n, r in out.items()})


# ---------------------------------------------------------------------------------------------- report


def estimates(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per measured size: the all-gather's payload bytes and the reduce-scatter's, with the union measured in the
    swarm (simulated pseudo-gradients) and on the quality bed (real ones), reduced values at 2 and at 8 bits."""
    rows, seen = [], set()
    for row in sorted(result["rows"], key=lambda r: r["steps_per_round"]):  # (one row a size: its shortest rounds)
        if "error" in row or _setting(row)[::3] in seen or row["compute_seconds"] != CONFIG["compute_seconds"]:
            continue
        seen.add(_setting(row)[::3])
        n, k = row["peers"], row.get("max_contributors", row["peers"])
        real = result.get("unions", {}).get("union", {}).get(str(k))  # (the union of k workers' contributions)
        for source, union in (("swarm", row["union_median"]), ("quality bed", real[-1] if real else None)):
            if union is None or union != union:
                continue
            for bits in (2, 4, 8):
                b = reduce_scatter_bytes(n, row["numel"], union, bits, k)
                rows.append(dict(peers=n, k=k, code=row.get("code", ""), union_source=source, union=union, bits=bits,
                                 **b))
    return rows


def markdown(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    codes = sorted({r.get("code", "") for r in result["rows"]})

    def tag(row: dict[str, Any]) -> str:  # (which code a row ran, where the rows ran more than one)
        return f" ({chr(65 + codes.index(row.get('code', '')))})" if len(codes) > 1 else ""

    lines = ["# Compressed DiLoCo at 4, 8 and 16 peers: bytes per peer per round", "",
             "Command: `python -m benchmarks.sparse_scale` (benchmarks/sparse_scale.py; raw figures in "
             "`sparse_scale.json`).", "",
             f"Host `{m['host']}` ({m['cpu']}, {m['cpus']} CPUs), {m['date_utc']}, torch {m['torch']}, hivemind "
             f"{m['hivemind']}, code of `{m['git_commit']}`" + (f"; sizes kept from earlier runs: "
                                                              f"{', '.join(m['earlier_runs'])}"
                                                              if m.get("earlier_runs") else "") + ".", "",
             *([("Rows by code: " + "; ".join(f"({chr(65 + i)}) {c}" for i, c in enumerate(codes)) + "."), ""]
               if len(codes) > 1 else []),
             f"Each swarm: N peers, each in a network namespace with a {cfg['rate']} Mbit/s link (B6's bed), an MLP "
             f"of about {cfg['params'] / 1e6:.0f}M parameters, `SparseLoCo()` (density 0.02, chunks of 4096, 2 "
             "bits; K: the members that contribute a payload each round, `max_contributors` at most, the others "
             "keeping their pseudo-gradient in their error feedback) with its outer step, rounds of "
             f"{' or '.join(map(str, cfg['steps']))} inner steps of "
             f"{cfg['compute_seconds']} s of simulated compute, `matchmaking_time` {cfg['matchmaking_time']} s; "
             f"{SETTINGS['measure_epochs']} rounds measured after {cfg.get('warmup_epochs', 1)}. Per peer and round, "
             "mean over the peers: *exchange*: the bodies of the all-gather's messages it sent (its payload to "
             "each other member, signatures, hashes, agreement); *control*: what its interface sent beyond them "
             "(DHT, matchmaking, framing). At B6's round: exchange + control/s x "
             f"{B6_ROUND_SECONDS:.0f} s, and exchange + control per round.", "",
             "| N | K | steps x compute s | load at start | round s | payload kB | exchange kB / round "
             "| over K (N-1) / N payloads | control kB / s | control kB / round | total kB at 116 s (control/s) "
             "| ratio to N=4 | total kB (control/round) | ratio to N=4 | group sizes (rounds of all peers) | union |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['peers']}{tag(r)} | - | {r['steps_per_round']} x {r['compute_seconds']} "
                         f"| {r['load_avg_at_start']} | error: {r['error'].splitlines()[0][:300]} |" + " |" * 11)
            continue
        groups = ", ".join(f"{k}: {v}" for k, v in r["group_sizes"].items())
        lines.append(
            f"| {r['peers']}{tag(r)} | {r.get('max_contributors', r['peers'])} "
            f"| {r['steps_per_round']} x {r['compute_seconds']} | {r['load_avg_at_start']} "
            f"| {r['round_seconds']:.1f} "
            f"| {r['payload_bytes'] / 1e3:.1f} "
            f"| {r['exchange_per_round'] / 1e3:,.0f} | {r['exchange_over_payloads']:.3f} "
            f"| {r['control_per_second'] / 1e3:.2f} | {r['control_per_round'] / 1e3:,.0f} "
            f"| {r['total_at_b6_round'] / 1e3:,.0f} | {r.get('total_at_b6_round_ratio_to_4', float('nan')):.2f}x "
            f"| {r['total_at_b6_round_control_per_round'] / 1e3:,.0f} "
            f"| {r.get('total_at_b6_round_control_per_round_ratio_to_4', float('nan')):.2f}x "
            f"| {groups}{'' if r['all_members'] else ' (not every round of all N)'} | {r['union_median']:.4f} |")
    split = [r for r in result["rows"] if r.get("dht_sent_per_round")]
    if split:
        lines += ["", "Control, split (`--breakdown`): the DHT protocol's bodies sent per peer and "
                  "round by key, against the control bytes per round; the rest is libp2p's and TCP's framing and the "
                  "exchange's matchmaking asked of peers directly.", "",
                  "| N | steps x compute s | round s | control kB / round | "
                  + " | ".join(f"DHT {c} kB" for c in DHT_KEYS) + " | DHT calls / round |",
                  "|---:|---|---:|---:|" + "---:|" * len(DHT_KEYS) + "---|"]
        for r in split:
            calls = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(r["dht_calls_per_round"].items()))
            lines.append(f"| {r['peers']}{tag(r)} | {r['steps_per_round']} x {r['compute_seconds']} "
                         f"| {r['round_seconds']:.1f} | {r['control_per_round'] / 1e3:,.0f} | "
                         + " | ".join(f"{r['dht_sent_per_round'].get(c, 0) / 1e3:,.1f}" for c in DHT_KEYS)
                         + f" | {calls} |")
    fits = control_fits(result["rows"])
    if fits:
        lines += ["", "Control bytes per round fitted over the round lengths as a + c x seconds, and the total at "
                  f"B6's {B6_ROUND_SECONDS:.0f} s round from it (exchange + a + c x {B6_ROUND_SECONDS:.0f}):", "",
                  "| N | a: kB per round | c: kB per s | exchange kB / round | total kB at 116 s | ratio to N=4 |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {f['peers']}{tag(f)} | {f['per_round'] / 1e3:,.0f} | {f['per_second'] / 1e3:.2f} "
                  f"| {f['exchange_per_round'] / 1e3:,.0f} | {f['total_at_b6_round'] / 1e3:,.0f} "
                  f"| {f.get('ratio_to_4', float('nan')):.2f}x |" for f in fits]
    unions = result.get("unions")
    if unions:
        u = unions["settings"]
        lines += ["", f"Union on real pseudo-gradients (B6's quality bed, {unions['numel']:,} parameters, "
                  f"{u['variant']}, {u['inner_steps']} inner steps a round, seed {u['seed']}; after rounds "
                  f"1..{u['rounds']}):", ""]
        lines += [f"- N={n}: " + ", ".join(f"{v:.3f}" for v in values) for n, values in unions["union"].items()]
    lines += ["", "Reduce-scatter of the sparse parts against the all-gather, payload bytes a peer sends a round, "
              "mean over the N members of which K contribute (longest payloads; the reduced whole in the payload's "
              "format at the union of the K contributions' density and 2, 4 or 8 bits):", "",
              "| N | K | union from | union | bits | reduced / payload | all-gather kB | reduce-scatter kB |",
              "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for e in estimates(result):
        lines.append(f"| {e['peers']}{tag(e)} | {e.get('k', e['peers'])} | {e['union_source']} | {e['union']:.4f} "
                     f"| {e['bits']} "
                     f"| {e['reduced_over_payload']:.2f} | {e['all_gather'] / 1e3:,.0f} "
                     f"| {e['reduce_scatter'] / 1e3:,.0f} |")
    numel = next((r["numel"] for r in result["rows"] if "numel" in r), None)
    if numel:
        lines += ["", "Break-even group size for independent unions (1 - 0.98^K, as the swarm's), K as `SparseLoCo()`: "
                  + ", ".join(f"{bits} bits: N = {break_even(numel, bits, 0.02)}" for bits in (2, 4, 8)) + "."]
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sparse_scale.json", result)
    (out / "sparse_scale.md").write_text(markdown(result), encoding="utf-8")
    return [out / "sparse_scale.json", out / "sparse_scale.md"]


def _setting(row: dict[str, Any]) -> tuple[int, int, float, str]:
    return row["peers"], row["steps_per_round"], row["compute_seconds"], row.get("code", "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sparse_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=None, help="comma-separated swarm sizes (default 4,8,16)")
    parser.add_argument("--steps", default=None, help="comma-separated inner steps per round (default 40,100)")
    parser.add_argument("--compute-seconds", type=float, default=None, help="simulated compute a step (default 0.5)")
    parser.add_argument("--update", action="store_true", help="keep the rows of other sizes and the unions")
    parser.add_argument("--no-unions", action="store_true", help="skip the quality bed's unions (keep earlier ones)")
    parser.add_argument("--unions-only", action="store_true", help="only measure the quality bed's unions, into "
                        "--out's sparse_scale.json (no swarm: needs no lock)")
    parser.add_argument("--report", action="store_true", help="only write sparse_scale.md from sparse_scale.json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the peers' logs and records here")
    parser.add_argument("--code", default=None, help="what code runs, for the report (default: git HEAD)")
    parser.add_argument("--breakdown", action="store_true", help="count every peer's DHT traffic by key too")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before the measured ones (default 1; more "
                        "where the first round split and its late members' state downloads would be counted)")
    args = parser.parse_args(argv)
    previous = json.loads((args.out / "sparse_scale.json").read_text()) \
        if (args.out / "sparse_scale.json").exists() else None
    if args.report or args.unions_only:
        if args.unions_only:
            previous["unions"] = measure_unions(CONFIG, CONFIG["sizes"])
        write(previous, args.out)
        return 0
    cfg = dict(CONFIG)
    for key in ("sizes", "steps"):
        if getattr(args, key):
            cfg[key] = sorted(int(v) for v in getattr(args, key).split(","))
    if args.compute_seconds:
        cfg["compute_seconds"] = args.compute_seconds
    if args.breakdown:
        cfg["peer_options"] = dict(dht_traffic=True)
    cfg["warmup_epochs"] = args.warmup
    from harness.testnet import unavailable_reason

    if (reason := unavailable_reason()) is not None:
        print(f"skipped: {reason}")
        return 1
    result: dict[str, Any] = dict(machine=machine_info(), config=cfg, rows=[])
    if args.code:
        result["machine"]["git_commit"] = args.code
    with tempfile.TemporaryDirectory(prefix="collabopt-sparse-scale-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for steps in cfg["steps"]:
            for n in cfg["sizes"]:
                result["rows"].append(run_size(n, steps, cfg, workdir))
                print(f"[{time.strftime('%H:%M:%S')}] N={n}: {json.dumps(result['rows'][-1])}", flush=True)
    if not args.no_unions:
        result["unions"] = measure_unions(cfg, CONFIG["sizes"])
    elif previous and "unions" in previous:
        result["unions"] = previous["unions"]
    if args.update and previous:
        ran = {_setting(row) for row in result["rows"]}  # (a row of the same size, steps and compute is replaced)
        kept = [row for row in previous["rows"] if _setting(row) not in ran]
        if kept:
            result["rows"] = sorted(result["rows"] + kept, key=lambda row: (-row["compute_seconds"],
                                                                            row["steps_per_round"], row["peers"]))
            result["config"]["steps"] = sorted({row["steps_per_round"] for row in result["rows"]})
            result["machine"]["earlier_runs"] = sorted({*previous["machine"].get("earlier_runs", []),
                                                        previous["machine"]["date_utc"]})
        if "unions" not in result and "unions" in previous:
            result["unions"] = previous["unions"]
    add_ratios(result["rows"])
    for path in write(result, args.out):
        print(f"wrote {path}")
    print(markdown(result))
    return 1 if any("error" in row for row in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
