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
* With ``pseudo_gradient_compression=SparseLoCo(...)`` the rounds are :class:`SparsePseudoGradientRounds`: each
  member compresses ``error feedback + pseudo-gradient``, all-gathers the payloads on an
  :class:`~collabopt.engine.gather_exchange.ExchangeService` and aggregates the agreed set itself
  (:func:`collabopt.sparse_aggregation.aggregate`: the same bits on every member that applies it). The buffer keeps
  what the payload left out only once the round is applied (:meth:`SparsePseudoGradientRounds.settle`), by the
  others where this member could not apply it after its payload went out
  (:meth:`SparsePseudoGradientRounds.settle_delivered`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from hivemind.compression import CompressionBase, Float16Compression

from collabopt.diloco_options import SparseLoCo
from collabopt.engine import protocol
from collabopt.engine.averager import AveragingResult, AveragingService, ScheduledRound
from collabopt.engine.clipping import MIN_CLIPPED_GROUP
from collabopt.engine.gather_exchange import ExchangeResult, ExchangeService, ScheduledExchange
from collabopt.engine.gather_round import MAX_PAYLOAD_LIMIT
from collabopt.errors import ConfigurationError
from collabopt.sparse_aggregation import AGREEMENT_FLOOR, aggregate_set
from collabopt.sparse_codec import VERSION, PayloadError

logger = logging.getLogger(__name__)

# How a compressed round's members aggregate (in the exchange's settings: members of other rules never meet): 2, the
# waiting members count as zeros (aggregate_set(waiting=...))
ROUND_RULES = 2


def default_pseudo_gradient_compression() -> Any:
    """How pseudo-gradients travel unless ``grad_compression=`` says otherwise: fp16 (OpenDiLoCo found it lossless)."""
    return Float16Compression()


def pseudo_gradient_averager_factory(request_timeout: float | None, aggregation: str = "mean",
                                     compression: SparseLoCo | None = None) -> Callable[..., Any]:
    """The loop's ``grad_averager_factory`` in DiLoCo mode: :class:`PseudoGradientRounds` with the averager options
    ``request_timeout`` (None: the service's default) and ``aggregation``; :class:`SparsePseudoGradientRounds` where
    ``compression`` (``pseudo_gradient_compression``) is given."""
    if compression is not None:
        return functools.partial(SparsePseudoGradientRounds, sparse=compression, request_timeout=request_timeout,
                                 aggregation=aggregation)
    return functools.partial(PseudoGradientRounds, request_timeout=request_timeout, aggregation=aggregation)


class _Buffers:
    """The host buffers of a DiLoCo peer's rounds (float32, one per parameter; also the outer optimizer's ``.grad``)
    and the samples counted toward the next round."""

    def __init__(self, parameters: Sequence[torch.Tensor]):
        self.buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in parameters]
        self._lock = threading.RLock()
        self.local_samples_accumulated = self.local_times_accumulated = 0

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

    def settle(self, applied: bool) -> None:
        """The round this peer last contributed to was decided (``applied``: the outer step follows). Nothing to do
        for dense rounds; :class:`SparsePseudoGradientRounds` settles its error feedback."""

    def settle_delivered(self, applied: bool) -> None:
        """A round this peer did not apply, though its pseudo-gradient may have reached the others, was decided
        (``applied``: by the others). Nothing to do for dense rounds; see
        :meth:`SparsePseudoGradientRounds.settle_delivered`."""


class PseudoGradientRounds(_Buffers):
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
        super().__init__(parameters)
        sender_timeout = next_chunk_timeout if next_chunk_timeout is not None else min_matchmaking_time
        options = {} if request_timeout is None else {"request_timeout": request_timeout}
        self.service = AveragingService(
            dht, prefix=prefix, min_group_size=MIN_CLIPPED_GROUP if aggregation == "centered_clip" else 2,
            matchmaking_time=min_matchmaking_time, sender_timeout=sender_timeout,
            reducer_timeout=2 * sender_timeout, aggregation=aggregation,
            compression=compression if compression is not None else default_pseudo_gradient_compression(),
            client_mode=bool(client_mode), **options)

    # ---- rounds

    def schedule(self, timeout: float, gather: Any) -> ScheduledRound:
        """Begin matchmaking for a round whose pseudo-gradients come later (``ScheduledRound.run``); ``gather``: this
        peer's round metadata (epoch, anchor fingerprint), which every member of the group receives."""
        admits = functools.partial(protocol.sync_admits, gather) if isinstance(gather, dict) else None
        return self.service.schedule(self.buffers, timeout=timeout, gather=gather, contributes=self._contributes,
                                     admits=admits)

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


