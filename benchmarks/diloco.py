"""B6 DiLoCo: DiLoCo mode (``outer_optimizer=``) against the synchronous mode, in the same run.

    python -m benchmarks.diloco                      # quality (loopback) and WAN (network namespaces, root)
    python -m benchmarks.diloco --only quality       # or --only wan; --quick for a smoke run
    python -m benchmarks.diloco peer config.json     # one quality peer (used by the runner)

Writes ``benchmarks/results/diloco.{json,md,png}``.

* **quality**: a character-level language model (an MLP over 16 characters) trained by 4 peers on this repository's
  Markdown text (its size and SHA-256 are in the results), once in each mode on loopback (each step also sleeps
  ``step_sleep``: the rounds of a real model are not all matchmaking). Peer 0 evaluates the loss
  on the held-out tenth of the text after every global epoch / round; the swarm's samples at an epoch are the sum of
  the samples each peer had trained on when it reached it. Compared: the loss of both at the same number of samples
  (interpolated), and the inner steps per round.
* **wan**: the B3 bed (:mod:`harness.testnet`: 4 peers in network namespaces, every link limited with ``tc``),
  ~5M parameters, simulated compute (``benchmarks.peer`` with ``compute="sleep"``): compute utilization (the
  simulated compute and, in DiLoCo mode, the inner optimizer step, over wall time) and bytes sent per sample (what
  all peers sent on their namespaces' interfaces but loopback over their measured windows, over the samples of
  those windows: a swarm's figure; a median of per-peer ratios swung with how many steps each peer took per epoch).
  Modes: synchronous, DiLoCo with fp16 pseudo-gradients ("diloco") and compressed DiLoCo ("sparse": SparseLoCo's
  defaults and its outer step), each DiLoCo mode also with ``overlap_rounds`` ("+ overlap").
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, child_env, machine_info, write_json
from benchmarks.diloco_wan import OUTER, WAN, add_ratios, report_lines, run_wan

RESULTS = ROOT / "benchmarks" / "results"
CONTEXT = 16

QUALITY = dict(peers=4, batch=64, step_sleep=0.02, matchmaking_time=1.0, averaging_timeout=30.0, max_seconds=900,
               modes={"synchronous": dict(lr=1e-2, steps_per_epoch=4, epochs=40),
                      "diloco": dict(lr=3e-3, steps_per_epoch=20, epochs=8, outer=OUTER),
                      "diloco + overlap": dict(lr=3e-3, steps_per_epoch=20, epochs=8, outer=OUTER, overlap=True)})
QUICK = dict(quality=dict(QUALITY, modes={"synchronous": dict(lr=1e-2, steps_per_epoch=4, epochs=8),
                                          "diloco": dict(lr=3e-3, steps_per_epoch=16, epochs=2, outer=OUTER),
                                          "diloco + overlap": dict(lr=3e-3, steps_per_epoch=16, epochs=2,
                                                                   outer=OUTER, overlap=True)}),
             wan=dict(WAN, params=500_000, width=256, rates=(100,),
                      modes={"synchronous": dict(steps_per_epoch=10, warmup_epochs=1, measure_epochs=2),
                             **{mode: dict(m, steps_per_epoch=100, measure_epochs=1)
                                for mode, m in WAN["modes"].items() if mode != "synchronous"}}))


# ---------------------------------------------------------------------------------------------- quality


def corpus() -> str:
    """This repository's Markdown files (sorted by path), concatenated: text that ships with every clone."""
    try:
        names = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.md") if ".venv" not in p.parts]
    return "".join((ROOT / name).read_text(errors="replace") for name in sorted(names) if (ROOT / name).exists())


def encode(text: str) -> tuple[Any, Any, int]:
    """(train, held-out) character ids and the vocabulary size."""
    import torch

    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    ids = torch.tensor([vocab[c] for c in text])
    split = int(len(ids) * 0.9)
    return ids[:split], ids[split:], len(vocab)


def char_model(vocab: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 24), torch.nn.Flatten(), torch.nn.Linear(24 * CONTEXT, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, vocab))


