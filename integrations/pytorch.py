"""Plain PyTorch loops: one call binds a model and its optimizer to a swarm.

Example::

    from collabopt.integrations.pytorch import collaborate

    model = torch.nn.Linear(64, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with collaborate(model, opt, run_id="digits", target_batch_size=1024) as copt:
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            copt.step()        # samples counted from model's forward calls
            copt.zero_grad()
"""

from __future__ import annotations

from typing import Any

import torch

from collabopt import node
from collabopt.config import renamed_argument
from collabopt.errors import ConfigurationError
from collabopt.node import NodeOptimizer
from collabopt.optimizer import CollaborativeOptimizer


def collaborate(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    run_id: str,
    target_batch_size: int,
    scheduler: Any = None,
    scaler: Any = None,
    **kwargs: Any,
) -> CollaborativeOptimizer | NodeOptimizer:
    """Wrap ``optimizer`` so that ``model`` trains as a peer of the swarm ``run_id``.

    Samples are counted from ``model``'s forward calls in training mode (gradient accumulation and a short last
    batch are counted exactly). ``scheduler`` advances once per global epoch. ``scaler`` is your
    ``torch.amp.GradScaler`` if you use one: keep calling ``scaler.step(copt); scaler.update()``
    (``grad_scaler=`` is its deprecated name).
    Every other keyword argument goes to :class:`~collabopt.CollaborativeOptimizer`.

    Under ``torchrun`` (torch.distributed initialised, several processes): call it on every rank with the
    ``DistributedDataParallel``-wrapped model; the processes act as ONE peer (only rank 0 joins the swarm, samples
    of all ranks are counted, parameters and LR stay identical on every rank) and a
    :class:`~collabopt.node.NodeOptimizer` is returned. See :mod:`collabopt.node`.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationError("model", f"expected a torch.nn.Module, got {type(model).__name__}",
                                 "pass the model you train")
    if isinstance(model, torch.nn.DataParallel):  # one process driving several GPUs: a plain peer
        model = model.module
    sharded = type(model).__name__ in ("FullyShardedDataParallel", "FSDPModule") or any(
        type(m).__name__.startswith("FSDP") for m in model.modules()
    )
    if sharded:
        raise ConfigurationError(
            "model", "FSDP (sharded parameters) is not supported: hivemind averages whole parameters",
            "use DistributedDataParallel (replicated parameters)",
        )
    if node.is_node_job() and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigurationError(
            "model",
            f"torch.distributed runs {torch.distributed.get_world_size()} processes but the model is not "
            "wrapped in DistributedDataParallel, so the ranks' gradients would never be combined",
            "wrap it first: model = torch.nn.parallel.DistributedDataParallel(model), then collaborate(model, ...)",
        )
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    model_params = {id(p) for p in model.parameters()}
    if not any(id(p) in model_params for group in optimizer.param_groups for p in group["params"]):
        raise ConfigurationError(
            "optimizer", "it holds none of the model's parameters", "create it from model.parameters()"
        )
    scaler = renamed_argument(kwargs, "grad_scaler", "scaler", scaler, "collaborate")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ConfigurationError(
            "scaler", f"expected a torch.amp.GradScaler, got {type(scaler).__name__}",
            "pass torch.amp.GradScaler() (hivemind.GradScaler is not needed)",
        )
    return node.collaborative_optimizer(
        optimizer,
        run_id=run_id,
        target_batch_size=target_batch_size,
        scheduler=scheduler,
        model=model,
        scaler=scaler,
        **kwargs,
    )


__all__ = ["collaborate"]
