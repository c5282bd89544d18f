"""The protocol, decided in one place: what a round's evidence means, and whether a local step counts.

Every decision of both modes is a pure function here: it takes what a peer saw (frozen dataclasses) and returns what
happened and what to do next. The rest of the engine gathers the evidence and executes the decision; the adapters,
``StepResult``, the metrics record and the status page read the :class:`~collabopt.interface.RoundOutcome` it made.

- a local step: :func:`sync_step` / :func:`diloco_step` (download the swarm's state first, and why), then
  :func:`step_accepted` (whether the step's samples count);
- a synchronous boundary: :func:`sync_boundary` (a peer behind the swarm downloads instead), then
  :func:`sync_round` (the gradient round's group, the lineage check, the share of the average that arrived, whether
  the optimizer steps), :func:`boundary_accepted` (whether the boundary step's samples count), and within the round
  :func:`sync_admits` (who joins a group it leads), :func:`sync_contributes` (a member's epoch) and
  :func:`sync_gradients` (whether the average is used);
- a synchronous parameter round: :func:`parameter_round` (whether its average replaces this peer's parameters);
- a synchronous download (the one re-sync path): whether the peer is current, downloads again or goes on, and what it
  ends of a pending re-sync (:mod:`collabopt.engine.protocol_download`);
- a DiLoCo round: :func:`diloco_round` (quorum, one anchor, a finite average, a partial all-reduce; in
  :mod:`collabopt.engine.protocol_diloco`);
- the core's non-finite guard amends either outcome: :func:`guard_amended`.

    >>> sync_round(SyncRoundEvidence(epoch=4, num_peers=3)).outcome.reason
    'no group'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from collabopt import lineage
from collabopt.engine.protocol_diloco import (
    DiLoCoDecision,
    DiLoCoRoundEvidence,
    diloco_contributes,
    diloco_round,
    quorum_count,
)
from collabopt.interface import RoundOutcome

# a gradient round's reasons after which this peer averages no parameters at its boundary (they would mix lineages)
REFUSING_REASONS = ("apart", "behind")

# why a local step downloads the swarm's state first (StepDecision.reason)
DOWNLOAD_REASONS = (
    "re-sync due",  # a round found this peer's parameters (sync) or anchor (DiLoCo) apart from its group's
    "joined round ended alone",  # sync, delay_grad_averaging: the round under way it joined found no group
    "swarm at another epoch",  # sync: the epoch's first fresh view of the swarm shows another epoch
    "behind",  # the swarm is two or more epochs ahead (its gradients, parameters or anchor are stale)
    "one epoch behind",  # DiLoCo: an anchor one round old is stale (unless it joins the round under way)
)


@dataclass(frozen=True)
class SwarmView:
    """The epoch and progress this peer sees: its own epoch, the swarm's (the tracker's) and the swarm's size."""

    local_epoch: int
    swarm_epoch: int
    num_peers: int = 1


@dataclass(frozen=True)
class StepDecision:
    """Whether a local step downloads the swarm's state before it counts, and why (:data:`DOWNLOAD_REASONS`);
    ``keeps_progress``: the download keeps this step's progress (DiLoCo: the inner step is applied, and put back on
    the downloaded anchor), else the step's gradients are dropped; ``joined_epoch`` and ``view_checked``: the
    synchronous peer's state after this step (see :class:`SyncStepEvidence`)."""

    download: bool
    reason: str = ""
    keeps_progress: bool = False
    joined_epoch: int | None = None
    view_checked: bool = False


@dataclass(frozen=True)
class SyncStepEvidence:
    """What a synchronous peer knows at a local step: its epoch and the swarm's (``view``); ``resync_due``: a
    re-synchronization the lineage check planned is pending and its next try is due; ``fresh_view``: the tracker
    fetched the swarm's progress since its last boundary and no step of this epoch looked at such a view yet (the
    exact check is due); ``joined_epoch``: the epoch of the round under way it joined (``delay_grad_averaging``);
    ``last_round``: its last round's outcome; ``accumulated_toward_round``: ``delay_grad_averaging``, and it
    accumulated samples toward the epoch."""

    view: SwarmView
    resync_due: bool = False
    fresh_view: bool = False
    joined_epoch: int | None = None
    last_round: RoundOutcome | None = None
    accumulated_toward_round: bool = False