class SparsePseudoGradientRounds(_Buffers):
    """The pseudo-gradient rounds of a DiLoCo peer with ``pseudo_gradient_compression=sparse``: the same buffers and
    loop interface as :class:`PseudoGradientRounds`, the round an all-gather of compressed payloads.

    * :meth:`run`: the payload is ``compress(error_decay * e + pseudo-gradient)``; the update of ``e`` waits for
      :meth:`settle` (kept where the round is applied, dropped otherwise: an unapplied round's pseudo-gradient stays in
      the parameters and is sent again, see :mod:`collabopt.error_feedback`). Where this member may not apply the set
      after its payload went out, the others may have applied it: the update is held until
      :meth:`settle_delivered` (the DiLoCo peer's next state download tells). A peer of weight 0 sends nothing.
    * :meth:`report`: every member that applies the round aggregates the same set of payloads, those of members whose
      anchor is not the group's at weight 0 (:func:`collabopt.engine.protocol.diloco_contributes`, on the group's
      gathered metadata, which every member holds alike), a payload that does not decode left out by all.
    * Peers meet only peers of the same codec settings and ``aggregation`` (both are in the exchange's prefix): two
      members that decoded or aggregated differently would apply different rounds. The error feedback's decay is
      the peer's own.
    * A joiner starts with a zero buffer: the buffer is not part of the state peers download.
    * A member that is not one of its round's contributors (``SparseLoCo.max_contributors``) sends no payload and
      applies the round like the others: its error feedback keeps all of its pseudo-gradient, undecayed
      (:meth:`~collabopt.error_feedback.ErrorFeedback.defer`), and its next rounds send it. Every member counts the
      waiting members of the set (weight > 0, anchor the group's) as contributions of zeros, one each whatever
      weight it claims (``aggregate_set(waiting=...)``).
    """

    def __init__(self, *, dht: Any, prefix: str, parameters: Sequence[torch.Tensor], sparse: SparseLoCo,
                 aggregation: str = "mean", request_timeout: float | None = None, min_matchmaking_time: float = 5.0,
                 next_chunk_timeout: float | None = None, **_unused: Any):
        super().__init__(parameters)
        self.shapes = [tuple(b.shape) for b in self.buffers]
        self.codec, self.aggregation = sparse.codec, aggregation
        self.error_feedback = sparse.error_feedback(self.shapes)
        self.bytes_sent = self.bytes_received = 0  # the bodies of the exchange's messages, over all rounds
        self._went_out = False  # the last exchange: not applied here after this member's payload went out
        self._left_out = False  # the last exchange: applied without this member's payload (the robust aggregate)
        self._waited = False  # the last exchange: this member was not one of its contributors (max_contributors)
        payload_bytes = self.codec.payload_bytes(sum(math.prod(shape) for shape in self.shapes))
        if payload_bytes > MAX_PAYLOAD_LIMIT:
            raise ConfigurationError(
                "pseudo_gradient_compression", f"its payload for this model is up to {payload_bytes} bytes, over the "
                f"exchange's limit of {MAX_PAYLOAD_LIMIT} (one message of the daemon)",
                "pass a lower SparseLoCo(density=...) or bits, or drop pseudo_gradient_compression")
        # (peers of another payload format or other settings never meet in a group: each side would refuse the
        # other's payloads and apply a round of its own)
        settings = repr((self.codec.density, self.codec.chunk_size, self.codec.bits, aggregation, VERSION,
                         sparse.max_contributors, ROUND_RULES)).encode()
        options = {} if request_timeout is None else {"request_timeout": request_timeout}
        self.service = ExchangeService(
            dht, prefix=f"{prefix}_sparse{hashlib.sha256(settings).hexdigest()[:12]}",
            min_group_size=MIN_CLIPPED_GROUP if aggregation == "centered_clip" else 2,
            matchmaking_time=min_matchmaking_time, max_payload_bytes=payload_bytes,
            max_contributors=sparse.max_contributors,
            phase_timeout=next_chunk_timeout if next_chunk_timeout is not None else min_matchmaking_time, **options)

    def schedule(self, timeout: float, gather: Any) -> ScheduledExchange:
        """Begin matchmaking for a round whose payload comes later (:meth:`run`); ``gather``: this peer's round
        metadata (epoch, anchor fingerprint), which every member of the group receives."""
        admits = functools.partial(protocol.sync_admits, gather) if isinstance(gather, dict) else None
        return self.service.schedule(timeout=timeout, gather=gather, admits=admits)

    def run(self, control: ScheduledExchange, weight: float) -> None:
        """Compress the buffers (this peer's pseudo-gradient) with the error feedback and hand the payload and
        ``weight`` to the round ``control``; weight 0 (nothing trained, or refused as non-finite) sends nothing."""
        if weight == 0:
            self.error_feedback.discard()
            control.tag_along()
            return
        with self.get_tensors() as buffers:
            payload = self.error_feedback.compress(buffers)
        control.run(payload, weight)

    def settle(self, applied: bool) -> None:
        """The round decided (:func:`collabopt.engine.protocol.diloco_round`): the error feedback keeps what this
        round's payload left out where it was ``applied`` (all of the round's update where the robust aggregate left
        this member's payload out, undecayed where it waited: not one of the contributors), and stays as before it
        otherwise; where the payload went
        out but this member may not apply the set (:meth:`report`), the others may have applied it: the update is
        held for :meth:`settle_delivered` (the round's decision says so too: ``may_have_delivered``). An update
        already held is left to :meth:`settle_delivered`."""
        feedback = self.error_feedback
        if not feedback.staged or feedback.held:
            return
        if applied and self._waited:
            feedback.defer()
        elif applied and self._left_out:
            feedback.commit_unsent()
        elif applied:
            feedback.commit()
        elif self._went_out:
            feedback.hold()
            logger.info("collabopt: this DiLoCo exchange's payload went out: its error-feedback update is kept until "
                        "a state download tells whether the others applied the round")
        else:
            feedback.discard()

    def settle_delivered(self, applied: bool) -> None:
        """The round whose error-feedback update :meth:`settle` held was decided (``applied``: the others applied
        it, so its payload is in the swarm's anchor: the buffer keeps the rest; otherwise the buffer stays as before
        it and this peer's next round sends the pseudo-gradient again). Called by the DiLoCo peer
        (:meth:`collabopt.diloco.DiLoCo.restore_after_download`, or when it takes the round as not applied). Not known
        here: whether the others' robust aggregate left this payload out (then the buffer would keep all of the round,
        as :meth:`~collabopt.error_feedback.ErrorFeedback.commit_unsent` does); it keeps the remainder only."""
        feedback = self.error_feedback
        if not feedback.held:
            return
        if applied:
            feedback.commit()
        else:
            feedback.discard()
        logger.info("collabopt: the others %s the round this peer's payload went out in: its error-feedback update is "
                    "%s", "applied" if applied else "did not apply", "kept" if applied else "dropped")

    def report(self, result: ExchangeResult) -> protocol.DiLoCoRoundEvidence:
        """What the exchange left, as the evidence :func:`collabopt.engine.protocol.diloco_round` takes; the aggregate
        written into the buffers where this member may apply the set. A member that may not, after its offers went
        out, reports that none of the average arrived while its pseudo-gradient may have reached the others (who may
        apply the round): it downloads before its next round."""
        self.bytes_sent += result.sent_bytes
        self.bytes_received += result.received_bytes
        group = dict(result.gathered) if result.group and result.gathered else None
        self._went_out = self._left_out = self._waited = False
        if result.applied_set is None:
            if result.group and result.sent_bytes > 0 and result.contributed:
                self._went_out = True  # (settle holds the error feedback's update)
                logger.warning("collabopt: this DiLoCo exchange is not applied here (%s); its payload went out",
                               result.error)
                return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, received=0.0, included=1.0)
            return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, error=result.error or "no round")
        gathered, chosen = dict(result.gathered), result.contributors
        contributions = {c.peer: (c.weight if protocol.diloco_contributes(gathered, c.peer) else 0.0, c.payload)
                         for c in result.applied_set if chosen is None or c.peer in chosen}
        waiting = sum(1 for c in result.applied_set  # (not chosen, trained, and it applies the round: a zero)
                      if chosen is not None and c.peer not in chosen and c.weight > 0
                      and protocol.diloco_contributes(gathered, c.peer))
        me, dropped = self.service.p2p.peer_id, False
        while True:
            try:
                average = aggregate_set(contributions, self.shapes, self.codec, self.aggregation, waiting)
                break
            except PayloadError as e:  # (every member decodes the same payloads: all leave the same one out)
                peer = getattr(e, "peer", None)
                if peer not in contributions or contributions[peer][0] == 0:
                    return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, error=f"aggregation failed: {e}")
                logger.warning("collabopt: a payload of this DiLoCo exchange does not decode, left out: %s", e)
                contributions[peer] = (0.0, b"")
                dropped = dropped or peer == me
            except ValueError as e:  # (no contribution of positive weight)
                return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, error=f"nothing to aggregate: {e}")
        for peer, agreement in zip(average.left_out, average.agreement, strict=True):
            logger.warning("collabopt: the robust aggregate of this DiLoCo exchange left out %s%s: its pseudo-gradient "
                           "points away from the others' (agreement %.3f, below %s)", peer,
                           " (this peer)" if peer == me else "", agreement, AGREEMENT_FLOOR)
        self._left_out = me in average.left_out or dropped  # (its payload is not in the aggregate)
        self._waited = not result.contributed
        with torch.no_grad(), self.get_tensors() as buffers:
            for buffer, value in zip(buffers, average.tensors, strict=True):
                buffer.copy_(value)
        if not result.contributed:  # (its pseudo-gradient waits in its error feedback: it counts, sent later)
            return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, contributed=False)
        return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, included=0.0 if self._left_out else 1.0)

    def shutdown(self) -> None:
        self.service.close()


__all__ = ["PseudoGradientRounds", "SparsePseudoGradientRounds", "default_pseudo_gradient_compression",
           "pseudo_gradient_averager_factory"]
