"""DiLoCo mode's options: the outer optimizer a peer is given, the options that cannot be combined with it, and the
compression of its pseudo-gradients (:class:`SparseLoCo`).

:class:`~collabopt.config.CollabConfig` checks these when ``outer_optimizer`` is set (:mod:`collabopt.option_rules`,
each error with a fix that is complete), before any network starts, so that a misconfigured peer fails with the
option's name and a fix rather than inside a round.

    >>> import functools, torch
    >>> check_outer_optimizer(functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from collabopt.error_feedback import ErrorFeedback
from collabopt.errors import ConfigurationError
from collabopt.sparse_codec import MAX_BITS, MAX_CHUNK_SIZE, SparseCodec

# The largest SparseLoCo.max_contributors (a round's digest lists every contribution; groups are smaller in practice)
MAX_CONTRIBUTORS = 1024
OUTER_EXAMPLE = "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)"
# options of CollabConfig that cannot be combined with outer_optimizer, and why
INCOMPATIBLE = {
    "reuse_grad_buffers": "gradients are applied by your optimizer at every step, not accumulated",
    "offload_optimizer": "collabopt keeps the outer optimizer in host memory already",
    "delay_optimizer_step": "the outer step is part of the round",
    "delay_grad_averaging": "the outer step is part of the round",
    "delay_state_averaging": "DiLoCo averages pseudo-gradients, not parameters",
    "use_local_updates": "DiLoCo takes local steps already (and adds the outer step)",
    "auxiliary": "auxiliary peers do not train, so they have no pseudo-gradient",
}
# hivemind.Optimizer options that have no meaning in DiLoCo mode
INCOMPATIBLE_HIVEMIND = {
    "grad_averager_factory": "collabopt averages pseudo-gradients with its own averager",
    "average_opt_statistics": "the inner optimizer's statistics stay local (as in DiLoCo)",
}


def check_outer_optimizer(outer_optimizer: Any) -> None:
    """Raise a :class:`ConfigurationError` unless ``outer_optimizer`` builds a torch optimizer from parameters."""
    if isinstance(outer_optimizer, torch.optim.Optimizer) or not callable(outer_optimizer):
        raise ConfigurationError(
            "outer_optimizer",
            f"must be a callable(params) -> torch.optim.Optimizer, got {type(outer_optimizer).__name__}",
            f"pass e.g. outer_optimizer={OUTER_EXAMPLE}",
        )
    probe = torch.nn.Parameter(torch.zeros(1))
    try:
        built = outer_optimizer([{"params": [probe]}])
    except Exception as e:
        raise ConfigurationError(
            "outer_optimizer", f"calling it on a list of parameter groups failed ({type(e).__name__}: {e})",
            f"pass e.g. outer_optimizer={OUTER_EXAMPLE}",
        ) from None
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigurationError(
            "outer_optimizer", f"returned {type(built).__name__}, not a torch.optim.Optimizer",
            f"pass e.g. outer_optimizer={OUTER_EXAMPLE}",
        )


def check_config(config: Any) -> None:
    """The checks of a :class:`~collabopt.config.CollabConfig` with ``outer_optimizer`` set, for callers that hold a
    config-like object (a config itself is checked when built, by :mod:`collabopt.option_rules`)."""
    check_outer_optimizer(config.outer_optimizer)
    for name, why in INCOMPATIBLE.items():
        if getattr(config, name):
            raise ConfigurationError(name, f"cannot be combined with outer_optimizer (DiLoCo mode): {why}",
                                     f"drop {name}, or drop outer_optimizer for the synchronous mode")
    for name, why in INCOMPATIBLE_HIVEMIND.items():
        if config.hivemind_options.get(name):
            raise ConfigurationError(name, f"cannot be combined with outer_optimizer (DiLoCo mode): {why}",
                                     f"drop {name}")


@dataclass(frozen=True)
class SparseLoCo:
    """``pseudo_gradient_compression=SparseLoCo(...)``: DiLoCo's pseudo-gradients sent as the top ``density`` of
    each chunk of ``chunk_size`` values, each kept value at ``bits`` bits (sign and magnitude level, a scale per
    chunk), with an error-feedback buffer of decay ``error_decay`` (SparseLoCo, arXiv 2508.15706).

    The defaults send about 0.025 bytes a parameter (:class:`~collabopt.sparse_codec.SparseCodec`), 80x fewer than
    fp16 pseudo-gradients. SparseLoCo's own outer step is :meth:`outer_optimizer` (plain SGD at lr 1.0, no momentum:
    the error-feedback buffer takes momentum's place). With it the defaults' held-out loss on B6's quality bed, over
    fp16 DiLoCo's at equal samples (5 seeds, median and range; ``benchmarks/results/sparse_quality.md``), was 0.98x
    (0.97-0.99) at 20 inner steps a round and 1.00x (0.99-1.01) at 100 after 4,000 inner steps a worker, 1.01x
    (0.99-1.02) and 1.04x (1.02-1.06) after 2,000. DiLoCo's Nesterov outer step (lr 0.7, momentum 0.9) runs, but
    trained worse there: 1.12x and 1.34x after 2,000.

    ``max_contributors``: in a round of more members, that many of them, chosen anew each round from the round's
    group id (every member makes the same choice), send their payload; the others send none, keep their whole
    pseudo-gradient in their error-feedback buffer, undecayed (sent in a later round), count as zeros in the
    aggregate and apply the round like the rest. Every member downloads every payload of a round, so this bounds
    what a member receives to ``max_contributors`` payloads and what it sends to ``max_contributors * (members - 1)
    / members`` on average, whatever the group's size; None: every member contributes every round. Each setting is
    checked here, before any network starts; every peer of a swarm must use the same."""

    density: float = 0.02
    chunk_size: int = 4096
    bits: int = 2
    error_decay: float = 0.95
    max_contributors: int | None = 8

    def __post_init__(self) -> None:
        for name, problem, example in (
            ("density", _number_in(self.density, 0.0, 1.0, open_low=True), 0.02),
            ("chunk_size", _integer_in(self.chunk_size, 2, MAX_CHUNK_SIZE), 4096),
            ("bits", _integer_in(self.bits, 1, MAX_BITS), 2),
            ("error_decay", _number_in(self.error_decay, 0.0, 1.0), 0.95),
            ("max_contributors", None if self.max_contributors is None else
             _integer_in(self.max_contributors, 2, MAX_CONTRIBUTORS), 8),
        ):
            if problem:
                raise ConfigurationError(f"SparseLoCo.{name}", problem, f"pass e.g. SparseLoCo({name}={example})")

    @property
    def codec(self) -> SparseCodec:
        """The payload format these settings give."""
        return SparseCodec(density=float(self.density), chunk_size=self.chunk_size, bits=self.bits)

    def error_feedback(self, shapes: list[tuple[int, ...]]) -> ErrorFeedback:
        """A peer's error-feedback buffer (zeros) for parameters of ``shapes``."""
        return ErrorFeedback(self.codec, shapes, decay=float(self.error_decay))

    @staticmethod
    def outer_optimizer(lr: float = 1.0) -> functools.partial:
        """SparseLoCo's outer step, for ``outer_optimizer=``: SGD without momentum (the anchor moves by ``lr``
        times the aggregate); the error feedback carries what momentum would (SparseLoCo and templar: lr 1.0). On
        B6's quality bed lr 1.5 did better after 2,000 inner steps a worker (1.00x and 1.03x fp16 DiLoCo's loss at 20
        and 100 inner steps a round, against 1.01x and 1.04x) and not after 4,000 (0.98x and 1.00x, as lr 1.0;
        ``benchmarks/results/sparse_quality.md``)."""
        return functools.partial(torch.optim.SGD, lr=lr)


def _number_in(value: Any, low: float, high: float, open_low: bool = False) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (low < value if open_low else low <= value) and value <= high:
        return None
    return f"must be a number in {'(' if open_low else '['}{low:g}, {high:g}], got {value!r}"


def _integer_in(value: Any, low: int, high: int) -> str | None:
    if type(value) is int and low <= value <= high:
        return None
    return f"must be an integer in [{low}, {high}], got {value!r}"