def _download(reason: str, **state: Any) -> StepDecision:
    return StepDecision(True, reason, **state)


def sync_step(e: SyncStepEvidence) -> StepDecision:
    """A synchronous peer downloads before its step when a re-synchronization is due; when the round under way it
    joined ended without a group (it stepped apart); at an epoch's first fresh view, when the swarm is at another
    epoch, unless it joins the round under way (``delay_grad_averaging``: the others announce the next epoch as they
    *start* the round, and a peer one epoch behind that accumulated toward it joins their group, its samples counted
    there); and at any step, when the swarm is two or more epochs ahead."""
    local, swarm = e.view.local_epoch, e.view.swarm_epoch
    if e.resync_due:  # this step's gradients came from the other lineage: start over after the download
        return _download("re-sync due", joined_epoch=e.joined_epoch)
    joined, last = e.joined_epoch, e.last_round
    if joined is not None and last is not None and last.epoch == joined:
        joined = None  # the round it joined has ended: if its group had gone, it steps apart
        if last.reason in ("no group", "alone"):
            return _download("joined round ended alone")
    if e.fresh_view:
        if local == swarm:
            return StepDecision(False, joined_epoch=joined, view_checked=True)
        if e.accumulated_toward_round and swarm == local + 1:
            return StepDecision(False, joined_epoch=local, view_checked=True)
        return _download("swarm at another epoch", joined_epoch=joined, view_checked=True)
    if local < swarm - 1:
        return _download("behind", joined_epoch=joined)
    return StepDecision(False, joined_epoch=joined)


@dataclass(frozen=True)
class DiLoCoStepEvidence:
    """What a DiLoCo peer knows at a local step: the epochs, whether a round left it owing a download
    (``needs_sync``), whether its rounds overlap, and whether it trained since its last round."""

    view: SwarmView
    needs_sync: bool = False
    overlap: bool = False
    trained: bool = False


def diloco_step(e: DiLoCoStepEvidence) -> StepDecision:
    """A DiLoCo peer downloads before its next step when its anchor disagreed with its group's (or a round left it
    not knowing whether the others applied it), or when the swarm is past its epoch (an anchor one round old is
    stale). With ``overlap_rounds`` the others' epoch moves when they *start* a round: a peer one epoch behind that
    trained toward that round starts it too (and joins their group) instead; if it missed the round, its own one
    fails and it downloads then. Its progress survives the download."""
    behind = e.view.swarm_epoch - e.view.local_epoch
    if e.needs_sync:
        return _download("re-sync due", keeps_progress=True)
    if behind > 1:
        return _download("behind", keeps_progress=True)
    if behind == 1 and not (e.overlap and e.trained):
        return _download("one epoch behind", keeps_progress=True)
    return StepDecision(False, keeps_progress=True)


def step_accepted(decision: StepDecision, behind_after: bool) -> bool:
    """Whether a training step's samples count (in ``samples_reported``): yes unless it downloaded first; then only
    where the download kept its progress (DiLoCo) and brought the swarm's epoch (``behind_after``: still behind,
    nobody served its state; the core counts such steps toward giving up on the download)."""
    return not decision.download or (decision.keeps_progress and not behind_after)


# ---------------------------------------------------------------------------------------- the synchronous round


def sync_boundary(view: SwarmView, joins_round_ahead: bool = False) -> RoundOutcome | None:
    """A boundary behind the swarm runs no round: the peers ahead ended this epoch's round without this peer, so its
    gradients reach nobody and stepping with them alone would split it from the swarm; it downloads (None: the round
    runs). ``joins_round_ahead`` (``delay_grad_averaging``: the others announce the next epoch as they start the
    round): one epoch behind still joins their round. See docs/decisions.md, "A peer behind at its boundary
    downloads"."""
    if view.local_epoch < view.swarm_epoch - (1 if joins_round_ahead else 0):
        return RoundOutcome(False, "behind", num_peers=view.num_peers, resync=True, epoch=view.local_epoch)
    return None


