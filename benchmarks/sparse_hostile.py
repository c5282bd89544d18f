"""Compressed DiLoCo with a hostile member: 1 of 4 peers attacks, honest peers' held-out loss against a clean run.

    python -m benchmarks.sparse_hostile            # 9 swarms of 4 peers, about 10 minutes on 2 cores
    python -m benchmarks.sparse_hostile --quick    # 2 short swarms: checks the harness (writes nothing)

Every swarm is 4 OS processes of ``tests/swarm/diloco_worker.py`` on loopback against one bootstrap DHT, in
DiLoCo mode with ``pseudo_gradient_compression=SparseLoCo()`` (its defaults) and SparseLoCo's outer step (SGD lr
1.0, no momentum): each member sends its signed compressed payload to every other member and aggregates the set
itself (:mod:`collabopt.sparse_aggregation`). Peers p0-p2 are honest; in an attacked swarm p3 is hostile
(diloco_worker.py ``attack``, :func:`attack_rounds` there), with the three attacks of the synchronous mode's check
(tests/swarm/test_robustness.py): what it sends in every round is its pseudo-gradient times -20; or it plus Gaussian
noise at 100x its norm; or it claims 1,000x the samples it trained on, its pseudo-gradient taken from steps on wrong
labels (every label shifted by one: a claim of an honest pseudo-gradient only gives it more weight). The claim is in
the round's weight, which is what the aggregate weighs; the samples it reports for the swarm's progress stay true
(a claim there only brings the rounds sooner for everyone).

Each attack runs once with ``aggregation="centered_clip"`` and once with ``"mean"``; a clean swarm (4 honest peers,
``"mean"``) is the reference, and a second clean swarm run last gives the spread of two runs with no attack. Every
swarm uses the same seeds (peer i: seed i, the same initial model, the same data). The figure is the honest peers'
loss on held-out samples (the last ``held_out`` samples of the data, never trained on) at the swarm's last epoch,
right after its round: there the honest peers hold the round's aggregate applied to the same anchor, which the
runner checks (max |difference| of their parameters at that epoch; the aggregate is computed alike on every member,
so it is 0). The check (docs/faults.md): centered_clip within 1.1x the clean loss, mean at 2x it or more.

Swarms are not deterministic: when a round starts depends on timing, so each peer's inner steps per round vary, and
two clean swarms differ too (the repeated clean swarm shows by how much). :func:`replica` computes the same rounds in
one process without timing, for 3 seeds, and says how far the aggregate is from the honest members' mean each round.

Writes ``benchmarks/results/sparse_hostile.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine_info, spawner, worst, write_json
from collabopt import processes
from collabopt.processes import Process

WORKER = ROOT / "tests" / "swarm" / "diloco_worker.py"
RESULTS = ROOT / "benchmarks" / "results"
HONEST = ("p0", "p1", "p2")
HOSTILE = "p3"
ATTACKS = {
    "times_minus_20": dict(scale=-20.0),
    "noise_100x": dict(noise=100.0),
    "claim_1000x": dict(claim=1000, wrong_labels=True),
}
AGGREGATIONS = ("centered_clip", "mean")
CLIP_BOUND = 1.1  # centered_clip: the honest peers' loss at most this times the clean run's
MEAN_BOUND = 2.0  # mean: at least this times it (the attack hurts where nothing bounds it)

# 4 peers x batch 64 x 10 inner steps a round; 8 rounds of a 16-64-4 MLP (the swarm tests' data: 4 classes of a
# random linear map of 16 Gaussian features)
FULL: dict[str, Any] = dict(epochs=8, batch=64, inner_steps=10, hidden=64, lr=0.01, held_out=1024, step_sleep=0.02,
                            max_seconds=150, clean_repeat=True, attacks=list(ATTACKS), replica_seeds=[0, 1, 2])
QUICK: dict[str, Any] = dict(FULL, epochs=2, clean_repeat=False, attacks=["times_minus_20"], replica_seeds=[0])


# ---------------------------------------------------------------- one swarm

def peer_configs(cfg: dict[str, Any], run_dir: Path, aggregation: str, attack: dict | None) -> dict[str, dict]:
    """The 4 workers' configs: peer i on seed i, p3 hostile where ``attack`` is given. An honest peer trains on until
    the other honest peers reached the last epoch; a hostile one until the honest ones did."""
    run_id = f"sparse_hostile_{uuid.uuid4().hex[:10]}"
    names = (*HONEST, HOSTILE)
    configs = {}
    for index, name in enumerate(names):
        waits_for = [n for n in names if n != name and n != HOSTILE] if attack is not None else \
            [n for n in names if n != name]
        config = dict(run_id=run_id, target_batch_size=len(names) * cfg["batch"] * cfg["inner_steps"],
                      epochs=cfg["epochs"], batch_sizes=[cfg["batch"]], seed=index, model_seed=0, data_seed=0,
                      hidden=cfg["hidden"], lr=cfg["lr"], held_out=cfg["held_out"], step_sleep=cfg["step_sleep"],
                      max_seconds=cfg["max_seconds"], wait_peers=len(names), sparse={}, outer=dict(lr=1.0),
                      aggregation=aggregation, out=str(run_dir / name),
                      finish_with=[str(run_dir / other) for other in waits_for])
        if name == HOSTILE and attack is not None:
            config["attack"] = attack
        configs[name] = config
    return configs


def run_swarm(cfg: dict[str, Any], workdir: Path, initial_peers: str, name: str, aggregation: str,
              attack: dict | None) -> dict[str, Any]:
    """Run one swarm until its honest peers exit; return :func:`measure`'s figures on their records."""
    import torch

    run_dir = workdir / name
    run_dir.mkdir()
    env = processes.child_env("INFO", INITIAL_PEERS=initial_peers,
                              PYTHONPATH=os.pathsep.join([str(WORKER.parent), str(ROOT)]))
    procs = {}
    began = time.monotonic()
    try:
        for peer, config in peer_configs(cfg, run_dir, aggregation, attack).items():
            write_json(run_dir / f"{peer}.config.json", config)
            procs[peer] = Process([sys.executable, str(WORKER), str(run_dir / f"{peer}.config.json")],
                                  run_dir / f"{peer}.log", env=env, cwd=ROOT, spawn=spawner())
        deadline = time.monotonic() + cfg["max_seconds"] + 60
        for peer in HONEST:
            code = procs[peer].wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"{name}: {peer} exited with {code}; log ends with:\n{procs[peer].tail()}")
    finally:
        for proc in procs.values():
            proc.kill_tree()  # (the hostile peer may still wait for a round nobody else joins)
    records = {peer: json.loads((run_dir / f"{peer}.json").read_text()) for peer in HONEST}
    params = {peer: torch.load(run_dir / f"{peer}.pt")["after"] for peer in HONEST}
    return dict(name=name, aggregation=aggregation, attack=attack, seconds=round(time.monotonic() - began, 1),
                **measure(records, params, cfg["epochs"]))


