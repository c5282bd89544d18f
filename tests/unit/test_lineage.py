"""The lineage check (collabopt.lineage; collabopt.engine.lineage_check): which members of a gradient round hold
the group's canonical parameters, and what a peer that holds others does. The swarm behaviour (a 2 | 2 partition
that heals ends in sync) is tested in tests/net/test_network_faults.py."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from collabopt import lineage
from collabopt.engine import lineage_check, protocol, sync_round
from collabopt.engine.lineage_check import SyncState
from collabopt.lineage import Verdict, canonical_peers, fingerprint, judge, same_fingerprint

A, B, C = fingerprint([torch.ones(4)]), fingerprint([torch.full((4,), 2.0)]), fingerprint([torch.zeros(4) - 1])


def meta(epoch: int, value: list[float], serves: bool = True, apart: bool = False, **more) -> dict:
    return {"epoch": epoch, "lineage": value, "serves": serves, "apart": apart, **more}


def test_the_lineage_most_members_hold_is_canonical():
    group = {"p1": meta(3, B), "p2": meta(3, A), "p3": meta(3, B)}
    assert canonical_peers(group, 3) == ["p1", "p3"]


def test_a_tie_goes_to_the_smallest_fingerprint_whoever_judges():
    group = {"p1": meta(3, B), "p2": meta(3, A), "p3": meta(3, B), "p4": meta(3, A)}
    assert A < B
    assert canonical_peers(group, 3) == ["p2", "p4"]
    assert canonical_peers(dict(reversed(group.items())), 3) == ["p4", "p2"]  # same members, any order


def test_members_at_other_epochs_and_malformed_metadata_take_no_part():
    group = {"old": meta(2, B), "new": meta(4, B), "plain": None, "nan": meta(3, [float("nan")] * 3),
             "short": meta(3, [1.0]), "text": {"epoch": "3", "lineage": A}, "me": meta(3, A)}
    assert canonical_peers(group, 3) == ["me"]
    assert canonical_peers({"plain": None}, 3) == []


def test_rounding_differences_are_the_same_lineage_and_one_update_is_not():
    params = [torch.randn(1000, generator=torch.Generator().manual_seed(0))]
    assert same_fingerprint(fingerprint(params), fingerprint([params[0].double().float()]))
    assert same_fingerprint(fingerprint(params), fingerprint([params[0] * (1 + 1e-9)]))
    updated = params[0].clone()
    updated[:10] -= 1e-3  # one small step on 1% of the parameters
    assert not same_fingerprint(fingerprint(params), fingerprint([updated]))


class Control:
    """A finished hivemind StepControl: its result is the round's gathered metadata."""

    def __init__(self, group=None, error: BaseException | None = None):
        self.group, self.error = group, error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def exception(self):
        return self.error

    def result(self):
        return self.group


def stand_in(epoch: int = 3, client_mode: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        dht=SimpleNamespace(peer_id="me"), local_epoch=epoch, averaging_timeout=10.0,
        client_mode=client_mode, auxiliary=False, status_loglevel=logging.INFO,
        sync_state=SyncState(checks_lineage=True),
        state_averager=SimpleNamespace(state_sharing_priority=float(epoch), main_parameters=[torch.ones(4)]))


def judge_lineage(optimizer: SimpleNamespace, control: Control | None):
    """The boundary's judgement after its gradient round (``SyncLoop._judge``: the protocol's decision, followed) on
    a stand-in loop; returns the round's outcome (and keeps the decision in ``optimizer.decision``)."""
    optimizer.decision = sync_round.SyncLoop._judge(optimizer, optimizer.local_epoch, 4,
                                                    lineage_check.finished_group(control))
    return optimizer.decision.outcome


def test_a_peer_of_another_lineage_plans_a_download_from_the_canonical_members(caplog):
    optimizer = stand_in()
    group = {"p1": meta(3, A), "me": meta(3, B), "p2": meta(3, A), "p3": meta(2, B)}
    outcome = judge_lineage(optimizer, Control(group))
    assert optimizer.sync_state.resync.peers == ["p1", "p2"] and optimizer.sync_state.resync.epoch == 3
    assert outcome.reason == "apart" and outcome.resync and outcome.group_size == 4
    assert not protocol.averages_parameters(outcome)  # no parameter averaging at this boundary
    assert optimizer.state_averager.state_sharing_priority == 2.5  # downloads prefer the others
    assert "differ from those of 2 of the 3 peers of its gradient round at epoch 3" in caplog.text