@dataclass(frozen=True)
class SyncRoundEvidence:
    """What a synchronous boundary's gradient round left: the boundary's ``epoch`` and the swarm's size this peer
    counted; ``group``: what each member gathered (``{peer: metadata}``: its epoch, and with the lineage check its
    fingerprint, whether it serves and is apart; this peer's own entry has the share of the average that arrived,
    ``received``, where below 1); None: no round, or it failed; ``me``: this peer's id in ``group``;
    ``checks_lineage``: its group's lineage is judged (:mod:`collabopt.lineage`); ``resync_pending``: a
    re-synchronization is pending already (not judged again); ``averages_gradients``: False with
    ``use_local_updates``; ``step_pending``: this peer's optimizer step of the boundary is still to come, and is its
    own (False: ``delay_grad_averaging``, whose round ends in the background after the step, and an auxiliary peer,
    which steps nothing)."""

    epoch: int
    num_peers: int
    group: Mapping[Hashable, Any] | None = None
    me: Hashable = None
    checks_lineage: bool = False
    resync_pending: bool = False
    averages_gradients: bool = True
    step_pending: bool = True


@dataclass(frozen=True)
class SyncDecision:
    """A synchronous boundary's ``outcome`` and what this peer does next: ``resync_from``: download the state of one
    of these peers (None: none; where it steps, after this step); ``download_epoch``: None, the optimizer steps (its
    outcome applied); else it keeps its parameters and epoch and downloads, within this boundary, the state of this
    epoch: the one its peers to follow step to; ``holds``: it holds its group's lineage again; ``received``: the
    share of the average that arrived (below 1: it is apart); ``my_epoch``: the epoch it told its group."""

    outcome: RoundOutcome
    resync_from: tuple[Hashable, ...] | None = None
    holds: bool = False
    received: float = 1.0
    my_epoch: int = -1
    download_epoch: int | None = None

    @property
    def steps(self) -> bool:
        return self.download_epoch is None

    @property
    def partial(self) -> bool:
        return self.received < 1.0

    @property
    def averages_parameters(self) -> bool:  # (not across lineages)
        return averages_parameters(self.outcome)


def averages_parameters(outcome: RoundOutcome | None, peers_expected: int | None = None) -> bool:
    """After a gradient round with this ``outcome`` (None: it ends in the background), may parameters be averaged?
    Not where the round showed this peer alone at its epoch (``peers_expected`` 1, :func:`parameter_round_peers`):
    its other members download instead, and a parameter round would wait ``averaging_timeout`` for a group that
    never comes."""
    return (outcome is None or outcome.reason not in REFUSING_REASONS) and peers_expected != 1


def parameter_round_peers(gathered: Mapping[Hashable, Any], epoch: int) -> int:
    """How many members of a gradient round's group (``gathered``) come to the parameter round after it, for a member
    at ``epoch``: those at that epoch whose lineage verdict (the same on every member) does not send them to a
    download, and those of no known epoch. The others are behind or apart (:func:`sync_round`) and skip it. (A member
    with a re-synchronization pending is not judged again and does come: one the count may miss.)"""
    def comes(peer: Hashable, metadata: Any) -> bool:
        if not isinstance(metadata, Mapping) or type(metadata.get("epoch")) is not int:
            return True
        verdict = lineage.judge(gathered, peer) if metadata["epoch"] == epoch else None
        return metadata["epoch"] == epoch and (verdict is None or verdict.reason == "holds")

    return sum(1 for peer, metadata in gathered.items() if comes(peer, metadata))


def group_epoch(gathered: Mapping[Hashable, Any]) -> int | None:
    """The epoch most members of a gradient round's group gathered (ties: the newest; None: none gathered one)."""
    epochs = [m["epoch"] for m in gathered.values() if isinstance(m, Mapping) and type(m.get("epoch")) is int]
    return max(epochs, key=lambda epoch: (epochs.count(epoch), epoch), default=None)