def measure(records: dict[str, dict], params: dict[str, dict], target: int) -> dict[str, Any]:
    """The honest peers' figures at the last epoch all of them reached by ``target`` (the target itself unless a peer
    skipped it): their held-out loss there (inf where not finite), the max |difference| of their parameters there, and
    per peer the rounds it applied up to it and in groups of 4 (the hostile member among them)."""
    common = set.intersection(*({int(e) for e in r.get("held_out_losses", {})} for r in records.values()))
    epoch = max((e for e in common if e <= target), default=None)
    if epoch is None:
        raise RuntimeError(f"the honest peers reached no common epoch: {[r['rounds'] for r in records.values()]}")
    losses = {peer: r["held_out_losses"][str(epoch)] for peer, r in records.items()}
    names = sorted(params)
    diff = worst(float((params[a][epoch][k].double() - params[b][epoch][k].double()).abs().max())
                 for a in names for b in names if a < b for k in params[a][epoch])
    rounds = {peer: [x for x in r["rounds"] if x["epoch"] <= epoch and x["applied"]] for peer, r in records.items()}
    return dict(epoch=epoch, held_out_losses=losses,
                loss=statistics.mean(v if math.isfinite(v) else math.inf for v in losses.values()),
                max_param_diff=diff if math.isfinite(diff) else math.inf,
                rounds_applied={peer: len(x) for peer, x in rounds.items()},
                rounds_of_4={peer: sum(1 for x in v if x["group_size"] == 4) for peer, v in rounds.items()},
                start_loss=statistics.mean(r["start_loss"] for r in records.values()))


# ---------------------------------------------------------------- the same rounds in one process, without timing

