"""The synchronous gradient rounds' faults, in process (engine.gradient_rounds, engine.loop.tag_along,
engine.sync_download, engine.diloco_round): a member left out of its round keeps its own gradients, tagging along
sends zeros of the round's own, and a failed round a DiLoCo peer brought nothing to does not end its training.
The rounds themselves run in tests/swarm/test_failed_round.py and tests/swarm/test_swarm_schedules.py."""

from __future__ import annotations

import contextlib
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from collabopt import Terminated
from collabopt.engine import protocol, sync_download
from collabopt.engine.averager import AveragingResult
from collabopt.engine.diloco_round import DiLoCoLoop
from collabopt.engine.gradient_rounds import GradientRound, GradientRounds
from collabopt.engine.loop import PeerLoop


class Scheduled:
    """A ScheduledRound as GradientRound sees it: ``ended`` is its result once tensors were handed (or tagged)."""

    def __init__(self, ended: AveragingResult | None = None):
        self.ended, self.triggered, self.began_allreduce, self.group = ended, False, False, ("T", "X")
        self.handed: list = []

    def run(self, tensors, weight: float = 1.0) -> None:
        self.triggered = True
        self.handed.append(([t.clone() for t in tensors], weight))

    def tag_along(self) -> None:
        self.triggered = True
        self.handed.append(("zeros of its own", 0.0))

    def done(self) -> bool:
        return self.triggered

    def result(self, timeout: float | None = None) -> AveragingResult:
        return self.ended


def rounds(buffers: list[torch.Tensor]) -> GradientRounds:
    made = GradientRounds.__new__(GradientRounds)
    made._buffers, made._lock = buffers, threading.RLock()
    made.service = SimpleNamespace(p2p=SimpleNamespace(peer_id="T"))
    return made


def ended(average: torch.Tensor, epochs: dict[str, int]) -> AveragingResult:
    evidence = SimpleNamespace(received=1.0, my_slice={}, members=tuple(epochs))
    return AveragingResult([average], tuple(epochs), {peer: {"epoch": e} for peer, e in epochs.items()}, evidence)


def test_a_member_left_out_of_its_round_keeps_its_own_gradients():
    """T (epoch 5, weight 5) meets auxiliary X (epoch 6): the group's epoch is 6, so T sent zeros with weight 0 and
    X weight 0: the average is NaN (0/0). T must step with its own mean gradient, never the average."""
    own = torch.tensor([1.0, 2.0])
    gradient_rounds = rounds([own.clone()])
    round_ = GradientRound(gradient_rounds, Scheduled(ended(torch.full((2,), float("nan")), {"T": 5, "X": 6})))
    round_.weight = 5.0
    group = round_.result()
    assert torch.equal(gradient_rounds._buffers[0], own)
    assert not round_.contributed
    decision = protocol.sync_round(protocol.SyncRoundEvidence(5, 2, group=group, me="T"))
    assert decision.outcome.reason == "behind"  # (it downloads next: its gradients were left out)


def test_a_member_at_its_groups_epoch_installs_the_average():
    gradient_rounds = rounds([torch.tensor([1.0, 2.0])])
    round_ = GradientRound(gradient_rounds, Scheduled(ended(torch.tensor([3.0, 4.0]), {"T": 6, "X": 6})))
    round_.weight = 5.0
    round_.result()
    assert round_.contributed and torch.equal(gradient_rounds._buffers[0], torch.tensor([3.0, 4.0]))
    round_ = GradientRound(gradient_rounds, Scheduled(ended(torch.tensor([7.0, 8.0]), {"T": 6, "X": 6})))
    round_.weight = 0.0  # (an auxiliary peer, or one that tagged along)
    round_.result()
    assert not round_.contributed and torch.equal(gradient_rounds._buffers[0], torch.tensor([3.0, 4.0]))


def test_tagging_along_a_gradient_round_leaves_the_shared_buffers_alone():
    """The buffers are the epoch's accumulation (in place) or the offloaded optimizer's gradients: a failed round
    still steps with them. The round sends zeros of its own instead."""
    accumulated = torch.tensor([1.0, -2.0])
    gradient_rounds = rounds([accumulated.clone()])
    scheduled = Scheduled(AveragingResult(None, ("T", "X"), {}, None, "a member left"))
    control = GradientRound(gradient_rounds, scheduled)
    loop = SimpleNamespace(grad_averager=gradient_rounds, averaging_timeout=1.0, status_loglevel=logging.INFO)
    PeerLoop.tag_along(loop, control)
    assert scheduled.handed == [("zeros of its own", 0.0)] and control.weight == 0.0
    assert torch.equal(gradient_rounds._buffers[0], accumulated)


def test_a_download_waits_for_the_delayed_step_before_it_tags_along():
    """With delay_grad_averaging a background step may still read the buffers when a download leaves the round."""
    calls = []
    control = SimpleNamespace(done=lambda: False)
    optimizer = SimpleNamespace(
        scheduled_grads=control, tag_along=lambda round_: calls.append("tag along"),
        state_averager=SimpleNamespace(step=lambda **kwargs: calls.append(("step", kwargs)), local_epoch=3),
        tracker=SimpleNamespace(pause_updates=contextlib.nullcontext, report_local_progress=lambda **kwargs: None),
        state_downloads=SimpleNamespace(download=lambda **kwargs: calls.append("download")),
        grad_averager=None, load_state_timeout=1.0, local_epoch=3, reset_accumulation=lambda: None)
    sync_download._download_state_once(optimizer)
    assert calls == [("step", {"wait_for_delayed_updates": True}), "tag along", "download"]
    assert optimizer.scheduled_grads is None


class DiLoCoRound:
    triggered, group = False, ("a", "b")

    def __init__(self, error: BaseException):
        self.error, self.cancelled = error, False

    def done(self) -> bool:
        return self.cancelled

    def tag_along(self) -> None:
        self.triggered = True

    def result(self) -> None:
        raise self.error

    def cancel(self) -> None:
        self.cancelled = True


def diloco_loop(control: DiLoCoRound) -> DiLoCoLoop:
    loop = DiLoCoLoop.__new__(DiLoCoLoop)
    vars(loop).update(scheduled_grads=control, status_loglevel=logging.INFO)
    return loop


def test_a_failed_round_a_diloco_peer_skipped_does_not_end_its_training(caplog):
    control = DiLoCoRound(RuntimeError("a member of the group left"))
    with caplog.at_level(logging.INFO, logger="collabopt.engine.diloco_round"):
        diloco_loop(control)._leave_scheduled_round()
    assert control.triggered and control.cancelled
    assert "a member of the group left" in caplog.text


@pytest.mark.parametrize("stop", [Terminated(), KeyboardInterrupt()])
def test_sigterm_or_ctrl_c_while_a_diloco_peer_tags_along_ends_the_wait(stop):
    control = DiLoCoRound(stop)
    with pytest.raises(type(stop)):
        diloco_loop(control)._leave_scheduled_round()
    assert control.cancelled
