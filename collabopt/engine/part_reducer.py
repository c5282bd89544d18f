"""collabopt's part reducer: how one member of a round resolves its slice of the group's tensors, part by part.

Rules, and why:

* Parts are resolved in order; a part's result is computed once, from the parts of every sender still in the round,
  and handed to every sender alike: each part has one value in the whole group.
* The aggregate adds the senders' parts in sender order, in float64 (:class:`MeanPart`), or runs CenteredClip with
  capped weights (:class:`ClipPart`): the same inputs give the same bits on any member, whatever order they came in.
* A part of another shape, holding NaN/inf, or of a negative or non-finite weight takes no part (it is counted as
  refused): a raise there would stall every sender of the part, and a mean with it would be NaN for all.
* A sender that fails is left out of the parts it has not sent, at once. Each sender awaits a part's result through
  ``asyncio.shield``: a failing sender's task never cancels the result for the others (hivemind 1.1.12's reducer
  cancelled the shared future, and every member waited until its timeout; docs/decisions.md, "Shielded part
  reducer").
* What happened is kept as data (parts received and refused per sender, the senders included in each part), for the
  round's evidence: nothing here decides whether a round counts.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from collabopt.engine.clipping import WEIGHT_CAP, ClippedPart


class ReducerClosed(Exception):
    """The reducer was closed (the round ended) before this part's result was computed."""


class SenderDropped(Exception):
    """This sender was left out of the round's remaining parts (it failed, or sent a part out of order)."""


def acceptable(part: torch.Tensor, weight: float, shape: torch.Size) -> bool:
    """Whether a sender's part may take part in an aggregate of parts of ``shape``."""
    return (math.isfinite(weight) and weight >= 0.0 and part.shape == shape
            and bool(torch.isfinite(part).all()))


class Aggregate(Protocol):
    """One part's aggregate: ``add`` a sender's part (returns whether it was taken), then ``result`` once."""

    def add(self, sender: int, part: torch.Tensor, weight: float) -> bool: ...

    def result(self) -> torch.Tensor: ...


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i x_i / sum_i w_i``, summed in the given order in float64 (a product, then a sum: no fused
    multiply-add), cast back to the first part's dtype. NaN where the weights sum to 0, as 0/0 is."""
    total = torch.zeros(parts[0].shape, dtype=torch.float64)
    for part, weight in zip(parts, weights, strict=True):
        total.add_(part.to(torch.float64).mul_(float(weight)))
    return total.div_(math.fsum(float(w) for w in weights)).to(parts[0].dtype)


class _SendersPart:
    """The copies of one part that its senders sent, kept by sender; ``result()`` resolves them in sender order, so
    that every member resolving the same copies gets the same bits."""

    def __init__(self, shape: torch.Size):
        self.shape = torch.Size(shape)
        self._taken: dict[int, tuple[torch.Tensor, float]] = {}

    def add(self, sender: int, part: torch.Tensor, weight: float) -> bool:
        if not acceptable(part, float(weight), self.shape):
            return False
        self._taken[sender] = (part, float(weight))
        return True


class MeanPart(_SendersPart):
    """The weighted mean of a part's senders (:func:`weighted_mean` in sender order)."""

    def result(self) -> torch.Tensor:
        if not self._taken:
            return torch.full(self.shape, float("nan"))
        senders = sorted(self._taken)
        return weighted_mean([self._taken[s][0] for s in senders], [self._taken[s][1] for s in senders])


class ClipPart(_SendersPart):
    """CenteredClip of a part's senders with weights capped at ``weight_cap`` times the median
    (:class:`collabopt.engine.clipping.ClippedPart`, fed in sender order). Senders of weight 0 take no part."""

    def __init__(self, shape: torch.Size, weight_cap: float = WEIGHT_CAP):
        super().__init__(shape)
        self.weight_cap = weight_cap

    def result(self) -> torch.Tensor:
        clipped = ClippedPart(self.shape, self.weight_cap)
        for sender in sorted(self._taken):
            part, weight = self._taken[sender]
            clipped.add_(part, alpha=weight)
        dtype = next(iter(self._taken.values()))[0].dtype if self._taken else torch.float32
        return clipped.div_(0.0).to(dtype)


AGGREGATES: dict[str, Callable[[torch.Size], Aggregate]] = {"mean": MeanPart, "centered_clip": ClipPart}


