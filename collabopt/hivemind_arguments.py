"""``hivemind.Optimizer``'s arguments for this peer, built in one place: the options of the config
(:meth:`~collabopt.config.CollabConfig.hivemind_arguments`), the optimizer hivemind steps, and what the mode
changes (DiLoCo mode: the outer optimizer and the pseudo-gradient averager)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from collabopt import scheduling
from collabopt.config import CollabConfig, sized_next_chunk_timeout
from collabopt.engine.diloco_averaging import default_pseudo_gradient_compression, pseudo_gradient_averager_factory
from collabopt.errors import ConfigurationError

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


def peer_arguments(config: CollabConfig, optimizer: torch.optim.Optimizer,
                   optimizer_factory: OptimizerFactory | None) -> dict[str, Any]:
    """Every ``hivemind.Optimizer`` keyword argument of this peer but ``dht``."""
    if config.outer_optimizer is not None:
        arguments = _diloco_arguments(config, optimizer, optimizer_factory)
    else:
        arguments = dict(config.hivemind_arguments(), **_optimizer_arguments(optimizer, config, optimizer_factory))
    timeouts_given = {"sender_timeout", "reducer_timeout"} & set(arguments.get("averager_opts") or {})
    if arguments.get("next_chunk_timeout") is None and not timeouts_given:
        # every parameter of the groups is averaged, frozen ones too (hivemind averages their zero gradients)
        arguments["next_chunk_timeout"] = sized_next_chunk_timeout(
            sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"]),
            config.matchmaking_time, config.averaging_timeout)
    return arguments


def prepare_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create optimizer statistics without changing any parameter.

    hivemind needs every peer to hold statistics of the same structure and creates them by stepping the optimizer
    once with zero gradients, which applies weight decay once. Doing it with ``lr=0`` first leaves parameters
    untouched.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    old_grads = [p.grad for p in params]
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, old_grads, strict=True):
            p.grad = grad


def _optimizer_arguments(optimizer: torch.optim.Optimizer, config: CollabConfig,
                         optimizer_factory: OptimizerFactory | None) -> dict[str, Any]:
    """``optimizer`` / ``params`` arguments of ``hivemind.Optimizer``: the user's instance, or a factory when hivemind
    builds its own copy (offloaded or delayed steps)."""
    if not config.needs_optimizer_factory:
        if optimizer_factory is not None:
            warnings.warn("optimizer_factory is only used with offload_optimizer/delay_*; ignored", stacklevel=4)
        prepare_optimizer_state(optimizer)
        return dict(optimizer=optimizer)
    build = optimizer_factory or scheduling.optimizer_factory(optimizer)

    def make_optimizer(param_groups: list[dict]) -> torch.optim.Optimizer:
        new_optimizer = build(param_groups)
        prepare_optimizer_state(new_optimizer)
        return new_optimizer

    return dict(optimizer=make_optimizer, params=[dict(group) for group in optimizer.param_groups])


def _diloco_arguments(config: CollabConfig, inner: torch.optim.Optimizer,
                      optimizer_factory: OptimizerFactory | None) -> dict[str, Any]:
    """A DiLoCo peer's: hivemind's optimizer is the outer one, built by ``config.outer_optimizer`` on host copies of
    the parameters (the anchor), its statistics created without moving a parameter; the pseudo-gradient averager
    replaces the gradient averager."""
    if optimizer_factory is not None:
        raise ConfigurationError("optimizer_factory", "is not used with outer_optimizer: your optimizer steps "
                                 "locally and outer_optimizer builds the outer one", "drop optimizer_factory")
    arguments = config.hivemind_arguments()
    request_timeout = (arguments.get("averager_opts") or {}).get("request_timeout")
    outer_factory = config.outer_optimizer

    def build_outer(param_groups: list[dict]) -> torch.optim.Optimizer:
        outer = outer_factory(param_groups)
        prepare_optimizer_state(outer)
        return outer

    arguments.update(
        optimizer=build_outer,
        # the outer optimizer's hyperparameters are its own: hand it the parameters only
        params=[{"params": list(group["params"])} for group in inner.param_groups],
        offload_optimizer=True,
        grad_averager_factory=pseudo_gradient_averager_factory(request_timeout, config.aggregation,
                                                               config.pseudo_gradient_compression),
        grad_compression=arguments.get("grad_compression") or default_pseudo_gradient_compression(),
    )
    return arguments
