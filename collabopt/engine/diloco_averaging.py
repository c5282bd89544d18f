"""DiLoCo's pseudo-gradient rounds on collabopt's own averaging service (:mod:`collabopt.engine.averager`).

Rules, and why:

* The round writes each pseudo-gradient into host buffers (float32, one per parameter) that are also the outer
  optimizer's ``.grad``; a round hands a copy of them to the service and writes its result back into them. Nothing
  here derives from hivemind's averagers: the service runs in a thread of this process.
* Matchmaking starts ahead of the round (:meth:`PseudoGradientRounds.schedule`); the buffers are handed over when
  the round starts (``ScheduledRound.run``), so that the group forms while the last inner steps run.
* Every member of a group receives the same bits (the service's reducers answer every sender alike). A member whose
  anchor is not its group's takes part with weight 0 and zeros
  (:func:`collabopt.engine.protocol.diloco_contributes`), before any part is sent.
* The swarm key: the service refuses a join request, and a group, with a member that proves no membership.
* What happened is handed on as evidence (:meth:`PseudoGradientRounds.report`); whether the round counts is
  :func:`collabopt.engine.protocol.diloco_round`'s decision only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from hivemind.compression import CompressionBase, Float16Compression

from collabopt.engine import protocol
from collabopt.engine.averager import AveragingResult, AveragingService, ScheduledRound
from collabopt.engine.clipping import MIN_CLIPPED_GROUP

logger = logging.getLogger(__name__)


def default_pseudo_gradient_compression() -> Any:
    """How pseudo-gradients travel unless ``grad_compression=`` says otherwise: fp16 (OpenDiLoCo found it lossless)."""
    return Float16Compression()


def pseudo_gradient_averager_factory(request_timeout: float | None, aggregation: str = "mean") -> Callable[..., Any]:
    """The loop's ``grad_averager_factory`` in DiLoCo mode: :class:`PseudoGradientRounds` with the averager options
    ``request_timeout`` (None: the service's default) and ``aggregation``."""
    return functools.partial(PseudoGradientRounds, request_timeout=request_timeout, aggregation=aggregation)


class PseudoGradientRounds:
    """The pseudo-gradient averaging of one DiLoCo peer: the buffers, the samples counted toward the next round, and
    rounds on an :class:`~collabopt.engine.averager.AveragingService` of ``prefix`` (``<run_id>_grad_averager``: two
    runs never meet).

    Takes the loop's averager arguments (:meth:`collabopt.engine.loop.PeerLoop._make_gradient_averager`), with
    hivemind's meanings: ``min_matchmaking_time``; ``next_chunk_timeout``: how long a reducer waits for a sender's
    next part (a sender waits twice as long for a reducer's next result, as hivemind's averagers do). Those of
    hivemind's that have no meaning here (``shutdown_timeout``, ``start``, ...) are accepted and unused."""

    def __init__(self, *, dht: Any, prefix: str, parameters: Sequence[torch.Tensor],
                 compression: CompressionBase | None = None, client_mode: bool | None = None,
                 aggregation: str = "mean", request_timeout: float | None = None, min_matchmaking_time: float = 5.0,
                 next_chunk_timeout: float | None = None, **_unused: Any):
        self.buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in parameters]
        self._lock = threading.RLock()
        self.local_samples_accumulated = self.local_times_accumulated = 0
        sender_timeout = next_chunk_timeout if next_chunk_timeout is not None else min_matchmaking_time
        options = {} if request_timeout is None else {"request_timeout": request_timeout}
        self.service = AveragingService(
            dht, prefix=prefix, min_group_size=MIN_CLIPPED_GROUP if aggregation == "centered_clip" else 2,
            matchmaking_time=min_matchmaking_time, sender_timeout=sender_timeout,
            reducer_timeout=2 * sender_timeout, aggregation=aggregation,
            compression=compression if compression is not None else default_pseudo_gradient_compression(),
            client_mode=bool(client_mode), **options)

    # ---- what the loop reads and counts

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The buffers (the pseudo-gradients, then the round's average), held while the block runs."""
        with self._lock:
            yield self.buffers

    def accumulate_grads_(self, batch_size: int) -> None:
        """Count a local step's samples (the inner optimizer applied its gradients already)."""
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1

    def reset_accumulated_grads_(self) -> None:
        self.local_samples_accumulated = self.local_times_accumulated = 0

    # ---- rounds

    def schedule(self, timeout: float, gather: Any) -> ScheduledRound:
        """Begin matchmaking for a round whose pseudo-gradients come later (``ScheduledRound.run``); ``gather``: this
        peer's round metadata (epoch, anchor fingerprint), which every member of the group receives."""
        return self.service.schedule(self.buffers, timeout=timeout, gather=gather, contributes=self._contributes)

    def run(self, control: ScheduledRound, weight: float) -> None:
        """Hand the buffers (copied now) and this peer's ``weight`` to the round ``control``."""
        with self.get_tensors() as buffers:
            control.run(buffers, weight)

    def _contributes(self, gathered: dict[Any, Any]) -> bool:
        me = self.service.p2p.peer_id
        if protocol.diloco_contributes(gathered, me):
            return True
        # this peer will not apply the round (its anchor is not the group's: the verdict after it says the same): it
        # takes part with nothing, so that the round holds only the pseudo-gradients of the members that apply it
        logger.info("collabopt: this peer's anchor is not its group's: it joins the round with weight 0")
        return False

    def report(self, result: AveragingResult) -> protocol.DiLoCoRoundEvidence:
        """What the round left, as the evidence :func:`collabopt.engine.protocol.diloco_round` takes (its group,
        error, received and included; the rest is the caller's), the average written into the buffers where it
        came."""
        if result.tensors is not None:
            with torch.no_grad(), self.get_tensors() as buffers:
                for buffer, value in zip(buffers, result.tensors, strict=True):
                    buffer.copy_(value)
        evidence = result.evidence
        group = dict(result.gathered) if result.group and result.gathered else None
        if evidence is None:
            return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, error=result.error or "no round")
        if not evidence.complete:
            logger.warning("collabopt: this DiLoCo round's all-reduce was incomplete: %.1f%% of the average arrived "
                           "here, this peer's values in %.1f%% of it; absent: %s; errors: %s",
                           100 * evidence.received, 100 * evidence.contributions[evidence.me],
                           [str(peer) for peer in evidence.absent()], evidence.errors)
        return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, error=result.error or "",
                                            received=evidence.received,
                                            included=evidence.contributions[evidence.me])

    def shutdown(self) -> None:
        self.service.close()


__all__ = ["PseudoGradientRounds", "default_pseudo_gradient_compression", "pseudo_gradient_averager_factory"]
