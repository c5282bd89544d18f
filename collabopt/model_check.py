"""Whether a state downloaded from the swarm fits this peer's model: the same shapes and dtypes, tensor by tensor.

A peer whose model differs from the swarm's (another layer size, another dtype) cannot take part: hivemind's install
of such a state fails half-way (``The size of tensor a (48) must match ...``), its averaging groups never form with
the swarm's (matchmaking keys them by the tensors' schema), and it would train on alone. The check runs on the
downloaded tensors before anything of them is installed (:class:`~collabopt.engine.downloads.StateDownloads`)
and raises :class:`~collabopt.errors.ModelMismatchError`, which the download loops let through to the user's step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from collabopt.errors import ModelMismatchError


def describe(tensor: torch.Tensor | None) -> str:
    """A tensor's shape and dtype as the error writes them: ``"(48, 32) torch.float32"`` (``"none"``: missing)."""
    if tensor is None:
        return "none"
    return f"{tuple(tensor.shape)} {tensor.dtype}"


def first_mismatch(local: Sequence[torch.Tensor], received: Sequence[Any], names: Sequence[str] | None = None,
                   source: str = "the swarm's state") -> ModelMismatchError | None:
    """The error for the first of ``local`` (this peer's tensors, in order) whose shape or dtype differs from the
    tensor at its position in ``received`` (a downloaded state's tensors; any after ``local``'s are not compared:
    the optimizer's statistics follow the parameters), or None if all match. ``received`` shorter than ``local``
    differs at its end. ``names``: the local tensors' names (shorter or None: those without one are named by index
    only)."""
    for index, mine in enumerate(local):
        theirs = received[index] if index < len(received) else None
        if theirs is not None and isinstance(theirs, torch.Tensor) and theirs.shape == mine.shape \
                and theirs.dtype == mine.dtype:
            continue
        name = names[index] if names is not None and index < len(names) else None
        theirs_text = describe(theirs) if theirs is None or isinstance(theirs, torch.Tensor) else type(theirs).__name__
        return ModelMismatchError(index, name, describe(mine), theirs_text, source)
    return None


def parameter_names(parameters: Iterable[torch.Tensor], model: torch.nn.Module | None) -> list[str] | None:
    """The names ``model`` gives ``parameters`` (matched by identity; ``""`` for one the model does not hold), or
    None without a model."""
    if model is None:
        return None
    by_id = {id(param): name for name, param in model.named_parameters()}
    return [by_id.get(id(param), "") for param in parameters]


__all__ = ["describe", "first_mismatch", "parameter_names"]
