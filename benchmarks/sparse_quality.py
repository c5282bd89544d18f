"""Quality of the compressed pseudo-gradients (``pseudo_gradient_compression=SparseLoCo(...)``) against fp16 DiLoCo,
on B6's corpus and model, in one process, no network: the held-out loss at equal samples.

B6's quality bed (:mod:`benchmarks.diloco`): a character-level MLP over 16 characters (about 130k parameters) on
this repository's Markdown text, 4 workers, AdamW lr 3e-3, batch 64. The text is that of a commit (``--corpus-commit``,
HEAD by default; its SHA-256 and size are in the results), not the working tree's: others edit the tree meanwhile,
and a changed text changes every loss (a 0.6% longer text moved fp16's loss after 2,000 steps by up to 4%). Here
the 4 workers run in one process, each on its own random windows of the training text, and a round is computed as
collabopt computes it, without the transport:

* ``fp16``: each pseudo-gradient (``anchor - parameters``) rounded to fp16, their mean rounded to fp16 (what the
  all-reduce of fp16 parts delivers, up to the rounding of its partial sums), then collabopt's DiLoCo outer step (SGD
  lr 0.7, Nesterov momentum 0.9, as B6);
* a compressed variant ``d<density>-b<bits>-e<decay>-<outer>[-k<max contributors>]``: what a peer's
  :class:`~collabopt.engine.diloco_averaging.SparsePseudoGradientRounds` does in a round every member applies: each
  worker's payload from its error-feedback buffer (``ErrorFeedback.compress``, then ``commit``), the members'
  aggregate (:func:`~collabopt.sparse_aggregation.aggregate`, weights the samples), then the outer step ``sgd<lr>``
  (SGD without momentum, ``SparseLoCo.outer_optimizer(lr)``) or ``nest<lr>`` (SGD, Nesterov momentum 0.9); with
  more workers than ``SparseLoCo.max_contributors`` (``-k``; default: SparseLoCo's), the contributors of each round
  are chosen by the exchange's rule (:func:`collabopt.engine.gather_protocol.contributors`) and the others keep
  their whole pseudo-gradient in their error feedback (``ErrorFeedback.defer``) and count as zeros in the aggregate
  (``aggregate(waiting=...)``), as a peer does;
* ``fp16-sgd<lr>``: the fp16 mean with an outer step without momentum (what the outer step alone changes).

Every variant of a seed starts from the same initial model and trains on the same batches of the same text, so each
ratio (the variant's held-out loss over fp16's after the same samples) is paired; the table gives its median and
range over seeds, after all the samples and after half of them.

    .venv/bin/python -m benchmarks.sparse_quality --inner-steps 20 100 --samples-steps 2000 --seeds 0 1 2 \\
        --variants fp16 d0.02-b2-e0.95-sgd1.0

Writes ``benchmarks/results/sparse_quality.{json,md}`` (``--out`` to change; ``--merge`` keeps the runs already
there; ``--combine a.json b.json`` only merges the runs of those files, e.g. of two processes run side by side).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import ROOT, machine_info, write_json
from benchmarks.diloco import char_model, encode, windows
from collabopt.diloco_options import SparseLoCo
from collabopt.engine import gather_protocol as protocol
from collabopt.sparse_aggregation import aggregate

WORKERS = 4
BATCH = 64
INNER_LR = 3e-3
FP16_OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)  # collabopt's DiLoCo outer step (B6's)
BOUND = 1.02
VARIANT = re.compile(r"^d(?P<density>[0-9.]+)-b(?P<bits>\d+)-e(?P<decay>[0-9.]+)-(?P<outer>sgd|nest)(?P<lr>[0-9.]+)"
                     r"(?:-k(?P<k>\d+))?$")


def parse_variant(name: str) -> dict[str, Any]:
    """The settings a variant's name gives (see the module docstring)."""
    if name == "fp16":
        return dict(compression=None, outer=FP16_OUTER)
    if re.fullmatch(r"fp16-sgd[0-9.]+", name):
        return dict(compression=None, outer=dict(lr=float(name[len("fp16-sgd"):])))
    match = VARIANT.match(name)
    if not match:
        raise SystemExit(f"--variants: {name!r} is not fp16, fp16-sgd<lr> or d<density>-b<bits>-e<decay>-sgd|nest<lr>"
                         "[-k<max contributors>] (e.g. d0.02-b2-e0.95-sgd1.0)")
    lr = float(match["lr"])
    outer = dict(lr=lr) if match["outer"] == "sgd" else dict(lr=lr, momentum=0.9, nesterov=True)
    contributors = {} if match["k"] is None else dict(max_contributors=int(match["k"]))
    return dict(compression=SparseLoCo(density=float(match["density"]), bits=int(match["bits"]),
                                       error_decay=float(match["decay"]), **contributors), outer=outer)


def fp16_mean(deltas: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The mean of the workers' pseudo-gradients as fp16 transport gives it: each sent in fp16, the mean in fp16."""
    return [(sum(d.half().float() for d in parts) / len(parts)).half().float() for parts in zip(*deltas, strict=True)]


def run(name: str, inner_steps: int, rounds: int, seed: int, data: dict[str, Any],
        workers: int = WORKERS) -> dict[str, Any]:
    """One variant, one seed: ``rounds`` rounds of ``inner_steps`` steps per worker (``workers`` of them). The
    held-out loss after every round, the bytes a worker sent a round, per parameter, and (compressed) the share of
    the aggregate's entries that are not zero after every round (``union``: the workers' kept entries together)."""
    settings = parse_variant(name)
    option: SparseLoCo | None = settings["compression"]
    started = time.monotonic()
    model = char_model(data["vocab"])
    torch.manual_seed(seed)  # (the initial model of every variant of this seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    anchor = [p.detach().clone() for p in model.parameters()]
    shapes = [tuple(t.shape) for t in anchor]
    numel = sum(t.numel() for t in anchor)
    nets = [char_model(data["vocab"]) for _ in range(workers)]  # (set to the anchor at every round)
    inner = [torch.optim.AdamW(w.parameters(), lr=INNER_LR) for w in nets]  # (each keeps its state, as a peer)
    feedback = [option.error_feedback(shapes) for _ in range(workers)] if option else []
    outer_params = [torch.nn.Parameter(t.clone()) for t in anchor]
    outer = torch.optim.SGD(outer_params, **settings["outer"])
    generators = [torch.Generator().manual_seed(1000 * seed + rank) for rank in range(workers)]  # (the batches)
    losses, unions, sent = [], [], 0
    ids = [b"worker-%d" % rank for rank in range(workers)]
    for index in range(rounds):
        deltas, contributions = [], {}
        chosen = protocol.contributors(b"seed %d round %d" % (seed, index), ids,
                                       option.max_contributors if option else None)
        for rank, (worker, optimizer) in enumerate(zip(nets, inner, strict=True)):
            with torch.no_grad():
                for p, value in zip(worker.parameters(), anchor, strict=True):
                    p.copy_(value)
            for _ in range(inner_steps):
                x, y = windows(data["train"], BATCH, generators[rank])
                optimizer.zero_grad()
                F.cross_entropy(worker(x), y).backward()
                optimizer.step()
            delta = [a - p.detach() for a, p in zip(anchor, worker.parameters(), strict=True)]
            if option:
                payload = feedback[rank].compress(delta)
                if rank in chosen:
                    feedback[rank].commit()  # (the round is applied: SparsePseudoGradientRounds.settle(applied=True))
                    sent += len(payload)
                    contributions[f"worker-{rank}"] = (float(inner_steps * BATCH), payload)
                else:  # (not a contributor: its whole pseudo-gradient stays in its buffer, undecayed)
                    feedback[rank].defer()
            deltas.append(delta)
        if option:
            averaged = aggregate(contributions, shapes, option.codec, waiting=workers - len(chosen))
            unions.append(round(sum(int(t.count_nonzero()) for t in averaged) / numel, 5))
        else:
            averaged = fp16_mean(deltas)
            sent += workers * 2 * numel
        with torch.no_grad():  # (the outer step from the anchor, its gradient the aggregate, as DiLoCo's round)
            for p, value, grad in zip(outer_params, anchor, averaged, strict=True):
                p.copy_(value)
                p.grad = grad.clone()
        outer.step()
        anchor = [p.detach().clone() for p in outer_params]
        with torch.no_grad():
            for p, value in zip(model.parameters(), anchor, strict=True):
                p.copy_(value)
            losses.append(float(F.cross_entropy(model(data["eval_x"]), data["eval_y"])))
    return dict(variant=name, inner_steps=inner_steps, rounds=rounds, seed=seed, final_loss=losses[-1],
                losses=[round(v, 5) for v in losses], bytes_per_param_round=sent / workers / rounds / numel,
                numel=numel, corpus=data["corpus"]["sha256"][:12], seconds=round(time.monotonic() - started, 1),
                workers=workers, union=unions)


def git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout


def corpus_at(commit: str) -> str:
    """B6's corpus (:func:`benchmarks.diloco.corpus`: the Markdown files sorted by path, concatenated) as of
    ``commit``."""
    names = git("ls-tree", "-r", "-z", "--name-only", commit).decode().split("\0")
    names = sorted(name for name in names if name.endswith(".md"))
    return "".join(git("show", f"{commit}:{name}").decode(errors="replace") for name in names)


def load_data(commit: str) -> dict[str, Any]:
    """The training ids, B6's held-out windows and the vocabulary of the corpus of ``commit``."""
    text = corpus_at(commit)
    train, held_out, vocab = encode(text)
    eval_x, eval_y = windows(held_out, 4096, torch.Generator().manual_seed(123))  # (B6's held-out windows)
    return dict(train=train, eval_x=eval_x, eval_y=eval_y, vocab=vocab, corpus=dict(
        commit=commit, chars=len(text), sha256=hashlib.sha256(text.encode()).hexdigest()))


def _spread(values: list[float]) -> dict[str, float | None]:
    values = sorted(values)
    if not values:
        return dict(median=None, min=None, max=None)
    return dict(median=round(statistics.median(values), 4), min=round(values[0], 4), max=round(values[-1], 4))


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per corpus, inner-step count, round count and variant: the ratio of its held-out loss to fp16's of the same
    seed after all rounds (median, range) and after half of them (median); meets the bound where the median and
    every seed's final ratio are at most :data:`BOUND`."""
    def setting(r: dict[str, Any]) -> tuple[str, int, int, int]:
        return r["corpus"], r["inner_steps"], r["rounds"], r.get("workers", WORKERS)

    base = {(*setting(r), r["seed"]): r for r in runs if r["variant"] == "fp16"}
    rows = []
    for key in sorted({(*setting(r), r["variant"]) for r in runs}, key=lambda k: (k[3], k[1], k[2], k[0], k[4])):
        mine = sorted((r for r in runs if (*setting(r), r["variant"]) == key), key=lambda r: r["seed"])
        paired = [(r, base[(*key[:4], r["seed"])]) for r in mine if (*key[:4], r["seed"]) in base]
        ratios = {r["seed"]: r["final_loss"] / b["final_loss"] for r, b in paired}
        half = key[2] // 2 - 1
        halves = [r["losses"][half] / b["losses"][half] for r, b in paired if half >= 0]
        final = _spread(list(ratios.values()))
        rows.append(dict(corpus=key[0], inner_steps=key[1], rounds=key[2], workers=key[3], variant=key[4],
                         seeds=sorted(ratios),
                         losses={r["seed"]: round(r["final_loss"], 4) for r in mine},
                         ratios={s: round(v, 4) for s, v in ratios.items()},
                         ratio_median=final["median"], ratio_min=final["min"], ratio_max=final["max"],
                         half_ratio_median=_spread(halves)["median"],
                         bytes_per_param_round=round(mine[0]["bytes_per_param_round"], 4),
                         meets_bound=bool(ratios) and final["median"] <= BOUND and final["max"] <= BOUND))
    return rows


def report(result: dict[str, Any]) -> str:
    """The Markdown table of :func:`summarize`'s rows, after the machine, code, command and corpus of each batch of
    runs."""
    lines = ["# Compressed pseudo-gradients against fp16 DiLoCo (B6's corpus and model, one process)", "",
             f"Workers as each row says, AdamW lr {INNER_LR}, batch {BATCH}; rows of the same corpus, workers, "
             "inner steps and rounds saw the same samples. fp16: the mean of fp16 pseudo-gradients, outer "
             "SGD lr 0.7 Nesterov 0.9 (collabopt's DiLoCo default). Variants: d<density>-b<bits>-e<error "
             "decay>-sgd<lr> (outer SGD without momentum, `SparseLoCo.outer_optimizer(lr)`) or -nest<lr> (Nesterov "
             "0.9), -k<n>: at most n contributors a round (`max_contributors`); fp16-sgd<lr>: fp16 with that "
             "outer step. Ratio: held-out loss (cross-entropy, nats) over fp16's of the same seed, after all rounds "
             f"(median and range over seeds) and after half of them (median); bound {BOUND}x (the median and every "
             "seed).", "", "Batches of runs:", ""]
    for batch in result["batches"]:
        m, corpus, dirty = batch["machine"], batch["corpus"], batch.get("dirty") or []
        code = f"`{m.get('git_commit', '?')}`" + (f" plus uncommitted changes to {', '.join(dirty)}" if dirty else "")
        lines.append(f"* `{batch['command']}`: host `{m.get('host', '?')}` ({m.get('cpu', '?')}, "
                     f"{m.get('cpus', '?')} CPUs, load {m.get('load_avg_1m_at_start', '?')} at start), "
                     f"{m.get('date_utc', '?')}, torch {m.get('torch', '?')}, code {code}; corpus "
                     f"`{corpus['sha256'][:12]}`: the Markdown of commit `{corpus['commit']}`, {corpus['chars']} "
                     "characters.")
    lines += ["", "| corpus | workers | inner steps | rounds | variant | bytes/param/round | final loss per seed "
              "| ratio median | range | ratio at half (median) | <= bound |",
              "|---|---:|---:|---:|---|---:|---|---:|---|---:|:-:|"]
    for row in result["summary"]:
        losses = ", ".join(f"{v:.4f}" for _, v in sorted(row["losses"].items()))
        bound = "-" if row["variant"] == "fp16" else ("yes" if row["meets_bound"] else "no")
        lines.append(f"| {row['corpus']} | {row.get('workers', WORKERS)} | {row['inner_steps']} | {row['rounds']} "
                     f"| {row['variant']} | "
                     f"{row['bytes_per_param_round']} | {losses} | {row['ratio_median']} | "
                     f"{row['ratio_min']}..{row['ratio_max']} | {row['half_ratio_median']} | {bound} |")
    return "\n".join(lines) + "\n"


def dirty_code() -> list[str]:
    """Uncommitted changes to the code under measure (the working tree is shared by several writers)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "collabopt", "benchmarks/sparse_quality.py",
                          "benchmarks/diloco.py"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
    return [line[3:] for line in out.splitlines()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--samples-steps", type=int, default=2000,
                        help="inner steps per worker in all (rounds = this / inner steps)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--variants", nargs="+", default=["fp16", "d0.02-b2-e0.95-sgd1.0"])
    parser.add_argument("--corpus-commit", default="HEAD", help="the commit whose Markdown is the text")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sparse_quality")
    parser.add_argument("--merge", action="store_true", help="keep the runs already in --out's JSON")
    parser.add_argument("--combine", type=Path, nargs="+", help="run nothing: merge the runs of these JSON files")
    args = parser.parse_args(argv)
    for name in args.variants:
        parse_variant(name)
    batches: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for path in ([args.out.with_suffix(".json")] if args.merge and args.out.with_suffix(".json").exists() else []) + (
            args.combine or []):
        loaded = json.loads(path.read_text())
        batches += loaded["batches"]
        runs += loaded["runs"]
    if not args.combine:
        torch.set_num_threads(1)
        commit = git("rev-parse", "--short", args.corpus_commit).decode().strip()
        data = load_data(commit)
        command = "python -m benchmarks.sparse_quality " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        batches.append(dict(machine=machine_info(), dirty=dirty_code(), command=command, corpus=data["corpus"]))
        for inner_steps in args.inner_steps:
            rounds = args.samples_steps // inner_steps
            for seed in args.seeds:
                for name in args.variants:
                    key = (data["corpus"]["sha256"][:12], name, inner_steps, rounds, seed, args.workers)
                    runs = [r for r in runs if (r["corpus"], r["variant"], r["inner_steps"], r["rounds"], r["seed"],
                                                r.get("workers", WORKERS)) != key]  # (the same key: replaced)
                    runs.append(run(name, inner_steps, rounds, seed, data, workers=args.workers))
                    print(f"H={inner_steps} seed {seed} {name:24s} loss {runs[-1]['final_loss']:.4f} "
                          f"({runs[-1]['seconds']:.0f} s)", flush=True)
    result = dict(workers=args.workers, batch=BATCH, inner_lr=INNER_LR, bound=BOUND, batches=batches, runs=runs,
                  summary=summarize(runs))
    write_json(args.out.with_suffix(".json"), result)
    args.out.with_suffix(".md").write_text(report(result))
    for row in result["summary"]:
        print(f"{row['corpus']} H={row['inner_steps']:4d} x {row['rounds']:3d} {row['variant']:24s} ratio "
              f"{row['ratio_median']} ({row['ratio_min']}..{row['ratio_max']}) at half {row['half_ratio_median']} "
              f"bytes/param/round {row['bytes_per_param_round']}")


if __name__ == "__main__":
    main()
