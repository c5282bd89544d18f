"""The synchronous mode's gradient rounds, on collabopt's own averaging service
(:class:`~collabopt.engine.averager.AveragingService`): the accumulation of the local steps' gradients, the round's
buffers (which the offloaded optimizer steps on), the round's scheduling and its result.

Rules, and why:

* The local steps accumulate as hivemind's gradient averager does (each step's gradients scaled by its batch size
  over the epoch's first; with ``reuse_grad_buffers`` they accumulate in ``param.grad`` and only the steps are
  counted), so that users' learning rates keep their meaning. Where the optimizer steps within the boundary on CPU
  gradients (``accumulate_in_buffers``), the local steps accumulate in the round's buffers themselves: 1x the
  parameters less.
* A round is scheduled ahead (matchmaking begins about ``matchmaking_time`` before the epoch's end) and handed its
  tensors at the boundary (:meth:`GradientRounds.step`). Every member gathers its epoch; a member whose epoch is below
  its group's newest adds nothing (:func:`collabopt.engine.protocol.sync_contributes`): a stale joiner's gradients
  never enter a round before its download.
* The round's result enters the buffers only where this member's gradients are in it (:attr:`GradientRound.
  contributed`) and the protocol says the average is whole
  (:func:`collabopt.engine.protocol.sync_gradients`): a failed or partial round leaves this peer's own mean gradient
  in them, and the accumulation stays until the epoch ends (the loop resets it), so the peer steps with its own
  gradients. Whether the round counts is :func:`collabopt.engine.protocol.sync_round`'s, from :attr:`GradientRound.
  evidence`.
* Its interface is the part of hivemind's ``GradientAverager`` the loop uses (``step``, ``schedule_step``,
  ``get_tensors``...), so that a user's ``grad_averager_factory`` still plugs in as an instance of hivemind's class
  (hivemind's ``PowerSGDGradientAverager`` runs as collabopt's own: :mod:`collabopt.engine.powersgd_rounds`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import CompressionBase, NoCompression

from collabopt.engine import protocol
from collabopt.engine.averager import AveragingResult, AveragingService, ScheduledRound

DEFAULT_REQUEST_TIMEOUT = 3.0  # (hivemind's)
logger = logging.getLogger(__name__)


class RoundFailed(Exception):
    """A gradient round gave no average (no group, a refused member, this peer handed nothing, ...)."""


class GradientRound:
    """One scheduled gradient round, as the loop holds it (the part of hivemind's ``StepControl`` it uses):
    :meth:`allow_allreduce` hands it the buffers and :attr:`weight`; :meth:`result` is the gathered data of its
    group, or raises :class:`RoundFailed`. ``evidence``: the :class:`AveragingResult` once it ended."""

    def __init__(self, rounds: GradientRounds, scheduled: ScheduledRound):
        self.rounds, self.scheduled = rounds, scheduled
        self.weight = 0.0
        self.evidence: AveragingResult | None = None
        self._installed = False

    @property
    def triggered(self) -> bool:
        return self.scheduled.triggered

    @property
    def began_allreduce(self) -> bool:
        return self.scheduled.began_allreduce

    @property
    def stage(self) -> AveragingStage:
        if self.done():
            return AveragingStage.FINISHED
        return AveragingStage.LOOKING_FOR_GROUP if self.scheduled.group is None else AveragingStage.AWAITING_TRIGGER

    def allow_allreduce(self) -> None:
        """Hand the round this peer's buffers (copied now) and weight."""
        with self.rounds.get_tensors() as buffers:
            self.scheduled.run(buffers, self.weight)

    def tag_along(self) -> None:
        """Take part with nothing: zeros of the round's own, weight 0. The buffers are left as they are (they may
        be the epoch's accumulation or the optimizer's gradients, which a failed round still steps with)."""
        self.weight = 0.0
        self.scheduled.tag_along()

    @property
    def contributed(self) -> bool:
        """Whether this member's gradients are in the round's average: it handed a weight above 0 and its epoch is
        its group's (:func:`collabopt.engine.protocol.sync_contributes`; else the service sent zeros, weight 0). A
        member that did not contribute never installs the average: it may be the others' only (another epoch's),
        or NaN where every weight was 0."""
        ended = self._ended()
        mine = ended.gathered.get(self.rounds.service.p2p.peer_id)
        return self.weight > 0 and protocol.sync_contributes(mine, ended.gathered)

    def done(self) -> bool:
        return self.scheduled.done()

    def cancel(self) -> None:
        self.scheduled.cancel()

    def cancelled(self) -> bool:
        return self.done() and self._ended().error == "cancelled"

    def exception(self) -> BaseException | None:
        ended = self._ended()
        return None if ended.tensors is not None and ended.error is None else RoundFailed(ended.error)

    def _ended(self, timeout: float | None = None) -> AveragingResult:
        if self.evidence is None:
            self.evidence = self.scheduled.result(timeout)
        return self.evidence

    def result(self, timeout: float | None = None) -> dict:
        """The group's gathered data (this peer's entry with ``received``, the share of the average that arrived,
        where below 1); the average is in the buffers where it is whole. Raises :class:`RoundFailed`."""
        ended = self._ended(timeout)
        if ended.tensors is None or ended.error is not None:
            raise RoundFailed(ended.error)
        received = ended.evidence.received if ended.evidence is not None else 0.0
        if not self._installed:
            self._installed = True
            refused = {str(ended.evidence.members[sender]): count for sender, (_, count)
                       in ended.evidence.my_slice.items() if count} if ended.evidence is not None else {}
            if refused:  # (the part reducer takes no non-finite or malformed part: the others' average is kept)
                logger.warning("collabopt: this peer's reducer refused parts of a gradient round (non-finite or "
                               "malformed; their senders' values are left out): %s", refused)
            if protocol.sync_gradients(received) and self.contributed:
                with self.rounds.get_tensors() as buffers:
                    for buffer, average in zip(buffers, ended.tensors, strict=True):
                        buffer.copy_(average)
        gathered = dict(ended.gathered)
        me = self.rounds.service.p2p.peer_id
        if received < 1.0 and isinstance(gathered.get(me), dict):
            gathered[me] = dict(gathered[me], received=received)
        return gathered


class GradientRounds:
    """A synchronous peer's gradient accumulation and rounds. Its keyword arguments are those the loop gives any
    gradient averager (hivemind's names); ``aggregation``: ``"mean"`` or ``"centered_clip"``."""

    def __init__(self, *, dht: Any, prefix: str, parameters: Sequence[torch.Tensor], min_matchmaking_time: float,
                 allreduce_timeout: float, next_chunk_timeout: float | None = None, client_mode: bool = False,
                 auxiliary: bool = False, reuse_grad_buffers: bool = False,
                 compression: CompressionBase = NoCompression(), request_timeout: float | None = None,
                 aggregation: str = "mean", min_group_size: int = 2, target_group_size: int | None = None,
                 shutdown_timeout: float = 5.0, start: bool = True):
        self.parameters = tuple(parameters)
        self.reuse_grad_buffers, self.auxiliary = reuse_grad_buffers, auxiliary
        self.allreduce_timeout = allreduce_timeout
        self.state_sharing_priority = 0.0  # (read by nobody: this averager serves no state)
        self._buffers = [torch.zeros_like(p, device="cpu") for p in self.parameters]
        self._accumulators = None if reuse_grad_buffers else [torch.zeros_like(p) for p in self.parameters]
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size: int | None = None
        self._lock = threading.RLock()  # the buffers: a round's result is written from the thread that awaits it
        self.accumulates_in_place = self._scaled = False
        sender_timeout = next_chunk_timeout or min_matchmaking_time
        self.service = AveragingService(
            dht, prefix=prefix, target_group_size=target_group_size, min_group_size=min_group_size,
            matchmaking_time=min_matchmaking_time, request_timeout=request_timeout or DEFAULT_REQUEST_TIMEOUT,
            sender_timeout=sender_timeout, reducer_timeout=2 * sender_timeout, aggregation=aggregation,
            compression=compression, client_mode=client_mode)

    # ---- accumulation

    def accumulate_in_place(self) -> None:
        """Accumulate in the round's buffers instead of accumulators of their own (see above). The caller ensures
        that the round is awaited within the boundary and the parameters are on the CPU."""
        assert not self.reuse_grad_buffers
        with self.get_tensors() as buffers:
            for buffer in buffers:
                buffer.zero_()
            self._accumulators = list(buffers)
        self.accumulates_in_place = True

    def _grad_accumulators(self) -> Iterator[torch.Tensor]:
        if self.reuse_grad_buffers:
            for param in self.parameters:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                yield param.grad
        else:
            assert self._accumulators is not None
            yield from self._accumulators

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int) -> None:
        """Add the parameters' gradients of a local step of ``batch_size`` samples (hivemind's rule)."""
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1
        if self.reuse_grad_buffers:
            return  # (the user's backward passes accumulate in param.grad)
        alpha = float(batch_size) / self._anchor_batch_size
        with self._lock:
            for param, accumulator in zip(self.parameters, self._grad_accumulators(), strict=True):
                if param.grad is not None:
                    accumulator.add_(param.grad.to(accumulator.device), alpha=alpha)

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """This peer's mean gradient of the epoch into the round's buffers (in place: scaled there, once)."""
        scale = 1.0 / self.local_times_accumulated if self.local_times_accumulated else 0.0
        with self.get_tensors() as buffers:
            if self.accumulates_in_place:
                if not self._scaled:
                    for buffer in buffers:
                        buffer.mul_(scale)
                    self._scaled = True
                return
            for buffer, accumulator in zip(buffers, self._grad_accumulators(), strict=True):
                buffer.copy_(accumulator, non_blocking=True).mul_(scale)

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        """Start the next epoch's accumulation."""
        with self._lock:
            self.local_samples_accumulated = self.local_times_accumulated = 0
            self._anchor_batch_size, self._scaled = None, False
            for accumulator in self._grad_accumulators():
                accumulator.zero_()

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The round's buffers (the offloaded optimizer's gradients), under their lock."""
        with self._lock:
            yield self._buffers

    def notify_used_averaged_gradients(self) -> None:
        """(hivemind's interface: nothing to do here.)"""

    # ---- rounds

    def schedule_step(self, timeout: float | None = None, gather: Any = None, **_: Any) -> GradientRound:
        """Begin matchmaking for a round of these buffers now; the round gathers ``gather`` (this peer's epoch in
        it decides whether its gradients count in its group: :func:`collabopt.engine.protocol.sync_contributes`)."""
        mine = gather if isinstance(gather, dict) else None
        scheduled = self.service.schedule(
            self._buffers, timeout=timeout or self.allreduce_timeout, gather=gather,
            contributes=None if mine is None else functools.partial(protocol.sync_contributes, mine),
            admits=None if mine is None else functools.partial(protocol.sync_admits, mine))
        return GradientRound(self, scheduled)

    def step(self, weight: float | None = None, reset_accumulators: bool = True, control: GradientRound | None = None,
             timeout: float | None = None, wait: bool = True, gather: Any = None, **_: Any) -> Any:
        """The boundary's round: this peer's mean gradient into the buffers, handed to ``control`` (scheduled ahead;
        None: scheduled now) with ``weight`` (default: the samples accumulated). ``reset_accumulators``: the next
        epoch accumulates while the round runs (``delay_grad_averaging``); otherwise the accumulation stays until
        the epoch ends (a failed round steps with it). Returns the round, or with ``wait`` its result."""
        if control is None:
            control = self.schedule_step(timeout, gather)
        self.load_accumulators_into_averager_()
        control.weight = float(self.local_samples_accumulated if weight is None else weight)
        if reset_accumulators:
            assert not self.accumulates_in_place
            self.reset_accumulated_grads_()
        control.allow_allreduce()
        return control.result(timeout) if wait else control

    # ---- the service

    def is_alive(self) -> bool:
        return not self.service.closed

    def shutdown(self) -> None:
        self.service.close()


# Gradient accumulation in place: where the round is awaited within the boundary and the optimizer steps there too,
# on CPU gradients without reuse_grad_buffers (see above). See docs/decisions.md, "Gradient accumulation in place".
ACCUMULATE_IN_PLACE = True


def can_accumulate_in_place(loop: Any, rounds: GradientRounds) -> bool:
    """Whether ``rounds`` (the gradient rounds of ``loop``, a synchronous loop being built) can accumulate in the
    round's buffers: no delayed round or step, no ``reuse_grad_buffers``, parameters on the CPU."""
    if not ACCUMULATE_IN_PLACE or rounds.reuse_grad_buffers or loop.delay_grad_averaging or loop.delay_optimizer_step:
        return False
    return all(param.device.type == "cpu" for param in rounds.parameters)
