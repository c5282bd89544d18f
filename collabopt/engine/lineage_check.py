"""The lineage check of the synchronous mode, carried out: after a gradient round, a member whose parameters are not
its group's canonical ones (:func:`collabopt.lineage.judge`, decided in :func:`collabopt.engine.protocol.sync_round`)
skips that boundary's parameter averaging and re-synchronizes.

Why it exists and what it caught: docs/decisions.md, "The lineage check".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from hivemind.utils import get_dht_time

from collabopt import lineage
from collabopt.engine import protocol, protocol_download

logger = logging.getLogger(__name__)


# The lineage check: a gradient round keeps in sync only peers that already held the same parameters, so every member
# tells it its epoch and parameters' fingerprint, and a peer off the round's canonical lineage skips that boundary's
# parameter averaging and downloads the canonical state. Off with delay_* (parameters at scheduling time are not the
# epoch's) and in DiLoCo mode (which checks its anchors). See docs/decisions.md, "The lineage check".
CHECK_LINEAGE = True
RESYNC_RETRY = 1.0  # seconds between downloads while the canonical peers have not served the new state yet


@dataclasses.dataclass
class Resync:
    """A pending re-synchronization: download the state of one of ``peers`` (base58 peer ids) until ``until``."""

    peers: list[str]
    epoch: int
    until: float
    next_try: float = 0.0


@dataclasses.dataclass
class SyncState:
    """collabopt's state of a synchronous peer's rounds (``SyncLoop.sync_state``)."""

    checks_lineage: bool = False  # this peer takes part in the lineage check (:func:`takes_part_in_lineage_check`)
    apart: bool = False  # its last gradient round was partial: its parameters are its own
    resync: Resync | None = None  # a re-synchronization it owes (the lineage check found it on another lineage)
    before_averaging: Callable[[], None] | None = None  # the core's last look at the accumulation at a boundary
    parameter_round_due: bool = False  # the boundary being stepped runs a parameter round (set by end_epoch)


def takes_part_in_lineage_check(optimizer: Any) -> bool:
    """Whether ``optimizer`` (a :class:`~collabopt.engine.sync_round.SyncLoop`) takes part in the lineage check (see
    above): its gradient rounds then gather :func:`lineage_metadata`."""
    return (CHECK_LINEAGE and optimizer.use_gradient_averaging and not optimizer.auxiliary
            and not optimizer.delay_optimizer_step and not optimizer.delay_grad_averaging
            and not optimizer.delay_state_averaging)


def lineage_metadata(optimizer: Any) -> dict[str, Any]:
    return {"epoch": int(optimizer.local_epoch), "serves": not optimizer.client_mode,
            "apart": bool(optimizer.sync_state.apart),
            "lineage": lineage.fingerprint(optimizer.state_averager.main_parameters)}


def vote_for_parameters(optimizer: Any) -> None:
    """At the end of a boundary whose parameters are final (no parameter round goes on in the background), where
    downloads are verified (:mod:`collabopt.engine.download_votes`): vote for the state this peer serves now. (The
    lineage metadata computes its own: a cached one went stale where a parameter round wrote the parameters from
    the averager's process, which bumps no version counter of this one.)"""
    votes = optimizer.state_averager.votes
    if votes is None or not optimizer.sync_state.checks_lineage:
        return
    value = lineage.fingerprint(optimizer.state_averager.main_parameters)
    if lineage.valid_fingerprint(value):  # (non-finite parameters: no vote)
        votes.vote(int(optimizer.local_epoch), value)


def out_of_sync(optimizer: Any) -> bool:
    """Whether ``optimizer`` knows its parameters differ from its swarm's: its last gradient round was partial, or
    a round found it on another lineage and its re-synchronization is pending."""
    apart = bool(optimizer.sync_state.apart)
    return apart or optimizer.sync_state.resync is not None


def hint_state_group(optimizer: Any, control: Any) -> None:
    """After a boundary's gradient round (``control``): if every peer present in the swarm (:func:`present_peers`)
    was in it, tell the state averager to expect that many peers in the parameter averaging that follows (see
    ``ParameterRounds.group_size``), counting only its members at this peer's epoch (the others download: a hint
    of 1 means no parameter round, :func:`~collabopt.engine.protocol.averages_parameters`); otherwise (a failed round,
    groups split under load) no hint, since one too small makes a peer that finds the group full wait until
    ``averaging_timeout``. See
    docs/decisions.md, "Group size hint"."""
    hint = None  # (a delayed gradient round ends after the state round's matchmaking began: no hint)
    group = None if optimizer.delay_grad_averaging else finished_group(control)
    if isinstance(group, dict) and len(group) >= max(2, present_peers(optimizer)):
        hint = (optimizer.local_epoch, protocol.parameter_round_peers(group, optimizer.local_epoch))
    optimizer.state_averager.group_size_hint = hint


def present_peers(optimizer: Any) -> int:
    """The peers of the tracker's last fetch whose record is at most a round (``matchmaking_time`` and
    ``averaging_timeout``) older than a stepping peer's can be: a peer in a round stores no record, but one that
    stopped reporting for longer (killed) will not come to this boundary's parameter round, though its record stays
    until it expires (60 s). A shorter window left peers in a long all-reduce out (B6's WAN bed: 20 s rounds)."""
    tracker = optimizer.tracker
    round_time = optimizer.matchmaking_time + optimizer.averaging_timeout
    recent = get_dht_time() - round_time - tracker.extrapolation_limit()
    return sum(time >= recent for time in tracker.record_times)


def finished_group(control: Any) -> Any:
    """What a gradient round (a StepControl) gathered from its group, or None if it did not finish successfully."""
    if control is None or not control.done() or control.cancelled() or control.exception() is not None:
        return None
    return control.result()


def follow_round_decision(optimizer: Any, decision: Any) -> None:
    """Carry out what the protocol decided of a gradient round (:func:`collabopt.engine.protocol.sync_round`, a
    :class:`~collabopt.engine.protocol.SyncDecision`): a peer that holds its group's lineage is no longer apart; one
    that does not plans a download from a peer that holds it (and serves its own state below theirs), after this
    step or, behind its group, instead of it (the loop downloads at once); one whose round was partial is apart
    until a round or a download says otherwise."""
    if decision.holds:
        optimizer.sync_state.apart = False
    if decision.resync_from is not None:
        if decision.steps:  # (else the loop says it, as it downloads instead of stepping)
            logging.getLogger(__name__).warning("collabopt: %s: it downloads their state after this step",
                                                decision.outcome.detail)
        optimizer.sync_state.resync = Resync(peers=[str(peer) for peer in decision.resync_from],
                                             epoch=decision.my_epoch,
                                             until=time.monotonic() + optimizer.averaging_timeout)
        serve_below_the_others(optimizer)  # (and no parameter round at this boundary: it would mix the lineages)
    if decision.partial:  # (a pending download clears it when it brings a state)
        optimizer.sync_state.apart = True
        serve_below_the_others(optimizer)  # others' downloads should not fetch parameters only this peer holds
        logging.getLogger(__name__).warning(
            "collabopt: %.1f%% of this peer's gradient round at epoch %d arrived (it stepped with its own gradients): "
            "its parameters now differ from its group's; its next gradient round re-synchronizes it",
            100 * decision.received, decision.my_epoch)


def serve_below_the_others(optimizer: Any) -> None:
    """Others' downloads prefer peers of higher priority: serve this peer's state (of the other lineage) below
    theirs at the same epoch."""
    if not optimizer.client_mode:
        optimizer.state_averager.state_sharing_priority = optimizer.local_epoch - 0.5


def resync_outcome(optimizer: Any, resync: Resync | None, apart: bool, before: list[float]) -> None:
    """After a download: what it ends of a pending re-sync (``resync``) and of this peer's being ``apart``, decided by
    :func:`collabopt.engine.protocol_download.resync_after_download` from whether the parameters moved away from
    their fingerprint ``before`` it; a re-sync is done, given up, or tried again at a later step (the group's peers
    had not served the boundary's state yet)."""
    logger = logging.getLogger(__name__)
    moved = bool(before) and not lineage.same_fingerprint(
        before, lineage.fingerprint(optimizer.state_averager.main_parameters))
    left = resync.until - time.monotonic() if resync is not None else 0.0
    decision = protocol_download.resync_after_download(protocol_download.ResyncEvidence(
        resyncing=resync is not None, apart=apart, moved=moved, time_left=left))
    optimizer.sync_state.apart = decision.apart
    if decision.resync == "done":
        logger.log(optimizer.status_loglevel, "collabopt: re-synchronized with its gradient round's parameters "
                   "(epoch %d)", optimizer.local_epoch)
        optimizer.sync_state.resync = None
    elif decision.resync == "give up":
        logger.warning("collabopt: no peer of the other lineage served its state within %.0f s; this peer goes on "
                       "with its own parameters (the next gradient round checks again)", optimizer.averaging_timeout)
        optimizer.sync_state.resync = None
    elif decision.resync == "retry":
        assert resync is not None
        resync.next_try = time.monotonic() + RESYNC_RETRY
        serve_below_the_others(optimizer)
