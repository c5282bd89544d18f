"""Scheduler specs shared by the swarm tests and their plain-torch references."""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler


def make_scheduler(spec: str, optimizer: torch.optim.Optimizer):
    if spec == "warmup_lambda":  # HF-style linear warmup then linear decay, a closure (not picklable)
        warmup, total = 3, 20
        return lr_scheduler.LambdaLR(
            optimizer,
            lambda step: (step + 1) / warmup if step < warmup else max(0.0, (total - step) / (total - warmup)),
        )
    if spec == "sequential":
        return lr_scheduler.SequentialLR(
            optimizer,
            [lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=2),
             lr_scheduler.ExponentialLR(optimizer, gamma=0.8)],
            milestones=[2],
        )
    if spec == "chained":
        return lr_scheduler.ChainedScheduler(
            [lr_scheduler.ConstantLR(optimizer, factor=0.5, total_iters=2),
             lr_scheduler.ExponentialLR(optimizer, gamma=0.9)]
        )
    if spec == "plateau":
        return lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0)
    if spec == "exponential":
        return lr_scheduler.ExponentialLR(optimizer, gamma=0.7)
    raise ValueError(spec)


def reference_lrs(spec: str, lr: float, epochs: int, plateau_metric: float = 1.0) -> list[float]:
    """LR after k = 0..epochs plain ``scheduler.step()`` calls, on a plain torch optimizer."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make_scheduler(spec, opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(epochs):
        opt.step()
        sched.step(plateau_metric) if spec == "plateau" else sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs
