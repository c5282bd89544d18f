"""What the core learns of its peer's rounds: each round's outcome once, amended where the non-finite guard refused
its average, and whether the swarm's epochs are too short for its ``matchmaking_time`` (said once, with what to
set: peers then spend the boundary matching rather than training, and a peer that joins late falls behind)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from collabopt.engine import protocol
from collabopt.interface import RoundOutcome

logger = logging.getLogger(__name__)

SHORT_ROUNDS = 3  # consecutive rounds whose epoch fills faster than matchmaking_time before collabopt says so
EPOCH_PER_MATCHMAKING = 4  # the suggested epoch: this many matchmaking_times (boundaries ~3-4% of it, benchmark B5)


class RoundWatch:
    """Sees each round of a peer once (:meth:`ended`); ``last`` is the last outcome, with the guard's verdict."""

    def __init__(self, guard: Any, matchmaking_time: float, target_batch_size: int, judges_average: bool):
        self.guard, self.matchmaking_time, self.target_batch_size = guard, matchmaking_time, target_batch_size
        self.judges_average = judges_average  # (DiLoCo's rounds judge their average themselves)
        self.last: RoundOutcome | None = None
        self._seen: RoundOutcome | None = None
        self._refusals = self._guard_refusals()
        self._short = 0
        self.said_short = False

    def _guard_refusals(self) -> tuple[int, int]:
        guard = self.guard
        return (guard.refused_updates, guard.restored_parameters) if guard is not None else (0, 0)

    def ended(self, outcome: RoundOutcome | None, samples_per_second: Callable[[], float]) -> RoundOutcome | None:
        """The round ``outcome`` (the peer's last) if it is new, amended where the guard refused the average since
        the last one (gradients refused: no update; parameters restored: this peer's own update); else None. Called
        at every step: the swarm's ``samples_per_second`` is read only when a round ended."""
        if outcome is None or outcome is self._seen:
            return None
        self._seen, refusals = outcome, self._guard_refusals()
        if self.judges_average:
            outcome = protocol.guard_amended(outcome, gradients_refused=refusals[0] != self._refusals[0],
                                             parameters_restored=refusals[1] != self._refusals[1])
        self._refusals, self.last = refusals, outcome
        self._pace(samples_per_second())
        return outcome

    def _pace(self, samples_per_second: float) -> None:
        """Say once when the swarm fills an epoch faster than ``matchmaking_time``, several rounds in a row."""
        if self.said_short or not math.isfinite(samples_per_second) or samples_per_second <= 0:
            return
        fill = self.target_batch_size / samples_per_second
        self._short = self._short + 1 if fill < self.matchmaking_time else 0
        if self._short < SHORT_ROUNDS:
            return
        self.said_short = True
        suggested = EPOCH_PER_MATCHMAKING * self.matchmaking_time * samples_per_second
        logger.warning(
            "collabopt: the swarm fills an epoch in %.1f s, less than matchmaking_time (%.1f s): its peers spend "
            "most of each epoch matching, and a peer that joins late may fall behind. Set target_batch_size to about "
            "%d or more (%d matchmaking_times of the swarm's %.0f samples/s), or a lower matchmaking_time",
            fill, self.matchmaking_time, _round_up(suggested), EPOCH_PER_MATCHMAKING, samples_per_second)


def _round_up(value: float) -> int:
    """``value`` rounded up to two significant digits (a number to type)."""
    if value <= 0:
        return 0
    step = 10 ** max(0, math.floor(math.log10(value)) - 1)
    return int(math.ceil(value / step) * step)
