"""Gradients of a parameter list, cleared or scaled in place (the core and a node's ranks do both alike)."""

from __future__ import annotations

import torch


@torch.no_grad()
def zero_grads(params: list[torch.Tensor], set_to_none: bool) -> None:
    """Clear the gradients of ``params`` (drop them, or fill them with zeros)."""
    for p in params:
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()


@torch.no_grad()
def scale_grads(params: list[torch.Tensor], factor: float) -> None:
    """Multiply the gradients of ``params`` by ``factor`` in place."""
    if factor == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)
