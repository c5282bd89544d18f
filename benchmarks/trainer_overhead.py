"""Trainer overhead: time per local step of ``CollaborativeTrainer`` (one peer, alone in its swarm) against a plain
``transformers.Trainer`` training the same GPT-2 (built from a config) on the same batches.

Each variant runs in a process of its own, as a user's script does (collabopt sets glibc's malloc thresholds for its
process), one process per round, alternating plain / collaborative. In each, a callback times the intervals between
the ends of consecutive optimizer steps: everything the Trainer does per step (data loader, forward, backward,
clipping, optimizer step, callbacks, logging every 10 steps) is inside. The first ``warmup`` intervals are left out.
A round's ratio is the collaborative median over the plain median of the round before it; the reported figure is
the median of the rounds' ratios (and their range).

The cadence differs as it does for a user: the plain Trainer steps AdamW at every local step; the lone peer
accumulates gradients and steps once per global epoch (``target_batch_size`` = ``steps_per_epoch`` local batches),
so its boundary steps are in its mean, not in its median.

Run: ``python -m benchmarks.trainer_overhead [--rounds 3] [--steps 150]``; writes
``benchmarks/results/trainer_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine_info, median, run_module, write_json

RESULT = ROOT / "benchmarks" / "results" / "trainer_overhead.json"
BATCH, LENGTH, STEPS_PER_EPOCH = 16, 64, 20


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """One variant in this process: train for ``cfg["steps"]`` local steps; return the step intervals."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=LENGTH, n_embd=128, n_layer=4, n_head=4))
    ids = torch.randint(0, 512, (BATCH * 50, LENGTH), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    collaborative = cfg["variant"] == "collaborative"
    args = TrainingArguments(
        output_dir=cfg["output_dir"], per_device_train_batch_size=BATCH, learning_rate=1e-3, logging_steps=10,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        max_steps=cfg["steps"] // STEPS_PER_EPOCH if collaborative else cfg["steps"],
    )
    ends: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    if collaborative:
        from collabopt.integrations.transformers import CollaborativeTrainer

        trainer: Any = CollaborativeTrainer(
            model=model, args=args, train_dataset=data, callbacks=[Timer()], run_id=f"overhead_{uuid.uuid4().hex[:8]}",
            target_batch_size=BATCH * STEPS_PER_EPOCH, host_maddrs=["/ip4/127.0.0.1/tcp/0"], print_join_message=False)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Timer()])
    trainer.train()
    intervals = [b - a for a, b in zip(ends, ends[1:], strict=False)][cfg["warmup"]:]
    return {"variant": cfg["variant"], "steps": len(ends), "median_s": median(intervals),
            "mean_s": sum(intervals) / len(intervals), "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="local steps per run (a multiple of 20)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default=str(RESULT))
    options = parser.parse_args()
    info = machine_info()
    runs = []
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(options.rounds):
            for variant in ("plain", "collaborative"):
                cfg = dict(variant=variant, steps=options.steps, warmup=options.warmup,
                           output_dir=str(Path(workdir) / f"{variant}{round_index}"))
                runs.append(run_module("benchmarks.trainer_overhead", cfg, Path(workdir), timeout=600,
                                       name=f"{variant}{round_index}"))
                print(json.dumps(runs[-1]), flush=True)
    ratios = [c["median_s"] / p["median_s"] for p, c in zip(runs[::2], runs[1::2], strict=True)]
    mean_ratios = [c["mean_s"] / p["mean_s"] for p, c in zip(runs[::2], runs[1::2], strict=True)]
    result = {"machine": info, "batch": BATCH, "sequence_length": LENGTH, "steps_per_epoch": STEPS_PER_EPOCH,
              "runs": runs, "median_step_ratio": median(ratios), "median_step_ratios": ratios,
              "mean_step_ratio": median(mean_ratios), "mean_step_ratios": mean_ratios}
    write_json(options.out, result)
    print(f"CollaborativeTrainer / Trainer, time per local step: median {result['median_step_ratio']:.3f} "
          f"(rounds {min(ratios):.3f}..{max(ratios):.3f}); mean (epoch boundaries included) "
          f"{result['mean_step_ratio']:.3f}")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):  # a variant, started by main() through run_module
        config = json.loads(Path(sys.argv[1]).read_text())
        write_json(config["out"], train(config))
    else:
        main()