def sync_contributes(mine: Mapping[str, Any], gathered: Mapping[Hashable, Any]) -> bool:
    """Whether a member's gradients count in its round: only at its group's epoch (a stale joiner's: weight 0)."""
    epoch, own = group_epoch(gathered), mine.get("epoch") if isinstance(mine, Mapping) else None
    return epoch is None or type(own) is not int or own == epoch


def sync_admits(mine: Mapping[str, Any], theirs: Any) -> bool:
    """Whether a round this peer leads takes a peer that asks to join: not one at a later epoch. A leader behind it
    searches on a schedule of its own (its round was scheduled before it fell behind, e.g. while its link was
    down), so it takes the current round's peers before they find each other, into a group whose gradients it
    cannot use; the rest of their round waits out its timeout alone. A peer behind the leader is taken: it learns
    from its group that it is behind (:func:`sync_round`)."""
    own = mine.get("epoch") if isinstance(mine, Mapping) else None
    other = theirs.get("epoch") if isinstance(theirs, Mapping) else None
    return type(own) is not int or type(other) is not int or other <= own


def sync_gradients(received: float) -> bool:
    """Whether the average replaces this peer's own gradients: only whole (else it steps with its own, apart)."""
    return received >= 1.0


def sync_round(e: SyncRoundEvidence) -> SyncDecision:
    """The one verdict of a synchronous boundary: the epoch's update is applied (the group's whole average, else
    this peer's own gradients: ``"alone"``, ``"no group"``, ``"partial"``: apart). A member whose epoch is not its
    group's (its gradients were left out) or, with the lineage check (:func:`collabopt.lineage.judge`), whose
    parameters are not the group's plans a download (``"behind"``/``"apart"``: no parameter averaging at this
    boundary). A member behind its group, whose step is still to come (``step_pending``), does not step: the average
    it received is the group's update of a later epoch, and its own would put parameters of its own at the next
    epoch; it keeps its epoch and downloads now (``download_epoch`` set, ``steps`` False, not applied). See
    docs/decisions.md, "The lineage check" and "A peer behind its gradient round does not step"."""
    if not e.averages_gradients:  # use_local_updates: parameters are averaged, gradients never
        return SyncDecision(RoundOutcome(True, "averaged" if e.num_peers > 1 else "alone", num_peers=e.num_peers,
                                         epoch=e.epoch))
    group = e.group if isinstance(e.group, Mapping) else None
    mine = group.get(e.me) if group is not None else None
    decision = SyncDecision(RoundOutcome(True, "averaged"))
    if isinstance(mine, dict) and type(mine.get("epoch")) is int:  # (no lineage check: the share received only)
        decision = _judge_lineage(group, e.me, mine, e.resync_pending or not e.checks_lineage)
        if decision.resync_from is None and not sync_contributes(mine, group):  # its gradients were left out
            epoch, behind = group_epoch(group), mine["epoch"] < group_epoch(group)
            decision = SyncDecision(RoundOutcome(True, "behind" if behind else "apart", detail=(
                f"this peer is at epoch {mine['epoch']}, its gradient round at {epoch}: its gradients were left out")),
                tuple(p for p, m in group.items() if isinstance(m, dict) and m.get("epoch") == epoch) if behind
                else None, my_epoch=mine["epoch"])
    if group is None or len(group) < 2:
        outcome = RoundOutcome(True, "alone" if e.num_peers <= 1 else "no group", num_peers=e.num_peers,
                               epoch=e.epoch)
    else:
        reason, detail = decision.outcome.reason, decision.outcome.detail
        holds_back = reason == "behind" and e.step_pending
        if holds_back:  # (the state its peers to follow step to: the newest of their epochs + 1)
            detail = f"{detail}: it does not step, and downloads the swarm's state now"
            ahead = [group[peer]["epoch"] for peer in decision.resync_from or ()]
            decision = dataclasses.replace(decision, download_epoch=max(ahead, default=e.epoch) + 1)
        outcome = RoundOutcome(not holds_back, reason, len(group), num_peers=e.num_peers,
                               resync=reason != "averaged", epoch=e.epoch, detail=detail)
    return dataclasses.replace(decision, outcome=outcome)


