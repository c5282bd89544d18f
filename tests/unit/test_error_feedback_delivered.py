"""Compressed DiLoCo, a member whose payload went out but that may not apply the set: the others may apply the round,
so the error feedback's update is held (not dropped) until a state download tells (collabopt.diloco.DiLoCo's
``restore_after_download``). Applied by the others: the buffer is the held update (nothing the compression dropped is
lost, nothing sent counts twice); not applied, or taken as not applied: the buffer is as before the round. A new
round before the truth builds on the committed buffer; a checkpoint holds the committed buffer only."""

from __future__ import annotations

import logging

import pytest
import torch

from collabopt.diloco import UNDECIDED_DOWNLOADS, DiLoCo
from collabopt.diloco_metadata import anchor_metadata
from collabopt.diloco_options import SparseLoCo
from collabopt.engine import diloco_averaging
from collabopt.engine.diloco_averaging import SparsePseudoGradientRounds
from collabopt.engine.diloco_round import DiLoCoLoop
from collabopt.engine.gather_exchange import ExchangeResult

SPARSE = SparseLoCo(density=0.05, chunk_size=64, bits=2, error_decay=0.9)
SHAPES = [(16, 20), (50,)]


class FakeService:
    def __init__(self, dht, **options):
        pass

    def schedule(self, timeout, gather, admits=None):
        return FakeControl()

    def close(self):
        pass


class FakeControl:
    sent = None

    def run(self, payload, weight=1.0):
        self.sent = (payload, weight)

    def tag_along(self):
        self.run(b"", 0.0)


