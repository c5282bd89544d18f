"""One part of a round resolved by CenteredClip with capped weights: the pure arithmetic every part reducer of collabopt
shares (hivemind's seams in :mod:`collabopt.engine.robust_averaging`, collabopt's own runner in
:mod:`collabopt.engine.part_reducer`).

Rule: nothing here talks to hivemind or to the network; a reducer hands in the parts it holds and gets the part's
aggregate. Why: both runners must resolve a part alike, and the arithmetic is tested without a swarm.
"""

from __future__ import annotations

import math

import torch
from hivemind.utils.logging import get_logger

from collabopt.robust import cap_weights, centered_clip

logger = get_logger(__name__)

# a sender's weight is capped at this many times the median positive weight of the part's senders (cap_weights).
# 1, not 2: at 2 a claimant of a group of 4 holds 2/5 of the weight, and what it sends inside the honest spread is
# never clipped (measured: docs/faults.md). The price: an honest sender's samples beyond the median's count as those
WEIGHT_CAP = 1.0

# The fewest members of a centered_clip round: CenteredClip bounds a hostile member only where honest members outnumber
# it, and in a group of 2 the hostile one pulls as hard as the honest one. hivemind's matchmaking then forms no smaller
# group, and a peer whose gradient round found none steps with its own gradients (a 4-peer swarm split 2 + 2 under CPU
# load let a hostile member into a pair: docs/faults.md).
MIN_CLIPPED_GROUP = 3


class ClippedPart:
    """What a clipping reducer keeps where hivemind keeps a part's running sum (its ``accumulator``); also the
    aggregate of :class:`collabopt.engine.part_reducer.ClipPart`.

    hivemind's ``accumulate_part`` calls ``add_(part, alpha=weight)`` once for each sender that takes part in the
    current part, and ``check_current_part_finished`` calls ``div_(denominator)`` once they all have: here ``add_``
    records the sender's (part, weight) and ``div_`` returns CenteredClip of them with capped weights. hivemind's own
    methods thus keep the order of parts, the count of senders and the dropping of a failed sender's later parts.

    ``add_`` never raises (a raise there would leave hivemind waiting for that sender's part until the all-reduce
    times out): a part of another shape, holding NaN/inf, or given a negative or non-finite weight takes no part
    (hivemind's mean turns NaN, or raises and stalls). Where no part has a positive weight the result is NaN, as
    hivemind's mean (0/0) is. Parts are kept as float32, the dtype of hivemind's accumulator."""

    def __init__(self, shape: torch.Size, weight_cap: float = WEIGHT_CAP):
        self.shape = torch.Size(shape)
        self.weight_cap = weight_cap
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.refused = 0  # parts that took no part because they were malformed (not those of weight 0)

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> ClippedPart:
        weight = float(alpha)
        if not (math.isfinite(weight) and weight >= 0.0) or part.shape != self.shape:
            self.refused += 1
            logger.debug(f"A part {tuple(part.shape)} of weight {weight} takes no part (expected {tuple(self.shape)})")
            return self
        if weight == 0.0:
            return self
        part = part.to(torch.float32)
        if not bool(torch.isfinite(part).all()):
            self.refused += 1
            logger.debug("A part holding NaN/inf takes no part")
            return self
        self.parts.append(part)
        self.weights.append(weight)
        return self

    def div_(self, denominator: float) -> torch.Tensor:
        """The part's aggregate: CenteredClip of the recorded parts, weights capped (``denominator``, the sum of
        the raw weights, is not used)."""
        if not self.parts:
            return torch.full(self.shape, float("nan"))
        return centered_clip(self.parts, cap_weights(self.weights, self.weight_cap))
