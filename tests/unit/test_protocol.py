"""The protocol's decisions (collabopt.engine.protocol), as tables: rows of evidence and the outcome each must give.
Every reason of a round (ROUND_REASONS) and every trigger of a download (DOWNLOAD_REASONS) has a row; the last tests
run a step of the real loop and peer over stand-in services (a catch-up download drops the step's samples)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from collabopt import CollaborativeOptimizer, RoundOutcome
from collabopt.engine import protocol, sync_round
from collabopt.engine.lineage_check import SyncState
from collabopt.engine.peer import HivemindPeer
from collabopt.engine.protocol import (
    DiLoCoRoundEvidence,
    DiLoCoStepEvidence,
    StepDecision,
    SwarmView,
    SyncRoundEvidence,
    SyncStepEvidence,
)
from collabopt.interface import ROUND_REASONS
from collabopt.lineage import fingerprint

A, B, C = fingerprint([torch.ones(4)]), fingerprint([torch.full((4,), 2.0)]), fingerprint([torch.zeros(4) - 1])
NAN = [float("nan")] * 3


def meta(epoch: int, value: list[float], apart: bool = False, **more) -> dict:
    return {"epoch": epoch, "lineage": value, "serves": True, "apart": apart, **more}


# ---------------------------------------------------------------------------------------------- a local step

NO_GROUP = RoundOutcome(True, "no group", num_peers=3, epoch=8)
AVERAGED = RoundOutcome(True, "averaged", 3, num_peers=3, epoch=8)
# (evidence, download reason or None, joined_epoch after, view_checked)
SYNC_STEPS = [
    (SyncStepEvidence(SwarmView(8, 8), resync_due=True), "re-sync due", None, False),
    (SyncStepEvidence(SwarmView(8, 8), resync_due=True, fresh_view=True, joined_epoch=7), "re-sync due", 7, False),
    (SyncStepEvidence(SwarmView(9, 9), joined_epoch=8, last_round=NO_GROUP), "joined round ended alone", None, False),
    (SyncStepEvidence(SwarmView(9, 9), joined_epoch=8, last_round=RoundOutcome(True, "alone", epoch=8)),
     "joined round ended alone", None, False),
    (SyncStepEvidence(SwarmView(9, 9), joined_epoch=8, last_round=AVERAGED), None, None, False),
    (SyncStepEvidence(SwarmView(9, 9), joined_epoch=8, last_round=RoundOutcome(True, "no group", epoch=7)),
     None, 8, False),  # the round it joined has not ended yet
    (SyncStepEvidence(SwarmView(8, 8), fresh_view=True), None, None, True),
    (SyncStepEvidence(SwarmView(8, 9), fresh_view=True, accumulated_toward_round=True), None, 8, True),  # joins
    (SyncStepEvidence(SwarmView(8, 9), fresh_view=True), "swarm at another epoch", None, True),
    (SyncStepEvidence(SwarmView(8, 10), fresh_view=True, accumulated_toward_round=True),
     "swarm at another epoch", None, True),
    (SyncStepEvidence(SwarmView(8, 7), fresh_view=True), "swarm at another epoch", None, True),
    (SyncStepEvidence(SwarmView(8, 9)), None, None, False),  # one ahead: the others just ended this epoch
    (SyncStepEvidence(SwarmView(8, 10)), "behind", None, False),
]


@pytest.mark.parametrize(("evidence", "reason", "joined", "checked"), SYNC_STEPS)
def test_a_synchronous_step_downloads_when_the_protocol_says_why(evidence, reason, joined, checked):
    decision = protocol.sync_step(evidence)
    assert (decision.download, decision.reason) == (reason is not None, reason or "")
    assert (decision.joined_epoch, decision.view_checked, decision.keeps_progress) == (joined, checked, False)


DILOCO_STEPS = [  # (evidence, download reason or None)
    (DiLoCoStepEvidence(SwarmView(3, 3), trained=True), None),
    (DiLoCoStepEvidence(SwarmView(3, 3), needs_sync=True), "re-sync due"),
    (DiLoCoStepEvidence(SwarmView(3, 3), needs_sync=True, overlap=True, trained=True), "re-sync due"),
    (DiLoCoStepEvidence(SwarmView(3, 4), trained=True), "one epoch behind"),  # an anchor one round old is stale
    (DiLoCoStepEvidence(SwarmView(3, 4), overlap=True, trained=True), None),  # it joins the round under way
    (DiLoCoStepEvidence(SwarmView(3, 4), overlap=True), "one epoch behind"),  # nothing to bring to it
    (DiLoCoStepEvidence(SwarmView(3, 5), overlap=True, trained=True), "behind"),
]


@pytest.mark.parametrize(("evidence", "reason"), DILOCO_STEPS)
def test_a_diloco_step_downloads_when_the_protocol_says_why_and_keeps_its_progress(evidence, reason):
    decision = protocol.diloco_step(evidence)
    assert (decision.download, decision.reason, decision.keeps_progress) == (reason is not None, reason or "", True)


@pytest.mark.parametrize(("decision", "behind_after", "accepted"), [
    (StepDecision(False), False, True),
    (StepDecision(True, "behind"), False, False),  # synchronous: its gradients came from replaced parameters
    (StepDecision(True, "behind"), True, False),
    (StepDecision(True, "behind", keeps_progress=True), False, True),  # DiLoCo: its progress is on the new anchor
    (StepDecision(True, "behind", keeps_progress=True), True, False),  # ... nobody served it: the core counts it
])
def test_a_steps_samples_count_unless_a_download_dropped_them(decision, behind_after, accepted):
    assert protocol.step_accepted(decision, behind_after) is accepted


# ---------------------------------------------------------------------------------------- the synchronous round


@pytest.mark.parametrize(("view", "joins_round_ahead", "expected"), [
    (SwarmView(3, 5, 4), False, RoundOutcome(False, "behind", num_peers=4, resync=True, epoch=3)),
    # one behind: the others ended this epoch's round without it (a peer that finished waits for it to download)
    (SwarmView(4, 5, 4), False, RoundOutcome(False, "behind", num_peers=4, resync=True, epoch=4)),
    (SwarmView(5, 5, 4), False, None),
    (SwarmView(3, 5, 4), True, RoundOutcome(False, "behind", num_peers=4, resync=True, epoch=3)),
    (SwarmView(4, 5, 4), True, None),  # delay_grad_averaging: the others announce the epoch of the round under way
    (SwarmView(5, 5, 4), True, None),
])
def test_a_boundary_behind_the_swarm_runs_no_round(view, joins_round_ahead, expected):
    assert protocol.sync_boundary(view, joins_round_ahead) == expected


def lineage_round(group: dict | None, **evidence) -> SyncRoundEvidence:
    return SyncRoundEvidence(3, 4, group=group, me="me", checks_lineage=True, **evidence)


# (evidence, (applied, reason, group_size, resync), resync_from, holds, received)
SYNC_ROUNDS = [
    (SyncRoundEvidence(3, 1), (True, "alone", 1, False), None, False, 1.0),
    (SyncRoundEvidence(3, 4), (True, "no group", 1, False), None, False, 1.0),  # the round failed
    (lineage_round({"me": meta(3, A)}), (True, "no group", 1, False), None, True, 1.0),  # a group of one
    (SyncRoundEvidence(3, 4, averages_gradients=False), (True, "averaged", 1, False), None, False, 1.0),
    (SyncRoundEvidence(3, 1, averages_gradients=False), (True, "alone", 1, False), None, False, 1.0),
    (lineage_round({"p1": meta(3, A), "me": meta(3, A)}), (True, "averaged", 2, False), None, True, 1.0),
    (SyncRoundEvidence(3, 4, group={"p1": meta(3, A), "me": meta(3, B), "p2": meta(3, A)}, me="me"),
     (True, "averaged", 3, False), None, False, 1.0),  # (no lineage check: delay_* options)
    (lineage_round({"p1": meta(3, A), "me": None}), (True, "averaged", 2, False), None, False, 1.0),
    (lineage_round({"p1": meta(3, A), "me": meta(3, A, received=0.757)}), (True, "partial", 2, True), None, True,
     0.757),
    (lineage_round({"p1": meta(3, A), "me": meta(3, B), "p2": meta(3, A)}), (True, "apart", 3, True), ("p1", "p2"),
     False, 1.0),  # another lineage (a healed partition)
    (lineage_round({"p1": meta(3, A), "me": meta(3, B, apart=True)}), (True, "apart", 2, True), ("p1",), False,
     1.0),  # its last round was partial
    (lineage_round({"p1": meta(3, A), "me": meta(3, NAN)}), (True, "apart", 2, True), ("p1",), False, 1.0),
    # behind its group (it missed a round; its gradients were left out): it does not step onto parameters of its own
    # at the next epoch, it keeps its epoch and downloads now (a late joiner whose download was one epoch old)
    (lineage_round({"p1": meta(4, A), "me": meta(3, B)}), (False, "behind", 2, True), ("p1",), False, 1.0),
    (lineage_round({"p1": meta(4, A), "me": meta(3, A)}), (False, "behind", 2, True), ("p1",), False, 1.0),  # (its
    # parameters are the group's, its epoch one behind: the average would put the swarm's epoch-5 parameters at 4)
    (lineage_round({"p1": meta(4, A), "me": meta(3, B, received=0.5)}), (False, "behind", 2, True), ("p1",), False,
     0.5),  # (partial too: the verdict's reason stands)
    (lineage_round({"p1": meta(4, A), "p2": meta(4, A), "me": meta(3, B)}, resync_pending=True),
     (False, "behind", 3, True), ("p1", "p2"), False, 1.0),  # (a pending re-sync: left out all the same)
    (lineage_round({"p1": meta(4, A), "me": meta(3, B)}, step_pending=False), (True, "behind", 2, True), ("p1",),
     False, 1.0),  # the step ran already (delay_grad_averaging: the round ended in the background)
    (lineage_round({"p1": meta(3, A), "me": meta(3, B), "p2": meta(3, A)}, resync_pending=True),
     (True, "averaged", 3, False), None, False, 1.0),  # a pending re-sync is not planned again
    (lineage_round({"p1": meta(3, A), "me": meta(3, B, received=0.9)}, resync_pending=True),
     (True, "partial", 2, True), None, False, 0.9),
    (lineage_round({"p1": meta(3, A), "me": meta(3, B), "p2": meta(3, C)}), (True, "averaged", 3, False), None,
     False, 1.0),  # all apart (lossy compression): no majority to adopt
    # no lineage check (delay_* options): the epochs and the share received still judged
    (SyncRoundEvidence(3, 4, group={"p1": {"epoch": 4}, "me": {"epoch": 3}, "p2": {"epoch": 4}}, me="me"),
     (False, "behind", 3, True), ("p1", "p2"), False, 1.0),  # a stale joiner: its gradients were left out
    (SyncRoundEvidence(3, 4, group={"p1": {"epoch": 4}, "me": {"epoch": 3}, "p2": {"epoch": 4}}, me="me",
                       step_pending=False), (True, "behind", 3, True), ("p1", "p2"), False, 1.0),  # (stepped)
    (SyncRoundEvidence(3, 4, group={"p1": {"epoch": 3}, "me": {"epoch": 4}, "p2": {"epoch": 3}}, me="me"),
     (True, "apart", 3, True), None, False, 1.0),  # one epoch on, alone: left out too
    (SyncRoundEvidence(3, 4, group={"p1": {"epoch": 3}, "me": {"epoch": 3, "received": 0.5}}, me="me"),
     (True, "partial", 2, True), None, False, 0.5),
]


@pytest.mark.parametrize(("evidence", "expected", "resync_from", "holds", "received"), SYNC_ROUNDS)
def test_a_synchronous_round_gives_one_outcome(evidence, expected, resync_from, holds, received):
    decision = protocol.sync_round(evidence)
    outcome = decision.outcome
    assert (outcome.applied, outcome.reason, outcome.group_size, outcome.resync) == expected
    assert (outcome.epoch, outcome.num_peers) == (evidence.epoch, evidence.num_peers)
    assert (decision.resync_from, decision.holds, decision.received) == (resync_from, holds, received)
    assert decision.averages_parameters == (outcome.reason not in ("apart", "behind"))
    verdict = protocol.lineage.judge(evidence.group, "me") if evidence.group else None
    if resync_from is not None and evidence.checks_lineage and not evidence.resync_pending and verdict.peers:
        assert outcome.detail.startswith(protocol.lineage.verdict_text(  # what the log says of it
            verdict, evidence.group, evidence.group["me"]["epoch"]))
    assert ("it does not step, and downloads the swarm's state now" in outcome.detail) is not outcome.applied


@pytest.mark.parametrize("evidence", [row[0] for row in SYNC_ROUNDS])
def test_the_optimizer_steps_exactly_where_the_boundary_is_applied(evidence):
    """Not behind its group with its step still to come: it would step onto parameters of its own."""
    decision = protocol.sync_round(evidence)
    assert decision.steps is decision.outcome.applied
    assert decision.steps is not (decision.outcome.reason == "behind" and evidence.step_pending)
    assert (decision.download_epoch is None) is decision.steps


@pytest.mark.parametrize(("epochs", "download_epoch"), [
    ({"me": 3, "a": 4}, 5),  # the state of the epoch its group steps to
    ({"me": 3, "a": 4, "b": 4, "c": 5}, 5),  # the peers it follows are the group's epoch's (c is left out too)
    ({"me": 3, "a": 5, "b": 5, "c": 4}, 6),  # two epochs behind: the state its group steps to, not the next epoch
])
def test_a_peer_behind_its_round_downloads_the_epoch_its_peers_step_to(epochs, download_epoch):
    group = {peer: {"epoch": epoch} for peer, epoch in epochs.items()}
    decision = protocol.sync_round(protocol.SyncRoundEvidence(3, len(group), group=group, me="me"))
    assert not decision.steps and decision.download_epoch == download_epoch
    assert all(epochs[peer] == download_epoch - 1 for peer in decision.resync_from)


@pytest.mark.parametrize(("outcome", "accepted"), [
    (None, True),  # its round ends in the background
    (RoundOutcome(True, "averaged", 2, num_peers=2, epoch=3), True),
    (RoundOutcome(True, "no group", num_peers=2, epoch=3), True),  # (its own gradients: applied)
    (RoundOutcome(True, "behind", 2, num_peers=2, resync=True, epoch=3), True),  # (it stepped: delay_grad_averaging)
    (RoundOutcome(False, "behind", 2, num_peers=2, resync=True, epoch=3), False),  # behind its gradient round
    (RoundOutcome(False, "behind", num_peers=2, resync=True, epoch=3), False),  # behind the swarm: no round
])
def test_a_boundary_steps_samples_count_only_where_it_applied_an_update(outcome, accepted):
    assert protocol.boundary_accepted(outcome) is accepted


@pytest.mark.parametrize(("gathered", "epoch", "counts"), [
    ({"a": {"epoch": 5}, "b": {"epoch": 5}, "c": {"epoch": 4}}, 5, {"a": True, "b": True, "c": False}),
    ({"a": {"epoch": 5}, "b": {"epoch": 4}, "c": {"epoch": 4}}, 4, {"a": False, "b": True, "c": True}),
    ({"a": {"epoch": 5}, "b": {"epoch": 4}}, 5, {"a": True, "b": False}),  # (a tie: the newest epoch)
    ({"a": {"epoch": 5}, "b": None, "c": {}}, 5, {"a": True, "b": True, "c": True}),  # (no epoch: nothing to judge)
    ({"a": None}, None, {"a": True}),
])
def test_only_the_members_at_their_groups_epoch_contribute_gradients(gathered, epoch, counts):
    assert protocol.group_epoch(gathered) == epoch
    assert {peer: protocol.sync_contributes(gathered[peer], gathered) for peer in gathered} == counts


@pytest.mark.parametrize(("mine", "theirs", "admits"), [
    ({"epoch": 7}, {"epoch": 7}, True),
    ({"epoch": 7}, {"epoch": 3}, True),  # (a peer behind learns so from its group)
    ({"epoch": 3}, {"epoch": 7}, False),  # a leader behind the asker's round: the asker looks for another leader
    ({"epoch": 3, "lineage": "x"}, {"epoch": 4, "lineage": "y"}, False),
    ({"epoch": 3}, {}, True), ({"epoch": 3}, None, True), ({}, {"epoch": 7}, True),  # (nothing to judge)
    ({"epoch": 3}, {"epoch": 7.0}, True), ({"epoch": True}, {"epoch": 7}, True),
])
def test_a_leader_does_not_take_peers_of_a_later_epoch(mine, theirs, admits):
    assert protocol.sync_admits(mine, theirs) is admits


@pytest.mark.parametrize(("gathered", "epoch", "peers", "averages"), [
    ({"me": {"epoch": 5}, "b": {"epoch": 5}, "c": {"epoch": 4}}, 5, 2, True),  # (c downloads)
    ({"me": {"epoch": 14}, "b": {"epoch": 12}}, 14, 1, False),  # a joiner just downloaded: alone at its epoch
    ({"me": {"epoch": 5}, "b": None, "c": {}}, 5, 3, True),  # (no epoch known: counted)
    ({"me": {"epoch": 4}, "b": {"epoch": 5}, "c": {"epoch": 5}}, 4, 1, False),  # (me: behind, refused anyway)
    # the lineage check (the same verdict on every member): b's last round was partial, it downloads
    ({"me": meta(5, A), "b": meta(5, B, apart=True)}, 5, 1, False),
    ({"me": meta(5, A), "b": meta(5, A), "c": meta(5, B, apart=True)}, 5, 2, True),
])
def test_a_parameter_round_expects_the_members_at_this_peers_epoch_and_none_runs_alone(gathered, epoch, peers,
                                                                                       averages):
    """A peer alone at its epoch in its gradient round (the others download) runs no parameter round: it would wait
    ``averaging_timeout`` for a group that never comes."""
    assert protocol.parameter_round_peers(gathered, epoch) == peers
    outcome = protocol.sync_round(SyncRoundEvidence(epoch, len(gathered), group=gathered, me="me",
                                                    checks_lineage=True)).outcome
    assert protocol.averages_parameters(outcome, peers) is averages
    assert protocol.averages_parameters(outcome, None) is (outcome.reason == "averaged")  # (no hint: as before)


def test_only_a_whole_average_replaces_a_peers_own_gradients():
    assert protocol.sync_gradients(1.0)
    assert not protocol.sync_gradients(0.999) and not protocol.sync_gradients(0.0)


def test_what_the_lineage_verdict_says():
    group = {"p1": meta(3, A), "me": meta(3, B), "p2": meta(3, A), "p3": meta(2, B)}
    assert "differ from those of 2 of the 3 peers of its gradient round at epoch 3" in (
        protocol.sync_round(lineage_round(group)).outcome.detail)
    assert protocol.sync_round(lineage_round({"p1": meta(4, A), "me": meta(3, B)})).outcome.detail == (
        "this peer is at epoch 3, 1 peer(s) of its gradient round at epoch 4 (it missed a round): it does not step, "
        "and downloads the swarm's state now")
    assert protocol.sync_round(lineage_round({"p1": meta(3, A), "me": meta(3, A, received=0.757)})).outcome.detail \
        == "75.7% of the average arrived"


# ---------------------------------------------------------------------------------------------- the DiLoCo round

MINE, THEIRS = {"epoch": 5, "anchor": A}, {"epoch": 5, "anchor": B}


def diloco(group: dict | None = None, **evidence) -> DiLoCoRoundEvidence:
    return DiLoCoRoundEvidence(**{"epoch": 5, "num_peers": 3, "weight": 24.0, "sent": MINE, "me": "me",
                                  "group": group, **evidence})


WHOLE = {"me": MINE, "p1": MINE, "p2": MINE}
# (evidence, (applied, reason, group_size, resync), may_have_delivered, nonfinite_average)
DILOCO_ROUNDS = [
    (diloco(num_peers=1), (True, "alone", 1, False), False, False),
    (diloco(num_peers=1, weight=0.0), (False, "nothing to apply", 1, False), False, False),
    (diloco(WHOLE), (True, "averaged", 3, False), False, False),
    (diloco({"me": MINE, "p1": MINE}, num_peers=4), (False, "no quorum", 2, False), False, False),
    # the quorum is judged on the upper median of the counts the members told the group, the same on every member
    (diloco({"me": {**MINE, "peers": 3}, "p1": {**MINE, "peers": 4}}, num_peers=3), (False, "no quorum", 2, False),
     False, False),
    (diloco({"me": {**MINE, "peers": 4}, "p1": {**MINE, "peers": 4}, "p2": {**MINE, "peers": 10**9}}, num_peers=4),
     (True, "averaged", 3, False), False, False),  # (one member's claim does not block a group of three)
    (diloco({"me": {**MINE, "peers": 3}, "p1": {**MINE, "peers": 3}}, num_peers=4), (True, "averaged", 2, False),
     False, False),
    (diloco({"me": {**MINE, "peers": "9"}, "p1": {**MINE, "peers": 0}}, num_peers=4), (False, "no quorum", 2, False),
     False, False),  # (malformed counts ignored: its own)
    (diloco({"me": MINE, "p1": THEIRS, "p2": THEIRS}), (False, "anchor differs", 3, True), False, False),
    (diloco({"me": THEIRS, "p1": THEIRS, "p2": THEIRS}), (True, "averaged", 3, False), False, False),  # as sent
    (diloco({"p1": THEIRS, "p2": THEIRS, "p3": MINE}), (False, "anchor differs", 3, True), False, False),
    (diloco(WHOLE, average_finite=False), (False, "non-finite average", 3, False), False, True),
    (diloco(error="TimeoutError()"), (False, "averaging failed", 1, False), False, False),
    # a member refused before any part was sent (no valid member token): no round, nothing delivered
    (diloco(WHOLE, error="… is no member of the swarm"), (False, "averaging failed", 1, False), False, False),
    # part of the average did not arrive: delivered where results holding its values did (with a weight)
    (diloco(WHOLE, received=0.9), (False, "averaging failed", 1, True), True, False),
    (diloco(WHOLE, received=0.9, weight=0.0), (False, "averaging failed", 1, False), False, False),
    (diloco(WHOLE, received=0.4, included=0.0), (False, "averaging failed", 1, False), False, False),
    (diloco(WHOLE, received=0.0, included=0.0), (False, "averaging failed", 1, False), False, False),
    # every result came, though one holds no values of another member (it was left out): the same bits for all
    (diloco(WHOLE, included=0.7), (True, "averaged", 3, False), False, False),
    (diloco(WHOLE, needs_sync=True), (True, "averaged", 3, True), False, False),
    # compressed, not one of the round's contributors: it applies the round, its samples count (sent later)
    (diloco(WHOLE, contributed=False), (True, "averaged", 3, False), False, False),
    (diloco({"me": MINE, "p1": THEIRS, "p2": THEIRS}, contributed=False), (False, "anchor differs", 3, True), False,
     False),
    # overlapped: the epoch moved on when the round started: a round not applied leaves it owing a download
    (diloco(error="TimeoutError()", overlapped=True), (False, "averaging failed", 1, True), False, False),
    (diloco({"me": MINE, "p1": MINE}, num_peers=4, overlapped=True), (False, "no quorum", 2, True), False, False),
    (diloco(WHOLE, overlapped=True), (True, "averaged", 3, False), False, False),
]


@pytest.mark.parametrize(("evidence", "expected", "delivered", "nonfinite"), DILOCO_ROUNDS)
def test_a_diloco_round_is_applied_only_if_sound(evidence, expected, delivered, nonfinite):
    decision = protocol.diloco_round(evidence)
    outcome = decision.outcome
    assert (outcome.applied, outcome.reason, outcome.group_size, outcome.resync) == expected
    assert (decision.needs_sync, decision.may_have_delivered, decision.nonfinite_average) == (expected[3], delivered,
                                                                                              nonfinite)
    assert outcome.epoch == 5 and outcome.weight == evidence.weight
    if not evidence.contributed and outcome.applied:
        assert "not one of this round's contributors" in outcome.detail


# ------------------------------------------------------------------------------------------------- both modes


@pytest.mark.parametrize(("refused", "restored", "expected"), [
    (False, False, (True, "averaged")),
    (True, False, (False, "non-finite average")),  # averaged gradients refused: no update
    (False, True, (True, "non-finite average")),  # averaged parameters restored: its own update is kept
    (True, True, (False, "non-finite average")),
])
def test_the_guards_refusal_amends_a_synchronous_outcome(refused, restored, expected):
    outcome = protocol.guard_amended(RoundOutcome(True, "averaged", 3, num_peers=3, epoch=2), refused, restored)
    assert (outcome.applied, outcome.reason, outcome.epoch, outcome.group_size) == (*expected, 2, 3)


def test_the_tables_cover_every_reason_and_every_trigger():
    reasons = {row[1][1] for row in SYNC_ROUNDS + DILOCO_ROUNDS} | {"behind", "non-finite average"}
    assert reasons == set(ROUND_REASONS)  # ("behind" at the boundary; the guard's amendment: the tests above)
    triggers = {row[1] for row in SYNC_STEPS + DILOCO_STEPS} - {None}
    assert triggers == set(protocol.DOWNLOAD_REASONS)


# ------------------------------------------------------------------------ the real loop and peer, stand-in services


class Accumulator:
    """The gradient averager's accumulation as a step sees it."""

    def __init__(self):
        self.local_samples_accumulated = self.local_times_accumulated = 0

    def accumulate_grads_(self, batch_size: int) -> None:
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1


