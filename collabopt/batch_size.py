"""Batch-size inference: how many samples each local step contributes toward ``target_batch_size``.

Order of precedence used by :class:`~collabopt.CollaborativeOptimizer.step`:

1. ``step(batch_size=n)``;
2. ``step(batch=b)``: the first dimension of the tensors in ``b`` (nested dicts, lists, tuples, dataclasses,
   mappings); they must agree;
3. the samples seen by the model's forward calls since the last step (:class:`ForwardSampleCounter`), which
   covers gradient accumulation and a short last batch;
4. the fixed ``batch_size=`` given to the optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from collabopt.config import positive_int
from collabopt.errors import ConfigurationError


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield the tensors inside nested containers (dicts, mappings, lists, tuples, dataclasses, objects with
    ``.items()`` such as HF ``BatchEncoding``)."""
    if _depth > 16:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (str, bytes)):
        return
    elif isinstance(obj, Mapping) or (hasattr(obj, "items") and hasattr(obj, "keys")):
        for value in obj.values():
            yield from iter_tensors(value, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name), _depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value, _depth + 1)


def infer_batch_size(batch: Any) -> int:
    """Number of samples in ``batch``: the common first dimension of its tensors.

    Raises :class:`ConfigurationError` when the batch holds no tensor with a batch dimension, or when the tensors
    disagree (then pass ``batch_size=`` explicitly).

    >>> infer_batch_size({"x": torch.zeros(8, 3), "y": torch.zeros(8)})
    8
    """
    sizes = {int(t.shape[0]) for t in iter_tensors(batch) if t.dim() > 0}
    if not sizes:
        raise ConfigurationError(
            "batch",
            f"found no tensor with a batch dimension in a {type(batch).__name__}",
            "pass step(batch_size=<number of samples>) or a batch of tensors",
        )
    if len(sizes) > 1:
        raise ConfigurationError(
            "batch",
            f"ambiguous batch size: its tensors have different first dimensions {sorted(sizes)}",
            "pass step(batch_size=<number of samples>) explicitly",
        )
    return sizes.pop()


def _first_tensor_size(args: tuple, kwargs: dict) -> int | None:
    for tensor in iter_tensors((args, kwargs)):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


class ForwardSampleCounter:
    """Counts samples passing through a model's ``forward`` while it trains.

    A forward pre-hook adds the first dimension of the first tensor argument of every call made in training
    mode with gradients enabled (evaluation and ``torch.no_grad()`` calls are not counted). :meth:`pop` returns
    the count since the last call and resets it.

    >>> model = torch.nn.Linear(3, 1)
    >>> counter = ForwardSampleCounter(model)
    >>> _ = model(torch.zeros(5, 3)); _ = model(torch.zeros(2, 3))
    >>> counter.pop()
    7
    >>> counter.remove()
    """

    def __init__(self, model: torch.nn.Module):
        if not isinstance(model, torch.nn.Module):
            raise ConfigurationError(
                "model", f"expected a torch.nn.Module, got {type(model).__name__}", "pass the model you train"
            )
        self.samples = 0
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            size = _first_tensor_size(args, kwargs)
            if size is not None:
                self.samples += size
                self.calls += 1

    def pop(self) -> int:
        samples, self.samples, self.calls = self.samples, 0, 0
        return samples

    def remove(self) -> None:
        self._handle.remove()


def resolve_samples(batch: Any, batch_size: int | None, counter: ForwardSampleCounter | None,
                    fixed_batch_size: int | None) -> int:
    """Samples of one local step, by the precedence of this module's docstring (the forward count is always
    consumed). Raises :class:`ConfigurationError` when nothing tells."""
    counted = counter.pop() if counter is not None else 0
    if batch_size is not None:
        positive_int("batch_size", batch_size, "len(inputs)")
        return batch_size
    if batch is not None:
        return infer_batch_size(batch)
    if counted > 0:
        return counted
    if fixed_batch_size is not None:
        return fixed_batch_size
    raise ConfigurationError(
        "step", "cannot tell how many samples this step contributed",
        "call step(batch_size=len(x)) or step(batch=(x, y)), or pass model= (samples are then counted from its "
        "forward calls) or a fixed batch_size= to CollaborativeOptimizer",
    )
