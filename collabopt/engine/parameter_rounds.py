"""The synchronous mode's parameter ("state") rounds, on collabopt's own averaging service
(:class:`~collabopt.engine.averager.AveragingService`): the parameters, the optimizer statistics named in
``average_opt_statistics`` and the extra tensors of a peer, averaged with a group of its swarm.

Rules, and why:

* A round is scheduled ahead (:meth:`ParameterRounds.schedule`: matchmaking runs while the boundary's optimizer step
  does) and handed its tensors when they are final (:meth:`ParameterRounds.finish`). Every member gathers the epoch
  its parameters will hold; a member whose epoch is not its group's takes part with weight 0 and zeros
  (:func:`collabopt.engine.protocol.sync_contributes`): a stale joiner's parameters never enter a round.
* Whether the average replaces this peer's tensors is :func:`collabopt.engine.protocol.parameter_round`'s decision:
  only a whole average this peer's own values are in. Otherwise it keeps its own tensors.
* A round is sized by the gradient round before it (:attr:`ParameterRounds.group_size_hint`): its peers reach the
  boundary together, so the group assembles as soon as they are in instead of idling a whole ``matchmaking_time``.
  For the same reason a hinted round whose group has not assembled within twice ``matchmaking_time`` is given up:
  a peer it expected is not coming (it downloads, or its lineage check sent it apart), and waiting the whole
  ``timeout`` would only keep this peer's state from the peers that download it. See docs/decisions.md, "Group size
  hint".
* Each tensor goes to its round with hivemind's state averager's compression info (:func:`round_infos`: the
  parameters' role and index, the statistics' role and (index, name), the extras' index): a compression that chooses
  by role or key (``state_averaging_compression=RoleAdaptiveCompression(...)``) compresses each as hivemind would.
* An auxiliary peer helps reduce and takes no average (weight 0): its parameters come from downloads.
* The averaged tensors' lock is held from the group's assembly to the install, as hivemind holds it, not during
  matchmaking (the state served meanwhile is not the round's yet). A round whose all-reduce outlives the step's wait
  is installed by the training thread's next step (:meth:`ParameterRounds.install_late`), never on the service's event
  loop: that loop runs every round of the service and must not wait on a lock the training thread holds. An average
  is written only while ``may_write()`` says its round still owns the tensors: a newer round handed them, or a
  downloaded state installed in them, replaces an average of the tensors it was handed.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, TensorRole

from collabopt.engine import protocol
from collabopt.engine.averager import AveragingResult, AveragingService, ScheduledRound
from collabopt.engine.clipping import MIN_CLIPPED_GROUP

logger = logging.getLogger(__name__)


def round_infos(tensors: Sequence[torch.Tensor], parameters: int, statistics: Sequence[str],
                extras: int) -> list[CompressionInfo]:
    """The compression infos of a parameter round's ``tensors`` (``parameters`` parameters, then each statistic of
    ``statistics`` for every parameter, then ``extras`` extra tensors), as hivemind's ``TrainingStateAverager`` gives
    them; a count that does not add up to the tensors raises ValueError."""
    keys = [*range(parameters), *((i, name) for name in statistics for i in range(parameters)), *range(extras)]
    roles = [TensorRole.PARAMETER] * parameters + [TensorRole.OPTIMIZER] * parameters * len(statistics) + \
        [TensorRole.UNSPECIFIED] * extras
    return [CompressionInfo.from_tensor(tensor, key=key, role=role)
            for tensor, key, role in zip(tensors, keys, roles, strict=True)]


class RoundFailed(Exception):
    """A parameter round whose average this peer did not install (no group, a refused member, part of it missing)."""


class ParameterRound:
    """One scheduled parameter round, as the loop holds it: ``done()``, ``cancel()``, ``cancelled()``,
    ``exception()`` (None where its average was installed), ``triggered`` and ``began_allreduce``."""

    def __init__(self, scheduled: ScheduledRound, epoch: int, hinted: bool = False):
        self.scheduled, self.epoch, self.hinted = scheduled, epoch, hinted  # hinted: sized by a gradient round
        self.decision: protocol.ParameterDecision | None = None
        self.in_background = False  # its all-reduce outlived the step's wait (install_late installs it)
        self._cancelled = False

    @property
    def triggered(self) -> bool:
        return self.scheduled.triggered

    @property
    def began_allreduce(self) -> bool:
        return self.scheduled.began_allreduce

    def done(self) -> bool:
        return self._cancelled or self.decision is not None

    def cancel(self) -> bool:
        """Leave the round (a group already assembled goes on without this peer)."""
        if self.decision is not None:
            return False
        self._cancelled = True
        self.scheduled.cancel()
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def exception(self) -> BaseException | None:
        if self.decision is None:
            return RoundFailed("cancelled" if self._cancelled else "not finished")
        return None if self.decision.install else RoundFailed(self.decision.detail)


class ParameterRounds:
    """The parameter rounds of one peer, on a service of ``prefix`` (``<run_id>_state_averager``). ``timeout``: a
    round's default (matchmaking and all-reduce); ``sender_timeout``: how long a reducer waits for a sender's next
    part; ``reducer_timeout``: how long a sender waits for a reducer's result (default: twice as long, as the gradient
    rounds do)."""

    group_size_hint: tuple[int, int] | None = None  # (epoch, peers) of an epoch's gradient round, whose boundary's
    # parameter round gathers the next epoch (the one its parameters will hold)

    def __init__(self, dht: Any, *, prefix: str, matchmaking_time: float, timeout: float, sender_timeout: float,
                 request_timeout: float, reducer_timeout: float | None = None,
                 target_group_size: int | None = None, min_group_size: int | None = None,
                 aggregation: str = "mean", compression: CompressionBase = NoCompression(),
                 client_mode: bool = False, auxiliary: bool = False):
        if min_group_size is None:
            min_group_size = MIN_CLIPPED_GROUP if aggregation == "centered_clip" else 2
        self.timeout, self.auxiliary, self.matchmaking_time = timeout, auxiliary, matchmaking_time
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self._assembly = threading.Condition()  # (notified in the service's thread: a group assembled, a round ended)
        self.service = AveragingService(
            dht, prefix=prefix, target_group_size=target_group_size, min_group_size=min_group_size,
            matchmaking_time=matchmaking_time, request_timeout=request_timeout, sender_timeout=sender_timeout,
            reducer_timeout=reducer_timeout or 2 * sender_timeout, aggregation=aggregation, compression=compression,
            client_mode=client_mode, on_group=self._assembled)

    def _assembled(self, *_: Any) -> None:
        with self._assembly:
            self._assembly.notify_all()

    def group_size(self, epoch: int) -> int | None:
        """The next round's target group size: :attr:`group_size_hint` where it is of ``epoch`` (used once), bounded
        by the configured one above and ``min_group_size`` below (a full group assembles at once)."""
        hint, self.group_size_hint = self.group_size_hint, None
        size = hint[1] if hint is not None and hint[0] == epoch else None
        if self.target_group_size is not None:
            size = self.target_group_size if size is None else min(size, self.target_group_size)
        return None if size is None else max(size, self.min_group_size)

    def schedule(self, template: Sequence[torch.Tensor], epoch: int, timeout: float | None = None,
                 infos: Sequence[CompressionInfo] | None = None) -> ParameterRound:
        """Begin matchmaking now for a round of tensors shaped like ``template`` (``infos``: :func:`round_infos`),
        whose parameters will be of ``epoch`` (gathered: only members at their group's epoch contribute)."""
        gather = {"epoch": int(epoch)}
        hint = self.group_size_hint
        hinted = hint is not None and hint[0] == epoch - 1  # (the boundary's epoch)
        scheduled = self.service.schedule(template, timeout=timeout or self.timeout, gather=gather,
                                          contributes=functools.partial(protocol.sync_contributes, gather),
                                          admits=functools.partial(protocol.sync_admits, gather),
                                          target_group_size=self.group_size(epoch - 1), infos=infos)
        scheduled.on_done(self._assembled)
        return ParameterRound(scheduled, epoch, hinted)

    def finish(self, control: ParameterRound, tensors: Sequence[torch.Tensor], lock: Any, timeout: float,
               may_write: Callable[[], bool], late: Callable[[], None]) -> dict:
        """Wait up to ``timeout`` in all for ``control``'s group, then under ``lock`` hand it ``tensors``, wait for
        its result and write the average into them where :func:`~collabopt.engine.protocol.parameter_round` says
        so and ``may_write()`` (asked under ``lock``) allows. ``lock`` is held from the group's assembly to the
        install: a state copied meanwhile (a download) waits for the average rather than get the tensors the round
        is about to replace. Returns the group's gathered data; raises :class:`RoundFailed`. A round whose
        all-reduce outlives the wait calls ``late()`` as it ends, in the service's thread (it must not block):
        :meth:`install_late` installs it then."""
        scheduled, deadline = control.scheduled, time.monotonic() + timeout
        assembly = min(timeout, 2 * self.matchmaking_time) if control.hinted else timeout  # (see the module's text)
        with self._assembly:  # (matchmaking: the tensors are not the round's yet, so the lock stays free)
            self._assembly.wait_for(lambda: scheduled.group is not None or scheduled.done(), assembly)
        if scheduled.group is not None or scheduled.done():
            with lock:
                if not scheduled.done():
                    scheduled.run(tensors, 0.0 if self.auxiliary else 1.0)
                try:
                    result = scheduled.result(max(0.0, deadline - time.monotonic()))
                except (TimeoutError, concurrent.futures.TimeoutError):
                    result = None
                if result is not None:
                    return self._install(control, result, tensors, may_write)
        if not control.began_allreduce:
            control.decision = protocol.ParameterDecision(False, f"no group within {assembly:.1f} s")
            scheduled.cancel()
            raise RoundFailed(control.decision.detail)
        control.in_background = True
        scheduled.on_done(late)
        raise RoundFailed("its all-reduce outlived the wait: it ends in the background")

    def install_late(self, control: ParameterRound, tensors: Sequence[torch.Tensor],
                     may_write: Callable[[], bool]) -> dict | None:
        """(under the tensors' lock; the training thread) Install ``control``'s average into ``tensors`` as
        :meth:`finish` would, where its all-reduce outlived the wait and has ended since. Returns the group's
        gathered data; None where there is nothing to install (yet); raises :class:`RoundFailed`."""
        if not control.in_background or control.done() or not control.scheduled.done():
            return None
        return self._install(control, control.scheduled.result(0), tensors, may_write)

    def _install(self, control: ParameterRound, result: AveragingResult, tensors: Sequence[torch.Tensor],
                 may_write: Callable[[], bool]) -> dict:
        """(under the tensors' lock) The protocol's decision on ``result``; the average into ``tensors`` if so."""
        me = self.service.p2p.peer_id
        evidence = result.evidence
        control.decision = decision = protocol.parameter_round(protocol.ParameterRoundEvidence(
            error=result.error or ("" if result.tensors is not None else "no average"),
            group_size=len(result.group),
            contributed=not self.auxiliary and protocol.sync_contributes(result.gathered.get(me), result.gathered),
            received=evidence.received if evidence is not None else 0.0))
        if decision.install and not may_write():
            control.decision = decision = protocol.ParameterDecision(
                False, "a newer round or a downloaded state replaced the tensors it was handed")
        if not decision.install:
            raise RoundFailed(decision.detail)
        assert result.tensors is not None
        with torch.no_grad():
            for tensor, average in zip(tensors, result.tensors, strict=True):
                tensor.copy_(average.to(dtype=tensor.dtype), non_blocking=True)
        return dict(result.gathered)

    def is_alive(self) -> bool:
        return not self.service.closed

    def shutdown(self) -> None:
        self.service.close()


class NoRounds:
    """A peer that averages no parameters (DiLoCo: its rounds are the pseudo-gradients'): no service at all."""

    group_size_hint = None

    def __init__(self) -> None:
        self.closed = False

    def schedule(self, *args: Any, **kwargs: Any) -> ParameterRound:
        raise RuntimeError("this peer averages no parameters (DiLoCo mode)")

    def is_alive(self) -> bool:
        return not self.closed

    def shutdown(self) -> None:
        self.closed = True

__all__ = ["NoRounds", "ParameterRound", "ParameterRounds", "RoundFailed", "round_infos"]
