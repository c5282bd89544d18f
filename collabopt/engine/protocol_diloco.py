"""The DiLoCo round's decisions (part of :mod:`collabopt.engine.protocol`, which re-exports them): whether a round
counts, and whether a member's pseudo-gradient goes into its group's round."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from collabopt.diloco_metadata import agrees_with_group
from collabopt.interface import RoundOutcome


@dataclass(frozen=True)
class DiLoCoRoundEvidence:
    """What a DiLoCo round left on this peer.

    Attributes:
        epoch, num_peers: the round's epoch, and the swarm's size this peer counted (at the round's start).
        weight: the samples its pseudo-gradient weighs (0: refused as non-finite, or nothing trained).
        sent: the round metadata this peer sent (epoch, anchor fingerprint).
        me: its id as ``group`` names it.
        group: what each member gathered (``{peer: round metadata}``); None: no group (alone, or see ``error``).
        error: why no all-reduce ran (no group, a member refused, a timeout); empty: it ran.
        received: the share of the average whose result arrived here (see ``RoundEvidence`` in engine/allreduce.py).
        included: the share of those results that hold this peer's values (above 0: its pseudo-gradient reached them;
            0 in a whole round: the robust aggregate left it out, and it counted for no samples).
        contributed: this peer was one of its round's contributors (compressed DiLoCo's ``max_contributors``; False:
            its pseudo-gradient waits in its error feedback, sent in a later round, and its samples count).
        average_finite: the averaged pseudo-gradient is finite.
        needs_sync: a download was owed before this round.
        overlapped: the round ran in the background (``overlap_rounds``): the epoch moved on when it started.
    """

    epoch: int
    num_peers: int
    weight: float
    sent: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    me: Hashable = None
    group: Mapping[Hashable, Any] | None = None
    error: str = ""
    received: float = 1.0
    included: float = 1.0
    contributed: bool = True
    average_finite: bool = True
    needs_sync: bool = False
    overlapped: bool = False


@dataclass(frozen=True)
class DiLoCoDecision:
    """A DiLoCo round's outcome and what this peer does next: ``needs_sync``: download the swarm's state before
    its next round (keeping its progress); ``may_have_delivered``: its pseudo-gradient may have reached a group that
    applied the round (a download tells); ``nonfinite_average``: the guard counts a refused round."""

    outcome: RoundOutcome
    needs_sync: bool = False
    may_have_delivered: bool = False
    nonfinite_average: bool = False


def diloco_round(e: DiLoCoRoundEvidence) -> DiLoCoDecision:
    """A DiLoCo round is applied only if it is sound: every part of the average arrived, the group holds more than
    half of the peers its members counted (:func:`quorum_count`: no split brain), its peers held the same anchor at
    the same epoch, and the average is finite; alone, if it trained. Otherwise its progress stays for its next round,
    and it downloads the swarm's state first where the others may have applied the round: its anchor differed, part
    of the average did not arrive while results holding its pseudo-gradient did, or (overlapped) the epoch it would
    tell by moved on.

    The anchor is judged on what the group gathered from this peer (``sent`` where that is missing), as
    :func:`diloco_contributes` judged it before the all-reduce: a peer whose anchor is not the group's takes part
    with weight 0, so that a round holds only the pseudo-gradients of the members that apply it."""
    needs_sync, delivered, nonfinite = e.needs_sync, False, False
    n, weight = quorum_count(e.group, e.num_peers), e.weight
    if e.group is None and not e.error:
        outcome = (RoundOutcome(True, "alone", 1, weight, 1) if weight != 0
                   else RoundOutcome(False, "nothing to apply", weight=weight))
    elif e.error or e.received < 1.0:  # (part of the average missing: delivered where its values are in the rest)
        detail = e.error or f"{100 * e.received:.1f}% of the average arrived"
        outcome = RoundOutcome(False, "averaging failed", weight=weight, num_peers=n, detail=detail)
        delivered = not e.error and weight > 0 and e.included > 0
    else:
        group = dict(e.group or {})
        size, sent = len(group), e.sent
        if isinstance(group.get(e.me), dict) and "anchor" in group[e.me]:
            sent = group[e.me]
        if 2 * size <= n:
            outcome = RoundOutcome(False, "no quorum", size, weight, n, detail=f"{size} of {n} peers averaged")
        elif not agrees_with_group(dict(sent), list(group.values())):
            needs_sync = True
            outcome = RoundOutcome(False, "anchor differs", size, weight, n,
                                   detail="this peer's anchor differs from its group's")
        elif not e.average_finite:
            nonfinite = True
            outcome = RoundOutcome(False, "non-finite average", size, weight, n)
        elif e.included == 0:  # (applied without this peer's pseudo-gradient: the robust aggregate left it out)
            outcome = RoundOutcome(True, "averaged", size, 0.0, n,
                                   detail="the robust aggregate left this peer's pseudo-gradient out")
        elif not e.contributed:
            outcome = RoundOutcome(True, "averaged", size, weight, n, detail="not one of this round's contributors: "
                                   "its pseudo-gradient waits in its error feedback for a later round")
        else:
            outcome = RoundOutcome(True, "averaged", size, weight, n)
    if not outcome.applied and e.overlapped:  # its epoch no longer tells whether the others applied it
        needs_sync = needs_sync or n > 1
    needs_sync = needs_sync or delivered
    outcome = dataclasses.replace(outcome, epoch=e.epoch, resync=needs_sync)
    return DiLoCoDecision(outcome, needs_sync, delivered, nonfinite)


def quorum_count(group: Mapping[Hashable, Any] | None, own: int) -> int:
    """The swarm's size a round's quorum is judged against: the upper median of the counts the group's members told
    it (``"peers"`` in their round metadata); ``own`` (this peer's count) where none did. Every member sees the same
    group, so all judge the quorum alike: a member that counted more peers than the others (a record not yet
    expired) no longer refuses a round they apply, which would apply its pseudo-gradient twice. The median, not the
    largest: one member's claim (a hostile 10**9) cannot block the rounds of a group of three or more."""
    counts = sorted(m["peers"] for m in (group or {}).values()
                    if isinstance(m, Mapping) and type(m.get("peers")) is int and m["peers"] >= 1)
    return counts[len(counts) // 2] if counts else own


def diloco_contributes(group: Mapping[Hashable, Any], me: Hashable) -> bool:
    """Whether this peer's pseudo-gradient goes into its group's round (else: weight 0 and zeros): only if its
    anchor is the group's (as :func:`diloco_round` judges after it): a peer that will not apply a round must not move
    the others'. True where it cannot tell (malformed metadata: the verdict after the round decides)."""
    try:
        return agrees_with_group(group[me], list(group.values()))
    except Exception:
        return True


__all__ = ["DiLoCoDecision", "DiLoCoRoundEvidence", "diloco_contributes", "diloco_round", "quorum_count"]