@pytest.mark.parametrize("group", [
    {"p1": meta(3, A), "me": meta(3, A), "p2": meta(3, B)},  # in the canonical lineage
    {"p1": meta(4, A), "me": meta(3, B), "p2": meta(3, B)},  # behind, but one peer ahead of two does not pull them
    {"p1": meta(3, A), "me": None},  # this peer did not tell its lineage
    {"p1": meta(3, A), "me": meta(3, B), "p2": meta(3, C)},  # all apart (lossy compression): no majority
    {"p1": meta(3, A, serves=False), "p2": meta(3, A, serves=False), "me": meta(3, B)},  # clients only: no source
    None,
])
def test_a_peer_of_the_canonical_lineage_or_without_a_verdict_goes_on(group):
    optimizer = stand_in()
    outcome = judge_lineage(optimizer, Control(group))
    assert optimizer.sync_state.resync is None and protocol.averages_parameters(outcome) and not outcome.resync


def test_a_peer_apart_adopts_the_lineage_of_a_whole_member_even_alone():
    """The fresh-clone failure: C's part of a round arrived late, A and B used their own values for it and ended
    apart from each other and from C."""
    group = {"a": meta(3, A, apart=True), "b": meta(3, B, apart=True), "c": meta(3, C)}
    assert judge(group, "a") == judge(group, "b") == Verdict(peers=["c"], reason="apart")
    assert judge(group, "c") == Verdict(peers=[], reason="holds")


def test_when_every_member_is_apart_all_adopt_the_smallest_fingerprint():
    group = {"a": meta(3, B, apart=True), "b": meta(3, A, apart=True), "c": meta(3, C, apart=True)}
    smallest = min((A, "b"), (B, "a"), (C, "c"))[1]
    assert judge(group, smallest).reason == "holds"
    assert all(judge(group, peer) == Verdict([smallest], "apart") for peer in "abc" if peer != smallest)


def test_a_peer_whose_last_round_was_partial_but_holds_the_lineage_is_back_in_sync():
    optimizer = stand_in()
    optimizer.sync_state.apart = True  # (a parameter averaging merged it with the others since)
    judge_lineage(optimizer, Control({"p1": meta(3, A), "me": meta(3, A, apart=True)}))
    assert optimizer.sync_state.apart is False and optimizer.sync_state.resync is None


def test_a_peer_behind_adopts_the_newest_epochs_lineage(caplog):
    group = {"a": meta(4, A, apart=True), "b": meta(4, B, apart=True), "c": meta(3, C)}
    smallest = "a" if A < B else "b"
    assert judge(group, "c") == Verdict([smallest], "behind")
    optimizer = stand_in()
    outcome = judge_lineage(optimizer, Control({"p1": meta(4, A), "me": meta(3, B)}))
    assert optimizer.sync_state.resync.peers == ["p1"]
    assert outcome.detail == ("this peer is at epoch 3, 1 peer(s) of its gradient round at epoch 4 (it missed a "
                              "round): it does not step, and downloads the swarm's state now")
    assert optimizer.decision.download_epoch == 5  # (the state of the epoch p1 steps to)
    assert "after this step" not in caplog.text  # (no step: the loop says so as it downloads, test_state_round)


def test_a_partial_round_leaves_the_peer_apart_until_a_round_or_a_download_says_otherwise(caplog):
    optimizer = stand_in()
    judge_lineage(optimizer, Control({"p1": meta(3, A), "me": meta(3, A, received=0.757)}))
    assert optimizer.sync_state.apart is True and lineage_check.out_of_sync(optimizer)
    assert "75.7% of this peer's gradient round at epoch 3 arrived" in caplog.text
    assert lineage_check.lineage_metadata(optimizer)["apart"] is True
    optimizer.sync_state.resync = lineage_check.Resync(peers=["p1"], epoch=3, until=float("inf"))
    optimizer.state_averager.main_parameters = [torch.full((4,), 2.0)]  # the download brought the others' state
    lineage_check.resync_outcome(optimizer, optimizer.sync_state.resync, True, A)
    assert optimizer.sync_state.apart is False and not lineage_check.out_of_sync(optimizer)


def test_a_peer_with_non_finite_parameters_adopts_the_lineage_even_of_one_peer(caplog):
    nan = [float("nan")] * 3
    assert judge({"p1": meta(3, A), "me": meta(3, nan)}, "me") == Verdict(["p1"], "nonfinite")
    optimizer = stand_in()
    judge_lineage(optimizer, Control({"p1": meta(3, A), "p2": meta(3, B), "me": meta(3, nan)}))
    assert optimizer.sync_state.resync.peers == (["p1"] if A < B else ["p2"])
    assert "this peer's parameters are not finite" in caplog.text