def boundary_accepted(outcome: RoundOutcome | None) -> bool:
    """Whether the samples of the step that ended a synchronous boundary count (in ``samples_reported``): not where
    the boundary applied no update (``"behind"``: it downloaded the swarm's state instead, and its gradients were in
    no average); None (its round ends in the background) counts."""
    return outcome is None or outcome.applied


def _judge_lineage(group: Mapping[Hashable, Any], me: Hashable, mine: dict, resync_pending: bool) -> SyncDecision:
    """The lineage check's part of :func:`sync_round` (the outcome's reason and detail only)."""
    epoch = mine["epoch"]
    reason, detail, resync_from, holds = "averaged", "", None, False
    verdict = lineage.judge(group, me) if not resync_pending else None
    if verdict is not None and verdict.reason == "holds":
        holds = True
    elif verdict is not None:
        detail = lineage.verdict_text(verdict, group, epoch)
        reason = "behind" if verdict.reason == "behind" else "apart"
        resync_from = tuple(verdict.peers)
    received = mine.get("received", 1.0)
    received = received if isinstance(received, float) and received < 1.0 else 1.0
    if received < 1.0 and reason == "averaged":
        reason, detail = "partial", f"{100 * received:.1f}% of the average arrived"
    return SyncDecision(RoundOutcome(True, reason, detail=detail), resync_from, holds, received, epoch)


# --------------------------------------------------------------------------------------- the parameter round


@dataclass(frozen=True)
class ParameterRoundEvidence:
    """What a parameter round left on this peer: ``error`` (why no average came; empty: it came), the
    ``group_size``, whether this peer's values are in it (``contributed``: its epoch is its group's, weight above 0)
    and the share of the average that arrived (``received``)."""

    error: str = ""
    group_size: int = 0
    contributed: bool = True
    received: float = 1.0


@dataclass(frozen=True)
class ParameterDecision:
    """Whether the average replaces this peer's parameters (``install``), and why not (``detail``)."""

    install: bool
    detail: str = ""


def parameter_round(e: ParameterRoundEvidence) -> ParameterDecision:
    """A parameter round's average is installed only where it is whole and holds this peer's values; otherwise this
    peer keeps its own parameters (another epoch's average, or one in part, would move it away from its group)."""
    if e.error:
        return ParameterDecision(False, e.error)
    if not e.contributed:
        return ParameterDecision(False, "this peer's values are not in its group's average (another epoch, or none)")
    if e.received < 1.0:
        return ParameterDecision(False, f"{100 * e.received:.1f}% of the average arrived")
    return ParameterDecision(True)


# ------------------------------------------------------------------------------------------------ both modes


def guard_amended(outcome: RoundOutcome, gradients_refused: bool, parameters_restored: bool) -> RoundOutcome:
    """A synchronous round's outcome where the core's non-finite guard refused its average since the last one:
    averaged gradients refused (no update: not applied), or averaged parameters restored (this peer's own update is
    kept: applied). DiLoCo's rounds judge their average themselves (:func:`diloco_round`)."""
    if not (gradients_refused or parameters_restored):
        return outcome
    return dataclasses.replace(outcome, applied=outcome.applied and not gradients_refused,
                               reason="non-finite average")


__all__ = ["DOWNLOAD_REASONS", "DiLoCoDecision", "DiLoCoRoundEvidence", "DiLoCoStepEvidence", "ParameterDecision",
           "ParameterRoundEvidence", "REFUSING_REASONS", "StepDecision", "SwarmView", "SyncDecision",
           "SyncRoundEvidence", "SyncStepEvidence", "averages_parameters", "boundary_accepted", "diloco_contributes",
           "diloco_round", "diloco_step", "group_epoch", "guard_amended", "parameter_round", "parameter_round_peers",
           "quorum_count", "step_accepted", "sync_admits", "sync_boundary", "sync_contributes", "sync_gradients",
           "sync_round", "sync_step"]
