"""Hugging Face ``Trainer`` script that trains as a peer of a collabopt swarm.

It is a plain ``transformers.Trainer`` script with two changes: the import of ``Trainer`` and two arguments of its
construction (``run_id`` and ``target_batch_size``). It trains a small character-level GPT-2, built from a config
with random weights, on the docstrings of Python's standard library (nothing is downloaded), on CPU::

    python examples/transformers_train.py

The first peer prints how others join; in another terminal (or on another machine)::

    INITIAL_PEERS=/ip4/.../p2p/... python examples/transformers_train.py

``--max-steps`` counts global epochs (swarm-wide optimizer steps of ``target_batch_size`` samples), and so does the
LR schedule. Several processes of one machine are one peer:
``torchrun --nproc_per_node 2 examples/transformers_train.py`` (or ``accelerate launch``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os

import torch
from collabopt.integrations.transformers import CollaborativeTrainer as Trainer
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

MODULES = ("argparse", "collections", "functools", "itertools", "json", "logging", "pathlib", "re", "subprocess",
           "threading", "unittest", "urllib.request", "zipfile", "asyncio", "dataclasses", "inspect")


def stdlib_text() -> bytes:
    """English text shipped with Python: the docstrings of some standard library modules and their members."""
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts += [module.__doc__] + [getattr(member, "__doc__", None) for member in vars(module).values()
                                     if callable(member)]
    return "\n".join(p for p in parts if isinstance(p, str)).encode("utf-8", errors="ignore")


def chunks(text: bytes, length: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.tensor(list(text), dtype=torch.long)
    rows = ids[: len(ids) // length * length].view(-1, length)
    return [{"input_ids": row, "labels": row} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=40, help="global epochs to train for")
    parser.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size")
    parser.add_argument("--output-dir", default="transformers_train_output")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    args = parser.parse_args()

    data = chunks(stdlib_text(), length=64)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(data), generator=generator).tolist()
    test, train = [data[i] for i in order[:128]], [data[i] for i in order[128:]]

    torch.manual_seed(0)  # every peer starts from the same weights
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="cosine",
        weight_decay=0.01, logging_steps=10, save_steps=100, save_total_limit=2, report_to=[], use_cpu=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                      run_id="hf_charlm", target_batch_size=256)
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    after = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero():
        print(f"held-out loss: {before:.3f} -> {after:.3f} (perplexity {math.exp(after):.1f} per byte)")
    trainer.save_model(os.path.join(args.output_dir, "final"))  # written once, by the main process
    trainer.accelerator.end_training()  # torchrun: leave the process group (Trainer.end() in transformers 5)


if __name__ == "__main__":
    main()