def test_peers_outside_the_newest_epoch_are_judged_among_their_own_epoch():
    group = {"y": meta(4, A), "x1": meta(3, B), "x2": meta(3, B), "x3": meta(3, C)}
    assert judge(group, "x3") == Verdict(["x1", "x2"], "lineage")  # one peer ahead of three does not pull them
    assert judge(group, "x1").reason == "holds" and judge(group, "y").reason == "holds"


def test_a_peer_behind_by_its_count_only_holds_the_lineage():
    assert judge({"a": meta(4, A), "c": meta(3, A)}, "c") == Verdict([], "holds")


def test_collabopts_state_service_answers_under_hiveminds_handler_name():
    """hivemind names a servicer's RPCs after its class: the state service serves downloads under the name of
    hivemind's state averager, so plain hivemind peers (and collabopt's of any version) download from it."""
    from hivemind.optim.state_averager import TrainingStateAverager

    from collabopt.engine.state_service import StateServicer

    for namespace in ("run", None):
        assert StateServicer._get_handle_name(namespace, "rpc_download_state") == \
            TrainingStateAverager._get_handle_name(namespace, "rpc_download_state")


def test_a_pending_resync_is_not_replaced():
    optimizer = stand_in()
    pending = lineage_check.Resync(peers=["p9"], epoch=2, until=float("inf"))
    optimizer.sync_state.resync = pending
    outcome = judge_lineage(optimizer, Control({"p1": meta(3, A), "p2": meta(3, A), "me": meta(3, B)}))
    assert optimizer.sync_state.resync is pending and outcome.reason == "averaged"


@pytest.mark.parametrize("tensor", [torch.full((3 * lineage.FINGERPRINT_CHUNK + 7,), 0.3333),  # LayerNorm-like
                                    torch.randn(1000, 1000) * 1e-2 + 1e-3, torch.randn(70_000).half(),
                                    torch.randn(70_000).bfloat16(), torch.randn(70_000, dtype=torch.float64)],
                         ids=["constant", "random", "fp16", "bf16", "fp64"])
def test_the_fingerprint_agrees_with_float64_sums_far_under_the_tolerance(tensor):
    exact = tensor.double()
    expected = [float(exact.sum()), float(exact.abs().sum()), float(exact.square().sum())]
    total, magnitude, squares = fingerprint([tensor, torch.zeros(0)])
    assert abs(total - expected[0]) <= 1e-7 * expected[1] and abs(magnitude - expected[1]) <= 1e-7 * expected[1]
    assert squares == pytest.approx(expected[2], rel=2e-7)


def test_values_beyond_float32_sums_still_fingerprint():
    assert all(math.isfinite(x) for x in fingerprint([torch.full((1000,), 1e20)]))


def test_the_fingerprint_of_mixed_magnitudes():
    big = [torch.full((1000,), 1e-3), torch.tensor([-2.0, 3.0])]
    total, magnitude, squares = fingerprint(big)
    assert total == pytest.approx(2.0) and magnitude == pytest.approx(6.0) and squares == pytest.approx(13.001)


def test_a_failed_round_judges_nothing():
    optimizer = stand_in()
    judge_lineage(optimizer, Control({"p1": meta(3, A), "me": meta(3, B)}, error=TimeoutError()))
    judge_lineage(optimizer, None)
    assert optimizer.sync_state.resync is None


def test_a_resync_ends_when_the_parameters_changed_and_retries_while_they_did_not(monkeypatch):
    optimizer = stand_in()
    before = fingerprint(optimizer.state_averager.main_parameters)
    resync = lineage_check.Resync(peers=["p1"], epoch=3, until=float("inf"))
    optimizer.sync_state.resync = resync
    # the canonical peers had not served the new epoch yet
    lineage_check.resync_outcome(optimizer, resync, False, before)
    assert optimizer.sync_state.resync is resync and resync.next_try > 0
    assert optimizer.state_averager.state_sharing_priority == 2.5
    optimizer.state_averager.main_parameters = [torch.full((4,), 2.0)]
    lineage_check.resync_outcome(optimizer, resync, False, before)
    assert optimizer.sync_state.resync is None


def test_a_resync_gives_up_at_its_deadline(caplog):
    optimizer = stand_in()
    resync = lineage_check.Resync(peers=["p1"], epoch=3, until=0.0)
    optimizer.sync_state.resync = resync
    lineage_check.resync_outcome(optimizer, resync, False, fingerprint(optimizer.state_averager.main_parameters))
    assert optimizer.sync_state.resync is None and "goes on with its own parameters" in caplog.text