def windows(ids: Any, count: int, generator: Any) -> tuple[Any, Any]:
    """``count`` random contexts of :data:`CONTEXT` characters and the character that follows each."""
    import torch

    starts = torch.randint(0, len(ids) - CONTEXT - 1, (count,), generator=generator)
    x = torch.stack([ids[s:s + CONTEXT] for s in starts.tolist()])
    return x, ids[starts + CONTEXT]


def quality_peer(cfg: dict[str, Any]) -> None:
    """One peer of the quality comparison (run as its own process)."""
    import torch
    import torch.nn.functional as F

    from collabopt import CollaborativeOptimizer

    torch.set_num_threads(1)
    train, held_out, vocab = encode(corpus())
    model = char_model(vocab)
    generator = torch.Generator().manual_seed(1000 + cfg["index"])
    eval_x, eval_y = windows(held_out, 4096, torch.Generator().manual_seed(123))
    options = dict(run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"], batch_size=cfg["batch"],
                   initial_peers=cfg["initial_peers"], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   matchmaking_time=cfg["matchmaking_time"], averaging_timeout=cfg["averaging_timeout"],
                   print_join_message=False)
    if cfg.get("outer"):
        options["outer_optimizer"] = functools.partial(torch.optim.SGD, **cfg["outer"])
    if cfg.get("overlap"):
        options["overlap_rounds"] = True
    record: dict[str, Any] = dict(index=cfg["index"], epochs=[], steps=0)
    with CollaborativeOptimizer(torch.optim.AdamW(model.parameters(), lr=cfg["lr"]), **options) as copt:
        record["all_peers_came"] = copt.wait_for_peers(cfg["peers"], timeout=120)

        def evaluate() -> float | None:
            if cfg["index"] != 0:
                return None
            with torch.no_grad():
                return float(F.cross_entropy(model(eval_x), eval_y))

        # evaluated once a round's result is in the model: at the epoch change, or (overlap) when the round lands;
        # "epoch" is then the number of rounds landed
        def mark() -> int:
            return copt.diloco.rounds_applied if cfg.get("overlap") else copt.local_epoch

        def note() -> None:
            record["epochs"].append(dict(epoch=mark(), samples=record["steps"] * cfg["batch"], time=time.time(),
                                         loss=evaluate()))

        record["epochs"].append(dict(epoch=mark(), samples=0, time=time.time(), loss=evaluate()))
        deadline = time.monotonic() + cfg["max_seconds"]
        while copt.local_epoch < cfg["epochs"] and time.monotonic() < deadline:
            x, y = windows(train, cfg["batch"], generator)
            F.cross_entropy(model(x), y).backward()
            before = mark()
            copt.step()
            copt.zero_grad()
            record["steps"] += 1
            time.sleep(cfg["step_sleep"])  # a step of a real model takes a while: rounds are not all matchmaking
            if mark() != before:
                note()
        if cfg.get("overlap"):
            before = mark()
            copt.flush()  # the last round lands
            if mark() != before:
                note()
        if copt.diloco is not None:
            record["rounds_applied"], record["rounds_failed"] = copt.diloco.rounds_applied, copt.diloco.rounds_failed
        time.sleep(3.0)  # leave after the others' last round
    write_json(cfg["out"], record)


def swarm_curve(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(swarm samples, held-out loss) after every epoch peer 0 evaluated: samples summed over the peers when each
    reached that epoch (a peer that skipped it, by a state download, counts its samples when it got past it; one
    that never did, its last samples)."""
    by_peer = [sorted((e["epoch"], e["samples"]) for e in r["epochs"]) for r in records]

    def samples_at(peer: list[tuple[int, int]], epoch: int) -> int:
        return next((samples for reached, samples in peer if reached >= epoch), peer[-1][1])

    return [(float(sum(samples_at(peer, entry["epoch"]) for peer in by_peer)), entry["loss"])
            for entry in records[0]["epochs"]]


def loss_at(curve: list[tuple[float, float]], samples: float) -> float:
    """The loss at ``samples``, linearly interpolated between the evaluations around it."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if s0 <= samples <= s1:
            return l0 + (l1 - l0) * (samples - s0) / (s1 - s0) if s1 > s0 else l1
    return float("nan")


def run_quality(cfg: dict[str, Any], workdir: Path, log: Any = print) -> dict[str, Any]:
    from collabopt import processes

    text = corpus()
    result: dict[str, Any] = dict(corpus_chars=len(text), corpus_sha256=hashlib.sha256(text.encode()).hexdigest(),
                                  peers=cfg["peers"], batch=cfg["batch"], modes={})
    for mode, settings in cfg["modes"].items():
        target = cfg["peers"] * cfg["batch"] * settings["steps_per_epoch"]
        bootstrap, initial_peers = processes.start_bootstrap(workdir, name=f"bootstrap_{mode}", env=child_env(),
                                                             cwd=ROOT)
        procs, outs = [], []
        started, run_id = time.time(), f"b6q_{mode.replace(' + ', '_')}_{uuid.uuid4().hex[:6]}"
        try:
            for i in range(cfg["peers"]):
                out = workdir / f"quality_{mode}_{i}.json"
                config = dict(cfg, **settings, modes=None, index=i, run_id=run_id,
                              target_batch_size=target, initial_peers=initial_peers, out=str(out))
                config_path = workdir / f"quality_{mode}_{i}.config.json"
                write_json(config_path, config)
                procs.append(processes.Process([sys.executable, "-m", "benchmarks.diloco", "peer", str(config_path)],
                                               workdir / f"quality_{mode}_{i}.log", env=child_env(), cwd=ROOT))
                outs.append(out)
            for proc in procs:
                proc.wait(cfg["max_seconds"] + 180)
        finally:
            for proc in procs:
                proc.kill_tree()
            bootstrap.kill_tree()
        missing = [i for i, out in enumerate(outs) if not out.exists()]
        if missing:
            raise RuntimeError(f"{mode}: peers {missing} wrote no record; log:\n{procs[missing[0]].tail()}")
        records = [json.loads(out.read_text()) for out in outs]
        curve = swarm_curve(records)
        epochs = max(1, records[0]["epochs"][-1]["epoch"])
        result["modes"][mode] = dict(
            settings, target_batch_size=target, curve=curve, wall_seconds=time.time() - started,
            inner_steps_per_round=settings["steps_per_epoch"],  # nominal: target / (peers x batch)
            measured_steps_per_round=sum(r["steps"] for r in records) / epochs / cfg["peers"],
            rounds_failed=sum(r.get("rounds_failed", 0) for r in records))
        log(f"B6 quality {mode}: {len(curve) - 1} epochs, final loss {curve[-1][1]:.4f} at {curve[-1][0]:.0f} "
            f"samples ({time.time() - started:.0f} s)")
    summarize_quality(result)
    return result


def summarize_quality(result: dict[str, Any]) -> None:
    """Each DiLoCo mode's loss / the synchronous loss at the most samples both reached (``vs_sync``)."""
    sync = result["modes"]["synchronous"]["curve"]
    result["vs_sync"] = {}
    for mode, m in result["modes"].items():
        if mode != "synchronous":
            budget = min(m["curve"][-1][0], sync[-1][0])
            mine, theirs = loss_at(m["curve"], budget), loss_at(sync, budget)
            result["vs_sync"][mode] = dict(samples=budget, loss=mine, sync_loss=theirs, ratio=mine / theirs)
    result["diloco_over_sync"] = result["vs_sync"]["diloco"]["ratio"]


# ---------------------------------------------------------------------------------------------- WAN


def write_report(result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_json(RESULTS / "diloco.json", result)
    lines = ["# B6 DiLoCo mode against the synchronous mode", "", f"Machine: {result['machine']}", ""]
    quality = result.get("quality")
    if quality:
        lines += ["## Quality: character-level LM on the repository's Markdown text, 4 peers, loopback", "",
                  *([f"From an earlier run: {quality['machine']}", ""] if quality.get("machine") else []),
                  f"Corpus: {quality['corpus_chars']} characters (sha256 {quality['corpus_sha256'][:12]}...), "
                  f"batch {quality['batch']} per step per peer.", "",
                  "| mode | inner optimizer | samples per round/epoch | inner steps per round (nominal / measured) "
                  "| rounds / epochs (peer 0) | rounds not applied (all peers) | last loss at samples | wall s |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, m in quality["modes"].items():
            inner = f"AdamW lr {m['lr']}" + (", outer SGD(0.7, Nesterov 0.9)" if m.get("outer") else "")
            steps = f"{m['inner_steps_per_round']} / {m['measured_steps_per_round']:.1f}" if m.get("outer") else "-"
            failed = m.get("rounds_failed", 0) if m.get("outer") else "-"
            lines.append(f"| {mode} | {inner} | {m['target_batch_size']} | {steps} | {len(m['curve']) - 1} | "
                         f"{failed} | {m['curve'][-1][1]:.4f} at {m['curve'][-1][0]:.0f} | {m['wall_seconds']:.0f} |")
        lines += [""] + [f"- {mode}: loss {v['loss']:.4f} against the synchronous mode's {v['sync_loss']:.4f} at "
                         f"{v['samples']:.0f} samples: **{v['ratio']:.3f}** (goal: within 5%, i.e. <= 1.05)"
                         for mode, v in quality["vs_sync"].items()]
        lines += ["", "![loss against samples](diloco.png)", ""]
    wan = result.get("wan")
    if wan:
        lines += report_lines(wan)
    (RESULTS / "diloco.md").write_text("\n".join(lines) + "\n")
    if quality:
        plot(quality, RESULTS / "diloco.png")


def plot(quality: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, m in quality["modes"].items():
        samples, losses = zip(*m["curve"], strict=True)
        label = f"{mode} ({m['target_batch_size']} samples per {'round' if m.get('outer') else 'epoch'})"
        ax.plot(samples, losses, marker="o" if m.get("outer") else None, markersize=3, label=label)
    ax.set_xlabel("samples trained on by the swarm (4 peers)")
    ax.set_ylabel("held-out loss (nats per character)")
    ax.set_title("Character-level LM on the repository's Markdown text")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "peer":
        quality_peer(json.loads(Path(argv[1]).read_text()))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="quality,wan")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--rates", default=None, help="WAN: only these Mbit/s (comma-separated); the other rows "
                        "of the last results are kept")
    parser.add_argument("--modes", default=None, help="WAN: only these modes (comma-separated, e.g. 'diloco + "
                        "overlap'); the other rows of the last results are kept")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or f"/tmp/collabopt_b6_{uuid.uuid4().hex[:6]}")
    workdir.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    previous = json.loads((RESULTS / "diloco.json").read_text()) if (RESULTS / "diloco.json").exists() else {}
    result: dict[str, Any] = dict(machine=machine_info(), quick=args.quick)
    for part, runner in (("quality", run_quality), ("wan", run_wan)):
        if part in only:
            cfg = QUICK[part] if args.quick else (QUALITY if part == "quality" else WAN)
            if part == "wan" and (args.rates or args.modes):
                cfg = dict(cfg, rates=tuple(int(r) for r in args.rates.split(",")) if args.rates else cfg["rates"],
                           modes={m: v for m, v in cfg["modes"].items()
                                  if not args.modes or m in args.modes.split(",")})
            result[part] = runner(cfg, workdir)
            if part == "wan":
                fresh = {(r["mbit"], r["mode"]) for r in result[part]["rows"]}
                kept = [dict(r, machine=r.get("machine", previous.get("machine")))  # (measured in an earlier run)
                        for r in previous.get("wan", {}).get("rows", []) if (r["mbit"], r["mode"]) not in fresh
                        and (args.rates or args.modes) and not args.quick]
                result[part]["rows"] = sorted(kept + result[part]["rows"],
                                              key=lambda r: (r["mbit"], list(WAN["modes"]).index(r["mode"])))
                add_ratios(result[part]["rows"])
        elif part in previous:  # keep the figures of a part not run now, with the machine they were taken on
            result[part] = dict(previous[part], machine=previous[part].get("machine", previous.get("machine")))
    if not args.quick:
        write_report(result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1, default=str)[:4000])
    if math.isnan(result.get("quality", {}).get("diloco_over_sync", 0.0) or 0.0):
        sys.exit(1)


if __name__ == "__main__":
    main()