class PartReducer:
    """Resolves the parts of ``part_shapes`` (this member's slice) sent by ``num_senders`` senders.

    :meth:`accumulate` takes sender ``s``'s part ``i`` and returns the part's result and the senders it includes,
    once every sender still in the round has sent part ``i`` (or failed). :meth:`sender_failed` leaves a sender out of
    the parts it has not sent yet; :meth:`close` ends the reducer (waiting senders get :class:`ReducerClosed`)."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int,
                 aggregate: Callable[[torch.Size], Aggregate] = MeanPart, patience: float | None = None):
        if num_senders < 1:
            raise ValueError(f"num_senders must be at least 1, got {num_senders}")
        self.part_shapes, self.num_senders = tuple(torch.Size(s) for s in part_shapes), num_senders
        self._aggregate = aggregate
        self.received = [0] * num_senders  # parts received per sender
        self.refused = [0] * num_senders  # parts that took no part (malformed), per sender
        self.included: list[tuple[int, ...]] = []  # per resolved part: the senders whose values it holds
        self._failed_after = [math.inf] * num_senders  # a failed sender takes part in the parts before this index
        self._current = 0  # the part being resolved
        self._arrived: set[int] = set()  # senders whose part `_current` came (taken or refused)
        self._accumulator: Aggregate | None = aggregate(self.part_shapes[0]) if self.part_shapes else None
        self._taken: list[int] = []
        self._results: dict[int, asyncio.Future] = {}
        self.closed = not self.part_shapes
        # a part's senders that have not sent it this long after the first one did are left out (a sender's handler
        # can hang writing a result to a member that died, and never read its next part, nor fail)
        self.patience, self._late_timer = patience, None

    @property
    def num_parts(self) -> int:
        return len(self.part_shapes)

    def _result_of(self, index: int) -> asyncio.Future:
        if index not in self._results:
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # (retrieved: no "never retrieved")
            self._results[index] = future
        return self._results[index]

    def failed(self, sender: int) -> bool:
        return self._failed_after[sender] != math.inf

    async def accumulate(self, sender: int, index: int, part: torch.Tensor,
                         weight: float) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Add sender ``sender``'s part ``index`` and await the part's (result, included senders)."""
        return await asyncio.shield(await self.add(sender, index, part, weight))

    async def add(self, sender: int, index: int, part: torch.Tensor, weight: float) -> asyncio.Future:
        """Add sender ``sender``'s part ``index`` once the parts before it are resolved; return the future of the
        part's (result, included senders), not awaited: a sender's next part can be added while this result is still
        on its way to it (await it through ``asyncio.shield``: cancelling it would cancel it for every sender)."""
        if not 0 <= sender < self.num_senders or not 0 <= index < self.num_parts:
            raise ValueError(f"no sender {sender} or part {index} in a reducer of {self.num_senders} senders, "
                             f"{self.num_parts} parts")
        if self.failed(sender):
            raise SenderDropped(f"sender {sender} is out of this round")
        if index != self.received[sender]:
            self.sender_failed(sender)
            raise SenderDropped(f"sender {sender} sent part {index} where part {self.received[sender]} was due")
        while self._current < index and not self.closed:
            await asyncio.wait({self._result_of(self._current)})  # (never cancels it)
        if self.closed:
            raise ReducerClosed("the round ended before this part was resolved")
        if self.failed(sender) and self._failed_after[sender] <= index:
            raise SenderDropped(f"sender {sender} is out of this round")
        assert self._current == index and self._accumulator is not None
        self.received[sender] += 1  # (counted as it is added: a sender cancelled while waiting is not expected)
        if self._accumulator.add(sender, part, weight):
            self._taken.append(sender)
        else:
            self.refused[sender] += 1
        self._arrived.add(sender)
        if len(self._arrived) == 1 and self.patience is not None:
            self._late_timer = asyncio.get_running_loop().call_later(self.patience, self._leave_out_late, index)
        self._resolve_if_complete()
        return self._result_of(index)

    def _leave_out_late(self, index: int) -> None:
        if self._current == index and not self.closed:
            for sender in sorted(self._expected() - self._arrived):
                self.sender_failed(sender)

    def _expected(self) -> set[int]:
        return {s for s in range(self.num_senders) if self._failed_after[s] > self._current}

    def _resolve_if_complete(self) -> None:
        while not self.closed and self._arrived >= self._expected():
            assert self._accumulator is not None
            result = self._accumulator.result()
            included = tuple(sorted(self._taken))
            self.included.append(included)
            self._result_of(self._current).set_result((result, included))
            self._current += 1
            self._arrived, self._taken = set(), []
            if self._late_timer is not None:
                self._late_timer.cancel()
            if self._current == self.num_parts:
                self.closed, self._accumulator = True, None
            else:
                self._accumulator = self._aggregate(self.part_shapes[self._current])

    def sender_failed(self, sender: int) -> None:
        """Leave ``sender`` out of every part it has not sent (those it sent still count)."""
        if self.failed(sender):
            return
        self._failed_after[sender] = self.received[sender]
        self._resolve_if_complete()

    def close(self) -> None:
        """End the reducer: parts not resolved yet never will be; their senders get :class:`ReducerClosed`."""
        if self.closed and self._current >= self.num_parts:
            return
        self.closed = True
        if self._late_timer is not None:
            self._late_timer.cancel()
        for index, future in self._results.items():
            if not future.done():
                future.set_exception(ReducerClosed(f"the round ended before part {index} was resolved"))

    @property
    def complete(self) -> bool:
        return self._current >= self.num_parts