def randn(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


class CompressedSwarm:
    """A :class:`collabopt.diloco.RoundSwarm` of peer "a" among 3, its rounds :class:`SparsePseudoGradientRounds`
    on a fake exchange that ends after this peer's offers went out, with the set confirmed by too few members."""

    settle_delivered = DiLoCoLoop.settle_delivered  # (the loop's own forwarding to its rounds)
    _settle = DiLoCoLoop._settle

    def __init__(self, rounds: SparsePseudoGradientRounds):
        self.grad_averager, self.peer_id, self.num_peers, self.local_epoch = rounds, "a", 3, 4
        self.anchors = randn(100)
        self.parameters = [a.clone() for a in self.anchors]
        self.payloads: list[bytes] = []

    def buffers(self):
        return self.grad_averager.get_tensors()

    def average(self, weight):
        self.hand_over(weight)
        return self.partial_result(self.local_epoch)

    def hand_over(self, weight):
        control = self.grad_averager.schedule(timeout=1.0, gather=None)
        self.grad_averager.run(control, weight)
        self.payloads.append(control.sent[0])

    def partial_result(self, epoch):
        """The exchange of the round of ``epoch`` ended after this peer's offers went out, the set not applied here."""
        gathered = {peer: anchor_metadata(epoch, self.anchors) for peer in "abc"}
        return self.grad_averager.report(ExchangeResult(None, (), tuple(gathered), gathered,
                                                        "only 1 of 3 members confirmed this set", 100, 100))

    def skip_averaging(self):
        pass

    def reanchor(self, source=None):
        for a, p in zip(self.anchors, source or self.parameters, strict=True):
            a.copy_(p)

    def train(self, seed):
        """Inner steps: the parameters move by ``-delta``; returns ``delta``."""
        delta = randn(seed)
        for p, d in zip(self.parameters, delta, strict=True):
            p.sub_(d)
        return delta

    def download(self, epoch, anchor_moved):
        """A state download of ``epoch``; the anchor moved by the round where ``anchor_moved``."""
        for a in self.anchors:
            a.add_(0.5 if anchor_moved else 0.0)
        for p, a in zip(self.parameters, self.anchors, strict=True):
            p.copy_(a)
        self.local_epoch = epoch


@pytest.fixture
def swarm(monkeypatch):
    monkeypatch.setattr(diloco_averaging, "ExchangeService", FakeService)
    rounds = SparsePseudoGradientRounds(dht=None, prefix="run_grad_averager", sparse=SPARSE,
                                        parameters=[torch.zeros(shape) for shape in SHAPES])
    rounds.error_feedback.buffers = randn(7)  # what earlier rounds left out
    return CompressedSwarm(rounds)


def partial_round(swarm, diloco, seed=1):
    """A round whose payload went out while this peer may not apply the set; returns (old buffer, held update)."""
    feedback = swarm.grad_averager.error_feedback
    old = [b.clone() for b in feedback.buffers]
    delta = swarm.train(seed)
    diloco.pending_samples = 24
    outcome = diloco.run_round(swarm)
    swarm._settle(outcome.applied)  # (as DiLoCoLoop.end_epoch does)
    assert not outcome.applied and diloco.delivered is not None and diloco.needs_sync
    sent = SPARSE.codec.decode(swarm.payloads[-1], SHAPES)
    update = [0.9 * e + d - s for e, d, s in zip(old, delta, sent, strict=True)]
    return old, update


def new_diloco(overlap=False):
    return DiLoCo(torch.optim.SGD([torch.zeros(1)], lr=1.0), overlap=overlap)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("downloads, buffer", [
    ([(5, True)], "update"),  # a later epoch, the anchor moved: the others applied the round
    ([(5, False)], "old"),  # a later epoch, the same anchor: they did not
    ([(4, True)] * (UNDECIDED_DOWNLOADS - 1) + [(5, True)], "update"),  # the round's own epoch tells nothing
    ([(4, False)] * UNDECIDED_DOWNLOADS, "old"),  # no download told: taken as not applied
])
def test_the_held_update_follows_what_the_download_tells(swarm, downloads, buffer):
    diloco, feedback = new_diloco(), swarm.grad_averager.error_feedback
    old, update = partial_round(swarm, diloco)
    assert feedback.held and same(feedback.buffers, old)
    for epoch, moved in downloads:
        assert feedback.held  # (until a download tells, or the last one is taken as not applied)
        progress, since = diloco.progress_to_keep(swarm)
        swarm.download(epoch, moved and epoch > 4)
        diloco.restore_after_download(swarm, progress, since, downloaded=True, anchor_moved=moved and epoch > 4)
    assert not feedback.held and not feedback.staged and diloco.delivered is None
    torch.testing.assert_close(feedback.buffers, update if buffer == "update" else old, rtol=0, atol=1e-6)
    if buffer == "old":
        assert same(feedback.buffers, old)


def test_a_new_round_before_the_truth_builds_on_the_committed_buffer(swarm):
    diloco, feedback = new_diloco(), swarm.grad_averager.error_feedback
    old, _ = partial_round(swarm, diloco)
    swarm.train(2)  # no download (e.g. it failed and the peer went on): the next round is taken as the truth
    expected = SPARSE.codec.encode([0.9 * e + (a - p) for e, a, p in zip(old, swarm.anchors, swarm.parameters,
                                                                         strict=True)])
    diloco.run_round(swarm)
    assert swarm.payloads[-1] == expected  # the whole progress since the anchor, on the old buffer
    assert same(feedback.buffers, old)  # (this round's update is held in turn)


@pytest.mark.parametrize("forget", ["restart (non-finite parameters)", "reanchor (a checkpoint loaded)"])
def test_a_peer_that_forgets_the_round_takes_it_as_not_applied(swarm, forget):
    diloco, feedback = new_diloco(), swarm.grad_averager.error_feedback
    old, _ = partial_round(swarm, diloco)
    if forget.startswith("restart"):
        diloco.restart_from_last_round(swarm)
    else:
        diloco.reanchor(swarm)
    assert not feedback.held and not feedback.staged and same(feedback.buffers, old) and diloco.delivered is None


def test_a_checkpoint_holds_the_committed_buffer_while_an_update_is_held(swarm):
    diloco, feedback = new_diloco(), swarm.grad_averager.error_feedback
    old, update = partial_round(swarm, diloco)
    assert same(feedback.state_dict()["buffers"], old)
    swarm.grad_averager.settle_delivered(True)
    torch.testing.assert_close(feedback.state_dict()["buffers"], update, rtol=0, atol=1e-6)


def test_a_round_settled_otherwise_is_not_held(swarm):
    """Applied here: committed at once; its payload never went out: dropped at once (nothing waits)."""
    rounds, feedback = swarm.grad_averager, swarm.grad_averager.error_feedback
    feedback.compress(randn(3))
    rounds.settle(True)
    assert not feedback.staged
    committed = [b.clone() for b in feedback.buffers]
    feedback.compress(randn(4))
    rounds._went_out = False
    rounds.settle(False)
    assert not feedback.staged and same(feedback.buffers, committed)
    rounds.settle_delivered(True)  # nothing held: nothing changes
    assert same(feedback.buffers, committed)


def test_the_warning_does_not_say_part_of_an_average_arrived(swarm, caplog):
    """A compressed round's member that may not apply the set received no average at all: the warning of a round
    that may have reached the others says what it knows in either mode."""
    with caplog.at_level(logging.WARNING, logger="collabopt.diloco"):
        partial_round(swarm, new_diloco())
    warnings = [r.getMessage() for r in caplog.records if r.name == "collabopt.diloco"]
    assert any("its pseudo-gradient may have reached the others" in w for w in warnings)
    assert not any("average did not arrive" in w for w in warnings)


def overlapped_round(swarm, diloco, seed=1):
    """overlap_rounds: this peer's round of epoch 4 starts (its payload goes out, the epoch moves on to 5); returns
    (old buffer, the round's update of it, the training step's delta)."""
    feedback = swarm.grad_averager.error_feedback
    old = [b.clone() for b in feedback.buffers]
    delta = swarm.train(seed)
    diloco.pending_samples = 24
    swarm.hand_over(diloco.start_round(swarm))
    swarm.local_epoch += 1  # (as DiLoCoLoop._start_overlapped_round does)
    sent = SPARSE.codec.decode(swarm.payloads[-1], SHAPES)
    return old, [0.9 * e + d - s for e, d, s in zip(old, delta, sent, strict=True)], delta


def test_a_restart_while_a_round_is_in_flight_leaves_its_update_to_the_round(swarm):
    """overlap_rounds: the parameters turn non-finite while the round runs; the peer restarts from the round's base,
    which settles no held update (none is): the round's own update stays staged for the round's decision."""
    diloco, feedback = new_diloco(overlap=True), swarm.grad_averager.error_feedback
    _, update, _ = overlapped_round(swarm, diloco)
    swarm.parameters[0][0, 0] = float("nan")
    diloco.restart_from_last_round(swarm)
    assert feedback.staged and not feedback.held
    swarm.grad_averager.settle(True)  # the round lands, applied
    torch.testing.assert_close(feedback.buffers, update, rtol=0, atol=1e-6)


def test_an_overlapped_round_not_applied_here_is_held_until_a_download_tells(swarm):
    """overlap_rounds: the round lands not applied after its payload went out; the download of a state whose anchor
    moved (the others applied it) commits the update and keeps only the progress made since the round started."""
    diloco, feedback = new_diloco(overlap=True), swarm.grad_averager.error_feedback
    old, update, _ = overlapped_round(swarm, diloco)
    later = swarm.train(2)  # inner steps while the round runs
    outcome = diloco.land_round(swarm, swarm.partial_result(4))
    swarm._settle(outcome.applied)  # (as DiLoCoLoop.land does)
    assert not outcome.applied and diloco.delivered is not None and diloco.needs_sync
    assert feedback.held and same(feedback.buffers, old)
    progress, since = diloco.progress_to_keep(swarm)
    swarm.download(5, anchor_moved=True)
    assert not diloco.restore_after_download(swarm, progress, since, downloaded=True, anchor_moved=True)
    assert not feedback.held and diloco.delivered is None
    torch.testing.assert_close(feedback.buffers, update, rtol=0, atol=1e-6)
    torch.testing.assert_close([p - a for p, a in zip(swarm.parameters, swarm.anchors, strict=True)],
                               [-d for d in later], rtol=0, atol=1e-6)
