"""DiLoCo mode: every peer takes many steps of its own optimizer; rounds average the change of the parameters.

Passing ``outer_optimizer=`` to :class:`~collabopt.CollaborativeOptimizer` (or to any adapter) selects this mode
(Douillard et al., 2023, "DiLoCo"; OpenDiLoCo built it on hivemind too):

* your ``optimizer`` is the **inner** optimizer: every ``step()`` applies it at once to the local gradients, so the
  model changes locally at every step; its statistics stay local;
* a **round** happens when the swarm has accumulated ``target_batch_size`` samples since the last one (hivemind's
  progress tracker, as for every global epoch: fast peers simply take more inner steps); ``local_epoch`` counts
  rounds, and the LR scheduler steps once per round on the inner optimizer;
* in a round, each peer's **pseudo-gradient** ``parameters after the last round - current parameters`` is averaged
  over the round's peers, weighted by the samples each one trained on since the last round, and the **outer
  optimizer** steps from the last round's parameters (the *anchor*) with it. Every peer of the round ends with the
  same parameters: they held the same anchor and outer state, and the averaged pseudo-gradient reaches every peer as
  the same values (collabopt's averaging service, :mod:`collabopt.engine.diloco_averaging`);
* the anchor and the outer optimizer's state (e.g. momentum) are the swarm's state: a late joiner downloads them;
  a peer serves them between its rounds, never during one (its wait for its group included): that anchor is
  about to move, and a joiner too late for the round's group would bring it to the next round's;
* pseudo-gradients travel as fp16 (or ``grad_compression=``), or top-k at 2 bits (``pseudo_gradient_compression=``);
* with ``overlap_rounds=True`` the round's all-reduce runs in the background while inner steps go on: the epoch
  moves on when the round starts, and its result is applied when it arrives (at the next ``step()`` after it, at
  the latest before the next round), keeping the progress made meanwhile (``parameters = new anchor + progress since
  the round started``): that progress is contributed one round late. A round that cannot be applied then is kept
  for the next one, and the peer re-synchronizes by state download (keeping its progress), since its epoch no
  longer tells whether the others applied it. While a round is in flight the peer serves no state (its epoch is
  already the next one, its anchor still the last one); a peer one epoch behind that trained toward that round
  starts it too instead of downloading (:func:`should_download`). ``flush()`` waits for the round in flight
  and applies it; ``load_state_dict()`` waits for it and drops it (the loaded parameters become the anchor).

Faults (:meth:`DiLoCo.run_round`). A round is applied only if it is sound: every part of the average arrived, the
group holds more than half of the peers this peer counts (no split brain), its peers held the same anchor at the same
epoch, and the average is finite. Otherwise this peer keeps its pseudo-gradient for the next round, and if the swarm
applied the round meanwhile it re-synchronizes by state download, keeping its local progress. Non-finite values are
refused at both ends; a peer whose parameters turned non-finite restarts from the last round's. The reasons and the
measurements are in docs/decisions.md ("DiLoCo: faults").

    >>> import functools, torch
    >>> outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    >>> check_outer_optimizer(outer)       # what CollabConfig checks before any network starts
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from collabopt.diloco_metadata import agrees_with_group, anchor_metadata
from collabopt.diloco_options import (  # re-exported: their import path before the split
    INCOMPATIBLE,
    INCOMPATIBLE_HIVEMIND,
    OUTER_EXAMPLE,
    check_config,
    check_outer_optimizer,
)
from collabopt.diloco_schedule import (  # (re-exported)
    MAX_REPORT_PERIOD,
    REPORT_SHARE,
    report_period,
    should_download,
    step_decision,
)
from collabopt.engine import protocol
from collabopt.guard import NonFiniteGuard, all_finite
from collabopt.interface import RoundOutcome
from collabopt.lineage import fingerprint, same_fingerprint

logger = logging.getLogger(__name__)

# what a peer keeps of a round it does not apply, where not all of its progress (see DiLoCo.run_round)
_KEPT = {"anchor differs": "it took part with weight 0 (its pseudo-gradient is not in the round): it downloads the "
                           "swarm's state and keeps all its progress for its next round"}


@dataclass
class PendingRound:
    """Overlap mode: a round whose all-reduce runs in the background."""

    weight: float
    num_peers: int
    metadata: dict[str, Any]
    base: list[torch.Tensor]  # the parameters the pseudo-gradient was taken from


class RoundSwarm(Protocol):
    """What a round needs of the swarm (:class:`collabopt.engine.diloco_round.DiLoCoLoop`; tests use a fake)."""

    peer_id: Any  # this peer's id, as the group's gathered metadata names it
    num_peers: int
    local_epoch: int
    anchors: Sequence[torch.Tensor]  # the outer optimizer's parameters: the parameters after the last round
    parameters: Sequence[torch.Tensor]  # the model's parameters (those the inner optimizer steps)

    def buffers(self) -> contextlib.AbstractContextManager[Sequence[torch.Tensor]]: ...
    def average(self, weight: float) -> protocol.DiLoCoRoundEvidence: ...  # all-reduce the buffers (the average
    # replaces them where it arrived); what the all-reduce left (group, error, received, included)
    def skip_averaging(self) -> None: ...  # no round with others this time (cancel a scheduled one)
    def outer_step(self, increment_epoch: bool = True) -> None: ...  # outer step on the anchors (grads: the
    # buffers), then parameters = anchors
    def reanchor(self, source: Sequence[torch.Tensor] | None = None) -> None: ...  # anchors = source / parameters
    def settle_delivered(self, applied: bool) -> None: ...  # optional: a round this peer's pseudo-gradient may have
    # reached is decided (applied by the others, or not): the rounds' state that waited for it follows (error feedback)


class DiLoCo:
    """The DiLoCo state of one peer: the inner optimizer, the samples since the last round, the round logic.

    ``copt.diloco`` of a :class:`~collabopt.CollaborativeOptimizer` in DiLoCo mode (``None`` otherwise); its
    counters (``rounds_applied``, ``rounds_failed``, ``resyncs``, ``last_round``) say how the rounds went.
    """

    def __init__(self, inner: torch.optim.Optimizer, guard: NonFiniteGuard | None = None, overlap: bool = False):
        self.inner = inner
        self.guard = guard
        self.overlap = overlap  # the round's all-reduce runs in the background (overlap_rounds=True)
        self.pending_samples = 0  # samples trained on since the anchor: this peer's weight in the next round
        self.needs_sync = False  # this peer's anchor disagreed with its group's: download the swarm's state
        self.rounds_applied = 0
        self.rounds_failed = 0
        self.resyncs = 0  # state downloads that kept this peer's local progress
        self.samples_discarded = 0  # samples of inner steps undone by restarts (non-finite parameters)
        self.swarm_writes = 0  # times the swarm replaced this peer's parameters (rounds applied, downloads)
        self.last_round: RoundOutcome | None = None
        self.pending: PendingRound | None = None  # overlap mode: the round whose all-reduce is running
        # after a partial round its pseudo-gradient may have reached: (the parameters it was taken from, its
        # weight, the round's epoch), until a download of a later epoch tells whether the swarm applied it
        self.delivered: tuple[list[torch.Tensor], float, int] | None = None
        self._undecided = 0  # downloads since, none of which told (see restore_after_download)

    # ------------------------------------------------------------------ between rounds

    def inner_step(self, samples: int) -> None:
        """Apply the inner optimizer to this step's (finite) gradients; count the samples toward this peer's
        weight."""
        self.inner.step()
        self.pending_samples += samples

    @torch.no_grad()
    def local_progress(self, swarm: RoundSwarm) -> list[torch.Tensor]:
        """``parameters - anchor``: what this peer learned since the last round (kept across a state download)."""
        return progress_from(swarm.parameters, swarm.anchors)

    @torch.no_grad()
    def restore_progress(self, swarm: RoundSwarm, progress: Sequence[torch.Tensor]) -> None:
        """After a state download: ``parameters = downloaded anchor + progress``."""
        for p, a, d in zip(swarm.parameters, swarm.anchors, progress, strict=True):
            p.copy_(a.to(device=p.device, dtype=p.dtype) + d)
        self.swarm_writes += 1

    def reanchor(self, swarm: RoundSwarm) -> None:
        """The current parameters become the anchor: no pending progress (after a checkpoint was loaded, or once
        this peer's progress reached the swarm in a round it could not apply)."""
        swarm.reanchor()
        self.pending_samples = 0
        self._forget_delivered(swarm, applied=False)

    def round_metadata(self, swarm: RoundSwarm) -> dict[str, Any]:
        """What this peer tells its group when matchmaking: its epoch, its anchor's fingerprint and how many peers it
        counts (every member judges the quorum on the members' counts: :func:`collabopt.engine.protocol.quorum_count`).
        """
        return {**anchor_metadata(swarm.local_epoch, swarm.anchors), "peers": max(1, int(swarm.num_peers))}

    # ------------------------------------------------------------------ the round

    def run_round(self, swarm: RoundSwarm) -> RoundOutcome:
        """Average the pseudo-gradients with the swarm and take the outer step, or keep the local progress for the
        next round (see the module docstring). Returns what happened; ``swarm.outer_step()`` moved the epoch."""
        num_peers, epoch = max(1, int(swarm.num_peers)), int(swarm.local_epoch)
        weight = self._contribute(swarm)
        if num_peers == 1:
            swarm.skip_averaging()
            outcome = self._judge(swarm, epoch, num_peers, weight, {}, None).outcome
            if not outcome.applied:
                return self._finish(outcome)
        else:
            metadata = self.round_metadata(swarm)
            try:
                report: Any = swarm.average(weight)
            except Exception as e:
                report = e
            decision = self._judge(swarm, epoch, num_peers, weight, metadata, report)
            if decision.may_have_delivered:
                self._may_have_delivered([p.detach().clone() for p in swarm.parameters], weight, epoch)
            if not decision.outcome.applied:  # (its progress, pseudo-gradient included, stays for its next round)
                return self._finish(decision.outcome)
            outcome = decision.outcome
        swarm.outer_step()
        self.pending_samples = 0
        self.rounds_applied += 1
        self.swarm_writes += 1
        return self._finish(outcome)

    # ---- overlap: the all-reduce runs while inner steps go on, its result is applied when it arrives

    def start_round(self, swarm: RoundSwarm) -> float:
        """Overlap mode: write this peer's pseudo-gradient for an all-reduce that runs in the background, and
        remember the parameters it was taken from; returns this peer's weight. :meth:`land_round` applies the
        result."""
        weight = self._contribute(swarm)
        self.pending = PendingRound(weight=weight, num_peers=max(1, int(swarm.num_peers)),
                                    metadata=self.round_metadata(swarm),
                                    base=[p.detach().clone() for p in swarm.parameters])
        self.pending_samples = 0  # the samples from now on count toward the next round
        return weight

    @torch.no_grad()
    def land_round(self, swarm: RoundSwarm, result: protocol.DiLoCoRoundEvidence | BaseException) -> RoundOutcome:
        """Overlap mode: the background all-reduce ended (``result``: what it left, as ``swarm.average`` returns it,
        or what it raised).
        If sound, the outer step moves the anchor and ``parameters = new anchor + progress made meanwhile``;
        otherwise the pseudo-gradient is kept for the next round (the anchor stays, the progress too)."""
        pending, self.pending = self.pending, None
        assert pending is not None, "no round in flight"
        # (not applied: the epoch moved on when the round started, so it cannot tell whether the others applied the
        # round: it downloads the state of the best peer, keeping its progress, pseudo-gradient included)
        decision = self._judge(swarm, int(pending.metadata.get("epoch", -1)), pending.num_peers, pending.weight,
                               pending.metadata, result, overlapped=True)
        if not decision.outcome.applied:
            self.pending_samples += int(pending.weight)
            if decision.may_have_delivered:
                self._may_have_delivered(pending.base, pending.weight, int(pending.metadata.get("epoch", -1)))
            return self._finish(decision.outcome)
        progress = progress_from(swarm.parameters, pending.base)
        swarm.outer_step(increment_epoch=False)
        for p, d in zip(swarm.parameters, progress, strict=True):
            p.add_(d)
        self.rounds_applied += 1
        self.swarm_writes += 1
        return self._finish(decision.outcome)

    # ---- parts of a round

    def _contribute(self, swarm: RoundSwarm) -> float:
        """Write this peer's pseudo-gradient into the swarm's buffers; return its weight (0: refused, non-finite)."""
        # (a round since a partial one, not told: taken as not applied, what it sends is what counts from now on)
        self._forget_delivered(swarm, applied=False)
        with swarm.buffers() as buffers:
            finite = write_pseudo_gradients(swarm.anchors, swarm.parameters, buffers)
            if not finite:
                for b in buffers:
                    b.zero_()  # weight 0 alone does not keep NaN out of a weighted sum (0 * NaN = NaN)
        if not finite:
            self.restart_from_last_round(swarm)
        return float(self.pending_samples) if finite else 0.0

    def _judge(self, swarm: RoundSwarm, epoch: int, num_peers: int, weight: float, metadata: dict[str, Any],
               report: protocol.DiLoCoRoundEvidence | BaseException | None,
               overlapped: bool = False) -> protocol.DiLoCoDecision:
        """The round's decision (:func:`collabopt.engine.protocol.diloco_round`) on what it left: what the
        all-reduce reported (None: no all-reduce ran) or what it raised, and whether its average is finite."""
        if isinstance(report, BaseException):
            report = protocol.DiLoCoRoundEvidence(epoch, num_peers, weight, error=repr(report))
        report = report or protocol.DiLoCoRoundEvidence(epoch, num_peers, weight)
        average_finite = True
        if report.group is not None and not report.error:
            with swarm.buffers() as buffers:
                average_finite = all_finite(buffers)
        decision = protocol.diloco_round(dataclasses.replace(
            report, epoch=epoch, num_peers=num_peers, weight=weight, sent=metadata,
            me=getattr(swarm, "peer_id", None), average_finite=average_finite, needs_sync=self.needs_sync,
            overlapped=overlapped))
        self.needs_sync = decision.needs_sync
        if decision.nonfinite_average and self.guard is not None:
            self.guard.note_refusal("refused_updates", "rounds with a non-finite average pseudo-gradient "
                                    "were not applied")
        return decision

    def _may_have_delivered(self, base: list[torch.Tensor], weight: float, epoch: int) -> None:
        """A partial round: this peer's pseudo-gradient (taken from ``base``, weighing ``weight``) may have
        reached its group, which may have applied the round. It contributes nothing more until it knows: it downloads
        the swarm's state before its next round, and :meth:`restore_after_download` keeps only the progress made
        since ``base`` if the swarm's anchor moved (the round was applied), all of it otherwise (compressed rounds
        hold their error feedback's update until then). Contributing its pseudo-gradient again (in a retried round)
        would count it twice."""
        self.delivered, self._undecided = (base, weight, epoch), 0
        self.needs_sync = True  # (the protocol decided so too)
        logger.warning("collabopt: this DiLoCo round is not applied here, but its pseudo-gradient may have reached "
                       "the others: this peer downloads the swarm's state before its next round (if the others "
                       "applied the round, it keeps only its progress made since)")

    @torch.no_grad()
    def progress_to_keep(self, swarm: RoundSwarm) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Before a state download: this peer's progress since its anchor and, after a partial round, its
        progress since that round's pseudo-gradient was taken (else ``None``)."""
        since = progress_from(swarm.parameters, self.delivered[0]) if self.delivered is not None else None
        return self.local_progress(swarm), since

    def restore_after_download(self, swarm: RoundSwarm, progress: Sequence[torch.Tensor],
                               since: Sequence[torch.Tensor] | None, downloaded: bool, anchor_moved: bool) -> bool:
        """After a state download (``downloaded``: it succeeded; ``anchor_moved``: the swarm's anchor is not the
        one this peer held): parameters = anchor + the progress :meth:`progress_to_keep` returned, ``since`` if a
        round this peer's pseudo-gradient may have reached was applied meanwhile. Returns whether it downloads again
        before its next round. Once it knows, the rounds' state that waited for it follows (``swarm.settle_delivered``:
        with ``pseudo_gradient_compression``, the error feedback keeps that round's remainder only if it was applied).

        Only a state of a later epoch than that round's tells: a peer still at the round's epoch may be about to
        apply it (its outer step comes after its all-reduce). After a download that does not tell (or fails) this
        peer keeps all its progress, still remembers the round and downloads again before its next round, up to
        :data:`UNDECIDED_DOWNLOADS` times; then the round is taken as not applied (no peer served a later epoch)."""
        tells = self.delivered is not None and downloaded and int(swarm.local_epoch) > self.delivered[2]
        applied = since is not None and tells and anchor_moved
        if applied:
            self.restore_progress(swarm, since)
            self.pending_samples = max(0, self.pending_samples - int(self.delivered[1]))
        else:
            self.restore_progress(swarm, progress)
        if tells:
            self._forget_delivered(swarm, applied)
        elif self.delivered is not None:
            self._undecided += 1
            if self._undecided < UNDECIDED_DOWNLOADS:
                logger.info("collabopt: the download (%s) does not tell whether the others applied the round this "
                            "peer lost results of (epoch %d): downloading again",
                            "of that epoch" if downloaded else "failed", self.delivered[2])
                return True
            logger.info("collabopt: %d downloads did not tell whether the others applied the round of epoch %d this "
                        "peer lost results of: taken as not applied, its progress kept whole", self._undecided,
                        self.delivered[2])
            self._forget_delivered(swarm, applied=False)
        return False

    def _forget_delivered(self, swarm: RoundSwarm, applied: bool) -> None:
        """The partial round (:meth:`_may_have_delivered`) is decided, or taken as not applied (``applied``: by
        the others); the swarm's rounds settle what waited for it (``settle_delivered``, where the swarm has it)."""
        self.delivered, self._undecided = None, 0
        settle = getattr(swarm, "settle_delivered", None)
        if settle is not None:
            settle(applied)

    def _finish(self, outcome: RoundOutcome) -> RoundOutcome:
        if not outcome.applied:
            self.rounds_failed += 1
            logger.warning("collabopt: DiLoCo round not applied (%s); %s", outcome.detail or outcome.reason, _KEPT.get(
                outcome.reason, "keeping this peer's progress for the next round"))
        self.last_round = outcome
        return outcome

    @torch.no_grad()
    def restart_from_last_round(self, swarm: RoundSwarm) -> None:
        """This peer's parameters are not finite (a NaN/inf inner step): nothing of its progress since the last round
        is contributed, and it restarts from the parameters that round left (the anchor; with a round in flight, the
        parameters that round started from). The inner optimizer's statistics that turned non-finite are reset (the
        optimizer starts them afresh for those parameters)."""
        restart = self.pending.base if self.pending is not None else swarm.anchors
        for p, r in zip(swarm.parameters, restart, strict=True):
            p.copy_(r.to(device=p.device, dtype=p.dtype))
        for param, state in list(self.inner.state.items()):
            if not all_finite([v for v in state.values() if torch.is_tensor(v) and v.is_floating_point()]):
                del self.inner.state[param]
        self.samples_discarded += self.pending_samples
        self.pending_samples = 0
        self._forget_delivered(swarm, applied=False)
        self.swarm_writes += 1
        if self.guard is not None:
            self.guard.note_refusal("refused_steps", "inner steps made the parameters non-finite: the peer restarted "
                                    "from the last round's parameters, contributing nothing of them")


UNDECIDED_DOWNLOADS = 3  # downloads of a partial round's own epoch before it counts as not applied


@torch.no_grad()
def progress_from(parameters: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters - reference``, tensor by tensor (``reference`` brought to each parameter's device and dtype)."""
    return [p.detach() - r.to(device=p.device, dtype=p.dtype) for p, r in zip(parameters, reference, strict=True)]


@torch.no_grad()
def write_pseudo_gradients(anchors: Sequence[torch.Tensor], parameters: Sequence[torch.Tensor],
                           out: Sequence[torch.Tensor]) -> bool:
    """``out = anchors - parameters`` (in ``out``'s dtype and device); return whether all of it is finite."""
    for a, p, o in zip(anchors, parameters, out, strict=True):
        torch.sub(a.to(o.device, o.dtype), p.detach().to(o.device, o.dtype), out=o)
    return all_finite(out)


__all__ = ["DiLoCo", "INCOMPATIBLE", "INCOMPATIBLE_HIVEMIND", "MAX_REPORT_PERIOD", "OUTER_EXAMPLE", "PendingRound",
           "REPORT_SHARE",
           "RoundOutcome", "RoundSwarm", "UNDECIDED_DOWNLOADS", "agrees_with_group", "check_config",
           "check_outer_optimizer", "fingerprint", "progress_from", "report_period", "same_fingerprint",
           "should_download", "step_decision", "write_pseudo_gradients"]