def sync_peer(model: torch.nn.Module, opt: torch.optim.Optimizer, local_epoch: int,
              swarm_epoch: int) -> HivemindPeer:
    """A :class:`HivemindPeer` over a real :class:`SyncLoop` whose services are stand-ins: its downloads bring the
    swarm's epoch; no epoch ends."""
    loop = object.__new__(sync_round.SyncLoop)
    loop.state_averager = SimpleNamespace(local_epoch=local_epoch, votes=None, step=lambda **kwargs: None,
                                          main_parameters=tuple(model.parameters()), optimizer=opt)
    progress = SimpleNamespace(samples_accumulated=0)
    fetched = threading.Event()
    fetched.set()
    loop.tracker = SimpleNamespace(
        global_epoch=swarm_epoch, global_progress=SimpleNamespace(num_peers=2, samples_accumulated=0),
        local_progress=progress, fetched_global_progress_this_epoch=fetched, ready_to_update_epoch=False,
        report_local_progress=lambda epoch, samples: setattr(progress, "samples_accumulated", samples),
        performance_ema=SimpleNamespace(samples_per_second=0.0), estimated_next_update_time=float("inf"),
        dht=SimpleNamespace(store=lambda **kwargs: None), local_public_key=b"key", _local_public_key=b"key")
    loop.grad_averager, loop.sync_state, loop.downloads = Accumulator(), SyncState(), []
    loop.last_round, loop._joined_epoch, loop._exact_check_due = None, None, True
    for name, value in dict(auxiliary=False, delay_grad_averaging=False, client_mode=False,
                            status_loglevel=logging.INFO).items():
        setattr(loop, name, value)
    loop.schedule_rounds = loop.shutdown = lambda: None

    def download() -> None:
        loop.downloads.append(loop.local_epoch)
        loop.state_averager.local_epoch = loop.tracker.global_epoch
        progress.samples_accumulated = 0
        loop.grad_averager = Accumulator()

    loop.load_state_from_peers = download
    peer = object.__new__(HivemindPeer)
    peer.loop, peer.metrics_key = loop, "protocol_metrics"
    peer.dht = SimpleNamespace(client_mode=False, peer_id=SimpleNamespace(to_base58=lambda: "QmPeer"),
                               get_visible_maddrs=lambda: [])
    return peer


