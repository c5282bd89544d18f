"""Hugging Face Accelerate training script that trains as a peer of a collabopt swarm.

It is a plain Accelerate script with two lines changed: the import of ``Accelerator`` and its construction
(``run_id`` and ``target_batch_size`` added). Run it on one machine with 2 CPU processes (acting as ONE peer)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        examples/accelerate_train.py --cpu

(``accelerate launch --cpu --num_processes 2`` would start a single process.) With GPUs:
``accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 examples/accelerate_train.py``.
The first peer prints how others join; on another machine (or in another terminal)::

    INITIAL_PEERS=/ip4/.../p2p/... accelerate launch ... examples/accelerate_train.py --cpu
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from collabopt.integrations.accelerate import CollaborativeAccelerator as Accelerator
from sklearn.datasets import load_digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20, help="passes over this process's data")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--cpu", action="store_true", help="train on CPU (gloo) even if a GPU is present")
    parser.add_argument("--checkpoint-dir", default=None, help="save_state here after every data epoch")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=args.cpu, run_id="acc_digits", target_batch_size=512)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    train, test = order[:1500], order[1500:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]),
                                         batch_size=args.batch_size, shuffle=True)

    torch.manual_seed(0)  # every process and every peer starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if args.checkpoint_dir:
        try:
            accelerator.load_state(args.checkpoint_dir)
        except (FileNotFoundError, ValueError):
            accelerator.print(f"no checkpoint in {args.checkpoint_dir}, starting fresh")

    for epoch in range(args.epochs):
        model.train()
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        accelerator.log({"train_loss": loss.item()}, step=epoch)
        accelerator.print(f"epoch {epoch}: loss {loss.item():.3f}, lr {scheduler.get_last_lr()[0]:.2e}")
        if args.checkpoint_dir:
            accelerator.save_state(args.checkpoint_dir)

    model.eval()
    with torch.no_grad():
        predictions = model(x[test].to(accelerator.device)).argmax(dim=1).cpu()
    accelerator.print(f"held-out accuracy: {(predictions == y[test]).float().mean().item():.3f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