def replica(cfg: dict[str, Any], seed: int, aggregation: str, attack: dict | None) -> dict[str, Any]:
    """The swarm's rounds computed in one process, deterministic (no timing decides who trains how much): every
    member trains ``inner_steps`` steps a round from the anchor (its AdamW state kept), on batches of its own
    generator (seed ``100 * seed + member``); its payload is ``ErrorFeedback.compress`` of its pseudo-gradient,
    altered first by the hostile member p3 as diloco_worker.py's ``attack`` does, at weight its samples (times the
    claim); every round is :func:`~collabopt.sparse_aggregation.aggregate` of the 4, then the outer step (SGD lr 1.0).

    Returns the held-out loss after the last round and, averaged over rounds, how far the aggregate is from the
    honest members' mean (``deviation``: ``|aggregate - honest mean| / |honest mean|``) and how far apart the honest
    payloads are (``spread``: the mean ``|honest payload| / |honest mean|``; 1 where they agree, sqrt(3) for 3
    orthogonal ones of equal norm). CenteredClip moves the aggregate by up to the hostile member's weight share times
    its radius, the honest payloads' distance from their median: the spread sets that distance."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(WORKER.parent))
    from peer_worker import make_data, make_model

    from collabopt.diloco_options import SparseLoCo
    from collabopt.sparse_aggregation import aggregate

    sparse, spec, held_out = SparseLoCo(), attack or {}, cfg["held_out"]
    x_all, y_all = make_data(0)
    members = [make_model(0, hidden=cfg["hidden"]) for _ in range(len(HONEST) + 1)]
    inner = [torch.optim.AdamW(m.parameters(), lr=cfg["lr"]) for m in members]
    anchor = [p.detach().clone() for p in members[0].parameters()]
    shapes = [tuple(a.shape) for a in anchor]
    feedback = [sparse.error_feedback(shapes) for _ in members]
    generators = [torch.Generator().manual_seed(100 * seed + i) for i in range(len(members))]

    def flat(tensors: list[Any]) -> Any:
        return torch.cat([t.reshape(-1) for t in tensors]).double()

    deviations, spreads = [], []
    for _ in range(cfg["epochs"]):
        contributions = {}
        for i, (model, optimizer) in enumerate(zip(members, inner, strict=True)):
            hostile = attack is not None and i == len(HONEST)
            with torch.no_grad():
                for p, a in zip(model.parameters(), anchor, strict=True):
                    p.copy_(a)
            for _ in range(cfg["inner_steps"]):
                idx = torch.randint(0, len(x_all) - held_out, (cfg["batch"],), generator=generators[i])
                y = (y_all[idx] + 1) % 4 if hostile and spec.get("wrong_labels") else y_all[idx]
                optimizer.zero_grad()
                F.cross_entropy(model(x_all[idx]), y).backward()
                optimizer.step()
            delta = [a - p.detach() for a, p in zip(anchor, model.parameters(), strict=True)]
            weight = float(cfg["inner_steps"] * cfg["batch"])
            if hostile:
                norm, size = float(flat(delta).norm()), sum(d.numel() for d in delta)
                delta = [d * spec.get("scale", 1.0) + torch.randn(d.shape, generator=generators[i])
                         * (spec.get("noise", 0.0) * norm / size ** 0.5) for d in delta]
                weight *= spec.get("claim", 1)
            contributions[f"p{i}"] = (weight, feedback[i].compress(delta))
            feedback[i].commit()
        result = aggregate(contributions, shapes, sparse.codec, aggregation)
        honest = {name: contributions[name] for name in HONEST}
        mean = flat(aggregate(honest, shapes, sparse.codec, "mean"))
        deviations.append(float((flat(result) - mean).norm() / mean.norm()))
        spreads.append(statistics.mean(float(flat(aggregate({name: c}, shapes, sparse.codec)).norm())
                                       for name, c in honest.items()) / float(mean.norm()))
        anchor = [a - r for a, r in zip(anchor, result, strict=True)]  # (the outer step: SGD lr 1.0)
    model = members[0]
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor, strict=True):
            p.copy_(a)
        loss = float(F.cross_entropy(model(x_all[-held_out:]), y_all[-held_out:]))
    return dict(seed=seed, aggregation=aggregation, attack=attack, loss=loss if math.isfinite(loss) else math.inf,
                deviation=statistics.mean(deviations), spread=statistics.mean(spreads))


def summarize_replicas(replicas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per attack and aggregation: the loss over the clean replica's of the same seed (median and range over seeds),
    and the median deviation and spread (see :func:`replica`)."""
    clean = {r["seed"]: r["loss"] for r in replicas if r["attack"] is None}
    rows = []
    for name in ATTACKS:
        for aggregation in AGGREGATIONS:
            mine = [r for r in replicas if r["attack"] == ATTACKS[name] and r["aggregation"] == aggregation]
            if not mine:
                continue
            ratios = sorted(r["loss"] / clean[r["seed"]] for r in mine)
            rows.append(dict(attack=name, aggregation=aggregation, ratio_median=statistics.median(ratios),
                             ratio_min=ratios[0], ratio_max=ratios[-1], seeds=len(ratios),
                             deviation=statistics.median(r["deviation"] for r in mine),
                             spread=statistics.median(r["spread"] for r in mine)))
    return rows