def test_a_catch_up_download_that_moves_the_epoch_drops_the_steps_samples():
    """The peer once read a moved epoch as an accepted step: its samples were counted in ``samples_reported``
    although the loop dropped them (their gradients came from the replaced parameters)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peer = sync_peer(model, opt, local_epoch=3, swarm_epoch=3)
    copt = CollaborativeOptimizer(opt, run_id="protocol", target_batch_size=64, model=model, peer=peer,
                                  handle_signals=False)
    for swarm_epoch, samples, downloads in ((3, 8, []), (5, 0, [3]), (5, 8, [3])):
        peer.loop.tracker.global_epoch = swarm_epoch  # (at the second step: a peer back from a cut link)
        model(torch.randn(8, 3)).pow(2).mean().backward()
        result = copt.step()
        copt.zero_grad()
        assert peer.loop.downloads == downloads and result.samples == samples
    assert copt.local_epoch == 5 and copt.samples_reported == 16 and peer.accumulated_samples == 8
    copt.close()


def test_the_loop_says_whether_it_accepted_the_samples():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    peer = sync_peer(model, torch.optim.SGD(model.parameters(), lr=0.1), local_epoch=5, swarm_epoch=5)
    assert peer.loop.step(8) is True and peer.step(8) is True and peer.accumulated_samples == 16
    peer.loop.tracker.global_epoch = 7  # two ahead: a download first
    assert peer.step(8) is False and peer.loop.downloads == [5] and peer.local_epoch == 7
    peer.loop.tracker.ready_to_update_epoch = True  # a step that ends a boundary: as its outcome says
    for outcome, accepted in ((RoundOutcome(True, "averaged", 2, num_peers=2, epoch=7), True), (None, True),
                              (RoundOutcome(False, "behind", 2, num_peers=2, resync=True, epoch=7), False)):
        peer.loop.end_epoch = lambda outcome=outcome: outcome
        assert peer.step(8) is accepted
    peer.loop.tracker.ready_to_update_epoch = False
    peer.loop.auxiliary = True  # an auxiliary peer's turn contributes no samples
    assert peer.loop.step(None) is False
