"""B3 with collabopt's own all-reduce runner (:mod:`collabopt.engine.allreduce`, through the averaging service): the
same bed as :mod:`benchmarks.wan` (peers in network namespaces, every link limited with ``tc tbf``), the same gradient
bytes, and only the all-reduce: each peer averages its gradients ``rounds`` times in a row
(:mod:`benchmarks.allreduce_peer`). The figure: the all-reduce time (from the last peer's group assembled to the last
peer done, :func:`benchmarks.swarmrun.allreduce_seconds`) against the link bound ``2 (N-1)/N * S / B``.

``python -m benchmarks.wan_allreduce`` (root) runs B3's cases of 4 peers at 100 Mbit/s with raw hivemind's optimizer,
with this runner, and the same traffic on p2pd's byte streams (:mod:`benchmarks.p2p_allreduce_peer`, the transport's
ceiling) and over plain TCP (:mod:`benchmarks.tcp_allreduce_peer`, the bed's), one after the other, in ``--sittings``
sittings (3), and writes ``benchmarks/results/b3_allreduce.{json,md}``: each row's figure is the median of its
sittings' (one sitting's figure moves by up to 0.1 from one sitting to the next on this bed; the rounds within one
sitting, much less).
Other beds, each written to its own files (``b3_allreduce_fair``, ``_cubic``, ``_fair_cubic``): ``--fair`` shares
each link evenly among the other peers (:class:`~harness.testnet.TestNet`'s ``fair``; by default tbf keeps
one FIFO queue), ``--congestion cubic`` sets the peers' TCP congestion control (by default the host's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, child_env, machine_info, median, spread, write_json
from benchmarks.swarmrun import allreduce_seconds, start_bootstrap
from collabopt.processes import Process
from harness.testnet import TestNet

ROUNDS = 6
# between rounds, every peer's links idle (the compute between real rounds): TCP starts each round afresh, as there
IDLE_SECONDS = 1.0
TCP_PORT = 29517  # the plain-TCP peers' port, one per namespace
PEER_MODULES = {"engine": "benchmarks.allreduce_peer", "tcp": "benchmarks.tcp_allreduce_peer",
                "p2p": "benchmarks.p2p_allreduce_peer"}


def run_case(workdir: Path, name: str, n: int, rate_mbit: float, params: int, cfg: dict[str, Any],
             bound_seconds: Any, impl: str = "engine") -> dict[str, Any]:
    """One swarm of ``n`` peers at ``rate_mbit`` per link; returns the row of this case: ``impl`` "engine" runs
    collabopt's averaging service (:mod:`benchmarks.allreduce_peer`), "tcp" the same traffic over plain TCP
    (:mod:`benchmarks.tcp_allreduce_peer`, the bed's ceiling), "p2p" over p2pd's byte streams
    (:mod:`benchmarks.p2p_allreduce_peer`, the transport's)."""
    row: dict[str, Any] = dict(case=name, peers=n, mbit=rate_mbit, variant="no overlap", impl=impl)
    run_id = f"bench_b3_{impl}_{uuid.uuid4().hex[:8]}"
    module = PEER_MODULES[impl]
    with TestNet(n, rate_mbit, fair=cfg.get("fair", False), congestion=cfg.get("congestion")) as net:
        exchange = workdir / f"b3_{name}_exchange"  # (the tcp / p2p peers' addresses)
        if impl in ("tcp", "p2p"):
            shutil.rmtree(exchange, ignore_errors=True)
            exchange.mkdir()
            bootstrap, initial_peers = None, ""
        else:
            bootstrap, initial_peers = start_bootstrap(workdir, host=net.bootstrap_addr, netns=net.bootstrap)
        procs, outs = [], []
        go = workdir / f"b3_{name}.go"
        go.unlink(missing_ok=True)
        try:
            for i in range(n):
                out, ready = workdir / f"b3_{name}_{i}.json", workdir / f"b3_{name}_{i}.ready"
                out.unlink(missing_ok=True)
                ready.unlink(missing_ok=True)
                config = workdir / f"b3_{name}_{i}.config.json"
                write_json(config, dict(run_id=run_id, initial_peers=initial_peers, host=net.addr[i], seed=i,
                                        peers=n, params=params, width=cfg["width"], in_dim=cfg["in_dim"],
                                        rounds=cfg.get("rounds", ROUNDS), matchmaking_time=cfg["matchmaking_time"],
                                        averaging_timeout=cfg["averaging_timeout"], out=str(out),
                                        part_size_bytes=cfg.get("part_size_bytes", 2**19),
                                        ready_file=str(ready), go_file=str(go), index=i, addrs=net.addr,
                                        port=TCP_PORT, exchange_dir=str(exchange),
                                        idle_seconds=cfg.get("idle_seconds", IDLE_SECONDS)))
                procs.append(Process([sys.executable, "-m", module, str(config)],
                                     workdir / f"b3_{name}_{i}.log", env=child_env(), cwd=ROOT, netns=net.peers[i]))
                outs.append((out, ready))
            deadline = time.monotonic() + cfg["max_seconds"] + 90
            while time.monotonic() < deadline and not all(r.exists() or p.poll() is not None
                                                          for p, (_, r) in zip(procs, outs, strict=True)):
                time.sleep(0.1)
            go.touch()
            while time.monotonic() < deadline and not all(o.exists() or p.poll() is not None
                                                          for p, (o, _) in zip(procs, outs, strict=True)):
                time.sleep(0.5)
        finally:
            for proc in procs:
                proc.kill_tree()
            if bootstrap is not None:
                bootstrap.kill_tree()
    records = []
    for i, (out, _) in enumerate(outs):
        if not out.exists():
            raise RuntimeError(f"peer b3_{name}_{i} wrote no record; log ends with:\n{procs[i].tail()}")
        records.append(json.loads(out.read_text()))
    grad_bytes = records[0]["grad_bytes"]
    durations = allreduce_seconds(records)
    bound = bound_seconds(n, grad_bytes, rate_mbit)
    allreduce = median(durations) if durations else float("nan")
    row.update(grad_mb=grad_bytes / 1e6, bound_s=bound, allreduce_s=allreduce, rounds=len(durations),
               allreduce_range=spread(durations),
               bound_over_allreduce=bound / allreduce if durations else float("nan"),
               utilization=float("nan"), epoch_compute_s=0.0)
    return row


def combine_sittings(sittings: list[dict[str, Any]]) -> dict[str, Any]:
    """One B3 result from several sittings of the same cases, rows paired by case: a row's all-reduce time and compute
    utilization are the medians of its measured sittings' (the range: their times), ``sittings`` lists each one's
    figure and ``failed_sittings`` the errors of the others (a failed sitting, or one with no round timed, is left
    out); a row measured in no sitting keeps its first sitting's row. Sittings without rows (a bed skipped) count only
    where every sitting has none."""
    ran = [sitting for sitting in sittings if sitting.get("rows")]
    if not ran:
        return sittings[0] if sittings else dict(rows=[])
    rows = []
    for case in [row["case"] for row in ran[0]["rows"]]:
        same = [row for sitting in ran for row in sitting["rows"] if row["case"] == case]
        measured = [row for row in same if "error" not in row and row["allreduce_s"] == row["allreduce_s"]]
        if not measured:
            rows.append(same[0])
            continue
        seconds = [row["allreduce_s"] for row in measured]
        row = dict(measured[0], allreduce_s=median(seconds), rounds=sum(row["rounds"] for row in measured),
                   allreduce_range=f"{spread(seconds)} ({len(measured)} sitting{'s' * (len(measured) > 1)})",
                   utilization=median([row["utilization"] for row in measured]),
                   sittings=[round(row["bound_over_allreduce"], 3) for row in measured],
                   failed_sittings=[row.get("error", "no round timed") for row in same if row not in measured])
        row["bound_over_allreduce"] = row["bound_s"] / row["allreduce_s"]
        rows.append(row)
    return dict(rows=rows)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import run, wan

    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan_allreduce", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=run.RESULTS, help="where to write b3_allreduce.{json,md}")
    parser.add_argument("--fair", action="store_true", help="links share evenly among peers (default: one FIFO)")
    parser.add_argument("--congestion", help="the peers' TCP congestion control, e.g. cubic (default: the host's)")
    parser.add_argument("--sittings", type=int, default=3, help="run every row this many times, one after the other "
                        "(default 3); a row's figure is the median of its sittings'")
    args = parser.parse_args(argv)
    if args.sittings < 1:
        parser.error(f"--sittings must be at least 1, not {args.sittings}")
    cfg = dict(run.FULL["b3"], fair=args.fair, congestion=args.congestion,
               cases=[case for case in run.FULL["b3"]["cases"]
                      if (case["peers"], case["mbit"], case.get("impl")) in ((4, 100, "hivemind"), (4, 100, "engine"))]
               + [dict(peers=4, mbit=100, params=5_000_000, variant="no overlap", impl=impl)
                  for impl in ("p2p", "tcp")])
    host_congestion = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    bed = dict(queue="fair" if args.fair else "fifo", congestion=args.congestion or f"{host_congestion} (host default)",
               sittings=args.sittings)
    name = "_".join(["b3_allreduce"] + (["fair"] if args.fair else []) + ([args.congestion] if args.congestion else []))
    results: dict[str, Any] = {"machine": machine_info(), "quick": False, "config": {"b3": cfg}, "bed": bed}
    with tempfile.TemporaryDirectory(prefix="collabopt-b3-") as tmp:
        results["b3"] = combine_sittings([wan.run(cfg, Path(tmp)) for _ in range(args.sittings)])
    results["machine"]["load_avg_1m_at_end"] = round(__import__("os").getloadavg()[0], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    queue = ("under each tbf, one queue per other peer, served a packet at a time (HTB classes, u32 filters), as "
             "fq_codel / fq share among flows" if args.fair else "tbf's one FIFO queue (100 ms)")
    title = ("# B3's all-reduce: raw hivemind, collabopt's own all-reduce runner, p2pd streams and plain TCP, "
             f"the median of {args.sittings} sittings")
    report = run.markdown(results).replace(
        "# collabopt benchmarks", f"{title}\n\nBed: links {queue}; TCP congestion control {bed['congestion']}.", 1
    ).replace("ranges are min..max over rounds", "a row's range: the min..max of its sittings' all-reduce times", 1)
    (args.out / f"{name}.md").write_text(report)
    print(report)
    return 1 if not results["b3"].get("rows") or any("error" in row for row in results["b3"]["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
