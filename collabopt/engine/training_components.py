"""How collabopt's training state (:class:`~collabopt.engine.training_state.TrainingState`) builds its optimizer
and scheduler from what a user passes (hivemind's ``TrainingStateAverager`` arguments): parameter groups, factories,
offloaded copies.

Rules, and why: a factory is called on the groups it is given (on the offloaded copies where the optimizer is
offloaded); a built optimizer and scheduler must be on those groups (else a step would update other tensors than the
averaged ones); an optimizer without statistics gets them from one step with zero gradients, as hivemind does, so
that the statistics averaged and served exist from the start.
"""

from __future__ import annotations

from typing import Any

import torch
from hivemind.optim.state_averager import initialize_optimizer_state_


def param_groups(optimizer: Any, params: Any) -> tuple[dict, ...]:
    """The parameter groups of ``params`` (tensors or dicts), else of a built ``optimizer``."""
    if params is None:
        if not hasattr(optimizer, "param_groups"):
            raise ValueError("optimizer must be a torch optimizer, or a factory given params=")
        params = optimizer.param_groups
    groups = tuple(params)
    if all(isinstance(p, torch.Tensor) for p in groups):
        groups = (dict(params=groups),)
    for group in groups:
        if not isinstance(group, dict) or not all(isinstance(p, torch.Tensor) for p in group.get("params") or ()):
            raise ValueError("params must be tensors or parameter groups (dicts with 'params': tensors)")
    return groups


def build_components(groups: tuple[dict, ...], optimizer: Any, scheduler: Any, initialize: bool | None,
                     offload: bool, reuse: bool, averaged_parameters: tuple[torch.Tensor, ...],
                     ) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer (where ``offload``: on copies of ``averaged_parameters``, or on them themselves where
    ``reuse``) and the scheduler, built from their factories; the optimizer's statistics made where it has none
    (``initialize`` None) or where asked."""
    optimizer_factory = callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)
    scheduler_factory = callable(scheduler) and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
    if optimizer_factory and scheduler is not None and not scheduler_factory:
        raise ValueError("where the optimizer is a factory, the scheduler must be one too")
    if offload and not optimizer_factory:
        raise ValueError("offload_optimizer needs the optimizer as a factory")
    if optimizer_factory:
        if offload:
            copies = averaged_parameters if reuse else tuple(
                t.detach().clone().requires_grad_(t.requires_grad) for t in averaged_parameters)
            for param in copies:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            sizes = [len(group["params"]) for group in groups]
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            groups = tuple(dict(group, params=copies[start:start + size])
                           for group, start, size in zip(groups, starts, sizes, strict=True))
        optimizer = optimizer(groups)
    if initialize is None:  # (no statistics yet: one step with zero gradients makes them, as hivemind does)
        initialize = not any(isinstance(value, torch.Tensor)
                             for state in optimizer.state_dict()["state"].values() for value in state.values())
    if initialize:
        initialize_optimizer_state_(optimizer)
    if scheduler_factory:
        scheduler = scheduler(optimizer)
    if len(optimizer.param_groups) != len(groups) or getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("the optimizer (and scheduler) must be built on the given parameter groups")
    return optimizer, scheduler


__all__ = ["build_components", "param_groups"]