# ---------------------------------------------------------------- figures (pure: unit-tested)

def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each attacked run's honest loss over the clean run's (``ratio``) and whether it meets its bound (centered_clip
    at most :data:`CLIP_BOUND`, mean at least :data:`MEAN_BOUND`); the repeated clean run's ratio; the worst
    parameter difference of honest peers over all runs."""
    clean = next(r for r in runs if r["name"] == "clean")["loss"]
    rows = []
    for r in runs:
        if r["attack"] is None:
            continue
        ratio = r["loss"] / clean
        met = ratio <= CLIP_BOUND if r["aggregation"] == "centered_clip" else ratio >= MEAN_BOUND
        rows.append(dict(name=r["name"], attack=attack_name(r["attack"]), aggregation=r["aggregation"],
                         loss=r["loss"], ratio=ratio, met=met))
    repeat = [r["loss"] / clean for r in runs if r["name"] == "clean_repeat"]
    return dict(clean_loss=clean, clean_repeat_ratio=repeat[0] if repeat else None, rows=rows,
                all_met=bool(rows) and all(row["met"] for row in rows),
                max_param_diff=worst(r["max_param_diff"] for r in runs))


def attack_name(attack: dict) -> str:
    return next(name for name, spec in ATTACKS.items() if spec == attack)


def report(result: dict[str, Any]) -> str:
    m, c, s = result["machine"], result["config"], result["summary"]
    dirty = result["dirty"]
    code = f"`{m['git_commit']}`" + (f" plus uncommitted changes to {', '.join(dirty)}" if dirty else "")
    lines = [
        "# Compressed DiLoCo with 1 hostile member of 4: honest held-out loss against a clean run", "",
        f"Command: `{result['command']}` (benchmarks/sparse_hostile.py; raw figures in `sparse_hostile.json`).", "",
        f"Host `{m['host']}` ({m['cpu']}, {m['cpus']} CPUs), {m['date_utc']}, load {m['load_avg_1m_at_start']} at "
        f"the start; torch {m['torch']}, hivemind {m['hivemind']}, code of {code}.", "",
        f"Each swarm: 4 processes of tests/swarm/diloco_worker.py on loopback, `pseudo_gradient_compression="
        f"SparseLoCo()` (density 0.02, chunks of 4096, 2 bits, error decay 0.95), outer SGD lr 1.0; a "
        f"16-{c['hidden']}-4 MLP, AdamW lr {c['lr']}, batch {c['batch']}, {c['inner_steps']} inner steps of each "
        f"peer a round (`target_batch_size` {4 * c['batch'] * c['inner_steps']}), {c['epochs']} rounds; the same "
        f"seeds and data in every swarm. Peer p3 is hostile in the attacked swarms: what it sends in every round is "
        f"its pseudo-gradient x -20; or plus Gaussian noise at 100x its norm; or at a weight of 1,000x its samples, "
        f"trained on wrong labels. Loss: the honest peers' cross-entropy on {c['held_out']} held-out samples at the "
        f"last epoch, right after its round (start: {result['runs'][0]['start_loss']:.4f}). Bounds: centered_clip "
        f"<= {CLIP_BOUND}x the clean loss, mean >= {MEAN_BOUND}x.", "",
        "| swarm | aggregation | epoch | honest held-out loss | ratio to clean | bound met | rounds applied "
        "(of them with p3) per honest peer | honest peers' max abs param diff | seconds |",
        "|---|---|---:|---:|---:|:-:|---|---:|---:|",
    ]
    judged = {row["name"]: row["met"] for row in s["rows"]}
    for r in result["runs"]:
        name = attack_name(r["attack"]) if r["attack"] is not None else r["name"]
        ratio = r["loss"] / s["clean_loss"]
        met = "-" if r["name"] not in judged else ("yes" if judged[r["name"]] else "**no**")
        applied = ", ".join(f"{r['rounds_applied'][p]} ({r['rounds_of_4'][p]})" for p in HONEST)
        lines.append(f"| {name} | {r['aggregation']} | {r['epoch']} | {r['loss']:.4f} | {ratio:.3f} | {met} | "
                     f"{applied} | {r['max_param_diff']:.3g} | {r['seconds']:.0f} |")
    verdict = "met" if s["all_met"] else "**not met**"
    repeat = (f"; a second clean swarm: {s['clean_repeat_ratio']:.3f}x the first"
              if s["clean_repeat_ratio"] is not None else "")
    lines += ["", f"Every bound: {verdict}{repeat}. Honest peers' parameters at the compared epoch: max |difference| "
              f"{s['max_param_diff']:.3g} over all swarms."]
    rows = result.get("replica_summary") or []
    if rows:
        lines += ["", "The same rounds in one process, without timing (`replica`: every member the same inner steps a "
                  "round, its own batches; the clean replica of the same seed as reference). Deviation: |aggregate - "
                  "honest members' mean| / |honest mean|; spread: mean |honest payload| / |honest mean| (1: they "
                  "agree; 1.73: 3 orthogonal payloads); both averaged over rounds, medians over seeds.", "",
                  "| attack | aggregation | ratio to clean: median (range, seeds) | deviation | spread |",
                  "|---|---|---:|---:|---:|"]
        for row in rows:
            lines.append(f"| {row['attack']} | {row['aggregation']} | {row['ratio_median']:.3g} "
                         f"({row['ratio_min']:.3g}..{row['ratio_max']:.3g}, {row['seeds']}) | {row['deviation']:.2f} | "
                         f"{row['spread']:.2f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the runner

def plan(cfg: dict[str, Any]) -> list[tuple[str, str, dict | None]]:
    """(name, aggregation, attack) of every swarm, in order: clean first, then each attack under each aggregation,
    then the repeated clean swarm."""
    swarms = [("clean", "mean", None)]
    swarms += [(f"{attack}_{aggregation}", aggregation, ATTACKS[attack])
               for attack in cfg["attacks"] for aggregation in AGGREGATIONS]
    if cfg["clean_repeat"]:
        swarms.append(("clean_repeat", "mean", None))
    return swarms


def dirty_code() -> list[str]:
    """Uncommitted changes to the code under measure (the working tree is shared by several writers)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "collabopt", "benchmarks/sparse_hostile.py",
                          "tests/swarm/diloco_worker.py", "tests/swarm/peer_worker.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=10).stdout
    return [line[3:] for line in out.splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 short swarms: checks the harness (writes nothing)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sparse_hostile")
    args = parser.parse_args(argv)
    command = " ".join(["python -m benchmarks.sparse_hostile",
                        *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    cfg = QUICK if args.quick else FULL
    machine, dirty = machine_info(), dirty_code()
    replicas = [replica(cfg, seed, aggregation, attack) for seed in cfg["replica_seeds"]
                for _, aggregation, attack in plan(dict(cfg, clean_repeat=False))]
    runs = []
    with tempfile.TemporaryDirectory(prefix="collabopt_sparse_hostile_") as workdir:
        bootstrap, initial_peers = processes.start_bootstrap(workdir, dht_args=["--no-relay"], env=processes.child_env(
            PYTHONPATH=str(ROOT)), cwd=ROOT, spawn=spawner())
        try:
            for name, aggregation, attack in plan(cfg):
                runs.append(run_swarm(cfg, Path(workdir), initial_peers, name, aggregation, attack))
                print(json.dumps({k: runs[-1][k] for k in ("name", "epoch", "loss", "max_param_diff",
                                                          "rounds_applied", "rounds_of_4", "seconds")}), flush=True)
        finally:
            bootstrap.kill_tree()
    result = dict(command=command, config=cfg, machine=machine, dirty=dirty, runs=runs, summary=summarize(runs),
                  replicas=replicas, replica_summary=summarize_replicas(replicas))
    print(report(result))
    if not args.quick:
        write_json(args.out.with_suffix(".json"), result)
        args.out.with_suffix(".md").write_text(report(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
