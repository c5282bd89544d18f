"""Compressed DiLoCo rounds (collabopt.engine.diloco_averaging.SparsePseudoGradientRounds) without a network: the
error feedback keeps what a payload left out only once the round is applied, and is as before it otherwise; the
aggregate a member writes is the one of the agreed set (anchors that are not the group's at weight 0, a payload that
does not decode left out); what the exchange left reaches the round's decision as evidence; the DiLoCo loop settles
every round it decided."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from collabopt.diloco_metadata import anchor_metadata
from collabopt.diloco_options import SparseLoCo
from collabopt.engine import diloco_averaging, protocol
from collabopt.engine.diloco_averaging import SparsePseudoGradientRounds
from collabopt.engine.gather_exchange import Contribution, ExchangeResult
from collabopt.interface import RoundOutcome
from collabopt.sparse_aggregation import aggregate

SPARSE = SparseLoCo(density=0.05, chunk_size=64, bits=2, error_decay=0.9)
SHAPES = [(16, 20), (50,)]


class FakeService:
    def __init__(self, dht, **options):
        self.options = options
        self.p2p = SimpleNamespace(peer_id="a")

    def schedule(self, timeout, gather, admits=None):
        return FakeControl()

    def close(self):
        pass


class FakeControl:
    def __init__(self):
        self.sent = None

    def run(self, payload, weight=1.0):
        self.sent = (payload, weight)

    def tag_along(self):
        self.run(b"", 0.0)


@pytest.fixture
def rounds(monkeypatch):
    monkeypatch.setattr(diloco_averaging, "ExchangeService", FakeService)
    return SparsePseudoGradientRounds(dht=None, prefix="run_grad_averager", sparse=SPARSE,
                                      parameters=[torch.zeros(shape) for shape in SHAPES])


def pseudo_gradient(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def contribute(rounds, delta, weight=10.0):
    with rounds.get_tensors() as buffers:
        for buffer, d in zip(buffers, delta, strict=True):
            buffer.copy_(d)
    control = rounds.schedule(timeout=1.0, gather=None)
    rounds.run(control, weight)
    return control.sent


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_buffer_keeps_what_was_left_out_only_when_the_round_is_applied(rounds):
    codec, feedback = SPARSE.codec, rounds.error_feedback
    first = pseudo_gradient(1)
    payload, weight = contribute(rounds, first)
    assert weight == 10.0 and feedback.staged
    sent = codec.decode(payload, SHAPES)
    rounds.settle(True)  # applied: e = 0.9 * 0 + delta - sent
    kept = [b.clone() for b in feedback.buffers]
    assert same(kept, [d - s for d, s in zip(first, sent, strict=True)])
    assert any(bool(k.abs().max() > 0) for k in kept) and not feedback.staged

    second = pseudo_gradient(2)
    discarded, _ = contribute(rounds, second)
    rounds.settle(False)  # not applied: the buffer is as before the round
    assert same(feedback.buffers, kept) and not feedback.staged
    again, _ = contribute(rounds, second)  # the retried round sends what the dropped one sent
    assert again == discarded
    expected = codec.encode([0.9 * k + d for k, d in zip(kept, second, strict=True)])
    assert again == expected


def test_a_peer_of_weight_zero_sends_nothing_and_its_buffer_stays(rounds):
    contribute(rounds, pseudo_gradient(1))
    rounds.settle(True)
    kept = [b.clone() for b in rounds.error_feedback.buffers]
    contribute(rounds, pseudo_gradient(2))  # staged, then a round of weight 0 replaces it
    assert contribute(rounds, pseudo_gradient(3), weight=0.0) == (b"", 0.0)
    rounds.settle(True)
    assert same(rounds.error_feedback.buffers, kept)


def metadata(epoch, anchor_seed):
    return anchor_metadata(epoch, [torch.full((3,), float(anchor_seed))])


def exchange_result(members, error=None, sent_bytes=100, contributed=True, contributors=None):
    """``members``: (peer, weight, payload, anchor seed)."""
    gathered = {peer: metadata(4, seed) for peer, _, _, seed in members}
    applied = None if error else tuple(Contribution(peer, payload, weight, b"") for peer, weight, payload, _ in members)
    return ExchangeResult(applied, (), tuple(gathered), gathered, error, sent_bytes, sent_bytes,
                          contributed=contributed, contributors=contributors)


def decide(rounds, result, me="a", weight=10.0):
    evidence = rounds.report(result)
    sent = (evidence.group or {}).get(me, {})
    return protocol.diloco_round(dataclasses.replace(evidence, epoch=4, num_peers=3, weight=weight, me=me,
                                                     sent=sent))


def test_the_aggregate_of_the_agreed_set_reaches_the_buffers(rounds):
    codec = SPARSE.codec
    payloads = {name: codec.encode(pseudo_gradient(seed)) for seed, name in enumerate("abcd")}
    broken = payloads["c"][:-1]  # does not decode: left out by every member alike
    members = [("a", 10.0, payloads["a"], 0), ("b", 30.0, payloads["b"], 0), ("c", 5.0, broken, 0),
               ("d", 20.0, payloads["d"], 1), ("e", 10.0, payloads["a"], 0)]  # d: another anchor
    decision = decide(rounds, exchange_result(members))
    expected = aggregate({"a": (10.0, payloads["a"]), "b": (30.0, payloads["b"]), "e": (10.0, payloads["a"])},
                         SHAPES, codec)
    with rounds.get_tensors() as buffers:
        assert same(buffers, expected)
    assert decision.outcome.applied and decision.outcome.reason == "averaged"
    assert not decide(rounds, exchange_result(members), me="d").outcome.applied  # (anchor differs: d applies none)


def test_a_member_the_robust_aggregate_left_out_applies_the_round_and_keeps_its_whole_update(monkeypatch):
    """With centered_clip a member whose pseudo-gradient points away from the others' is left out by every member
    alike; it applies the others' aggregate like them, and its buffer keeps all of its round (nothing of it was
    sent into the anchor)."""
    monkeypatch.setattr(diloco_averaging, "ExchangeService", FakeService)
    rounds = SparsePseudoGradientRounds(dht=None, prefix="run_grad_averager", sparse=SPARSE,
                                        aggregation="centered_clip",
                                        parameters=[torch.zeros(shape) for shape in SHAPES])
    codec, common = SPARSE.codec, pseudo_gradient(0)
    honest = {name: [c + 0.5 * d for c, d in zip(common, pseudo_gradient(seed), strict=True)]
              for seed, name in enumerate("bcd", start=1)}
    mine = [-c for c in common]
    payload, _ = contribute(rounds, mine)
    members = [("a", 10.0, payload, 0)] + [(name, 10.0, codec.encode(delta), 0) for name, delta in honest.items()]
    decision = decide(rounds, exchange_result(members))
    assert decision.outcome.applied and decision.outcome.weight == 0.0 and "left" in decision.outcome.detail
    expected = aggregate({name: (10.0, codec.encode(delta)) for name, delta in honest.items()}, SHAPES, codec,
                         "centered_clip")
    with rounds.get_tensors() as buffers:
        assert same(buffers, expected)
    rounds.settle(True)
    assert all(torch.allclose(b, m, atol=1e-6) for b, m in zip(rounds.error_feedback.buffers, mine, strict=True))


def test_a_member_that_may_not_apply_after_its_offers_went_out_downloads_first(rounds):
    members = [("a", 10.0, b"x", 0), ("b", 10.0, b"y", 0)]
    after_offers = decide(rounds, exchange_result(members, error="only 1 of 3 members confirmed this set"))
    assert not after_offers.outcome.applied and after_offers.may_have_delivered and after_offers.needs_sync
    before = decide(rounds, exchange_result(members, error="no group assembled", sent_bytes=0))
    assert not before.outcome.applied and not before.may_have_delivered and not before.needs_sync


def test_a_member_not_chosen_to_contribute_applies_the_round_and_keeps_its_whole_pseudo_gradient(rounds):
    """max_contributors: a member not chosen sent the empty payload with its weight (the exchange sends it instead of
    its payload); it applies the contributors' aggregate, in which every waiting member of the set whose anchor is the
    group's counts as zeros, its samples count, and its error feedback keeps all of its pseudo-gradient, undecayed
    (e + delta), for a later round. A round it could not apply leaves the buffer as before and owes no download
    (nothing of it went out)."""
    codec, feedback = SPARSE.codec, rounds.error_feedback
    contribute(rounds, pseudo_gradient(1))
    rounds.settle(True)
    before = [b.clone() for b in feedback.buffers]
    delta = pseudo_gradient(2)
    contribute(rounds, delta)
    others = {name: codec.encode(pseudo_gradient(seed)) for seed, name in enumerate("bc", start=3)}
    members = [("a", 10.0, b"", 0)] + [(name, 10.0, payload, 0) for name, payload in others.items()] + [
        ("d", 99.0, b"", 0), ("e", 10.0, b"", 1), ("f", 0.0, b"", 0)]  # (d waits too, one zero whatever it claims;
    # e's anchor is not the group's and f trained nothing: neither counts)
    decision = decide(rounds, exchange_result(members, contributed=False, contributors=("b", "c")))
    assert decision.outcome.applied and decision.outcome.weight == 10.0
    assert "not one of this round's contributors" in decision.outcome.detail
    with rounds.get_tensors() as buffers:
        expected = aggregate({n: (10.0, p) for n, p in others.items()}, SHAPES, codec, waiting=2)
        assert same(buffers, expected)
        assert same(expected, [t * 0.5 for t in aggregate({n: (10.0, p) for n, p in others.items()}, SHAPES, codec)])
    rounds.settle(True)
    kept = [b + d for b, d in zip(before, delta, strict=True)]
    assert all(torch.allclose(b, k, atol=1e-6) for b, k in zip(feedback.buffers, kept, strict=True))
    contribute(rounds, pseudo_gradient(5))
    failed = decide(rounds, exchange_result(members, error="only 1 of 3 members confirmed this set",
                                            contributed=False))
    assert not failed.outcome.applied and not failed.may_have_delivered and not failed.needs_sync
    kept = [b.clone() for b in feedback.buffers]
    rounds.settle(False)
    assert same(feedback.buffers, kept) and not feedback.staged


class Settled(list):
    def settle(self, applied):
        self.append(applied)

    def reset_accumulated_grads_(self):
        pass

    def report(self, result):
        return result


def loop_with(settled, **parts):
    from collabopt.engine.diloco_round import DiLoCoLoop

    loop = DiLoCoLoop.__new__(DiLoCoLoop)
    vars(loop).update(grad_averager=settled, status_loglevel=10, _share_state=lambda: None,
                      _fetch_progress_now=lambda: None, **parts)
    return loop


@pytest.mark.parametrize("applied", [True, False])
def test_the_loop_settles_every_round_it_decided(applied, monkeypatch):
    from collabopt.engine.diloco_round import DiLoCoLoop

    monkeypatch.setattr(DiLoCoLoop, "num_peers", property(lambda self: 2))
    outcome = RoundOutcome(applied, "averaged" if applied else "averaging failed")
    tracker = SimpleNamespace(pause_updates=contextlib.nullcontext, update_epoch=lambda new_epoch: None,
                              report_local_progress=lambda *a, **k: None,
                              global_progress=SimpleNamespace(samples_accumulated=0, eta_next_epoch=0.0))
    settled = Settled()
    state_averager = SimpleNamespace(local_epoch=3, closed_for_downloads=contextlib.nullcontext)
    loop = loop_with(settled, _in_flight=None, tracker=tracker, state_averager=state_averager,
                     diloco=SimpleNamespace(overlap=False, run_round=lambda swarm: outcome, needs_sync=False))
    loop.step_decision = lambda: SimpleNamespace(download=False)
    loop.end_epoch()
    assert settled == [applied]

    settled = Settled()  # overlap: the round in flight lands, or is dropped
    control = SimpleNamespace(done=lambda: True, result=lambda: "result")
    loop = loop_with(settled, _in_flight=control, _sharing_paused=False,
                     state_averager=SimpleNamespace(allow_state_sharing=True, local_epoch=5),
                     diloco=SimpleNamespace(land_round=lambda swarm, result: outcome, pending=object()))
    loop.land(wait=True)
    loop._in_flight = control
    loop.land(wait=True, apply=False)
    assert settled == [applied, False]
