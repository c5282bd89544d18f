"""collabopt's PowerSGD rounds (engine.powersgd_rounds), in process: the math is hivemind's PowerSGDGradientAverager's
on the same inputs, error feedback keeps every gradient's mass, a round installs its average only where both phases
are whole, and a user's ``partial(PowerSGDGradientAverager, ...)`` maps onto collabopt's round. The rounds themselves
run in tests/swarm/test_swarm_powersgd.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import threading
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine.allreduce import AllReduceRound, RoundEvidence
from collabopt.engine.averager import AveragingResult
from collabopt.engine.averaging import gradient_averager_factory
from collabopt.engine.gradient_rounds import GradientRounds, RoundFailed
from collabopt.engine.powersgd_rounds import PowerSGDRound, PowerSGDRounds, PowerSGDState, powersgd_options
from collabopt.errors import ConfigurationError

# compressed at rank 2: (32, 16) and (3, 4, 5, 6) viewed as (12, 30); whole: a vector, (4, 32) (saves 44% of its
# elements, below min_compression_ratio 0.5) and (3, 3)
SHAPES = [(32, 16), (32,), (4, 32), (3, 3), (3, 4, 5, 6)]
RANK = 2


def grads_of(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def state(seed: int = 7) -> PowerSGDState:
    return PowerSGDState([(torch.Size(s), torch.float32) for s in SHAPES], RANK, seed=seed)


def mean(tensors: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    return [sum(w * t for w, t in zip(weights, column, strict=True)) / sum(weights)
            for column in zip(*tensors, strict=True)]


def collabopt_round(states: list[PowerSGDState], grads: list[list[torch.Tensor]],
                    weights: list[float]) -> list[list[torch.Tensor]]:
    """One round of collabopt's steps among ``states``, with a fake all-reduce (the weighted mean)."""
    pending = [s.phase_p(g) for s, g in zip(states, grads, strict=True)]
    averaged_ps = mean([ps for _, ps in pending], weights)
    phase_q = [s.phase_q(residuals, averaged_ps, g)
               for s, (residuals, _), g in zip(states, pending, grads, strict=True)]
    averaged = mean([tensors for _, tensors in phase_q], weights)
    return [s.finish(residuals, ps, averaged)
            for s, (residuals, _), (ps, _) in zip(states, pending, phase_q, strict=True)]


class FakeAllReduce:
    """hivemind's ``_run_allreduce_inplace_`` for peers in one event loop: every peer's tensors become the group's
    weighted mean once all of them came."""

    def __init__(self, size: int):
        self.size, self.calls, self.done = size, {}, {}

    async def __call__(self, peer: SimpleNamespace, tensors, group_info, group_id, peer_fractions, weight):
        calls = self.calls.setdefault(group_id, [])
        done = self.done.setdefault(group_id, asyncio.Event())
        calls.append((tensors, weight))
        if len(calls) == self.size:
            averaged = mean([[t.clone() for t in ts] for ts, _ in calls], [w for _, w in calls])
            for ts, _ in calls:
                for tensor, average in zip(ts, averaged, strict=True):
                    tensor.copy_(average)
            done.set()
        await done.wait()


def hivemind_peer(initial_qs: list[torch.Tensor], allreduce: FakeAllReduce) -> SimpleNamespace:
    """What ``PowerSGDGradientAverager._aggregate_with_group`` reads of its averager, its gradients in ``grads``."""
    peer = SimpleNamespace(rank=RANK, serializer=MSGPackSerializer, total_size=10**4, grads=None)
    sizes = [torch.Size(s) for s in SHAPES]
    peer._uncompressed_gradients_indexes = {i for i in range(len(SHAPES)) if i not in state().compressed}
    peer._ms = [torch.zeros(sizes[i]) for i in state().compressed]
    peer._qs = [q.clone() for q in initial_qs]
    peer.get_tensors = contextlib.contextmanager(lambda: (yield peer.grads))
    peer._run_allreduce_inplace_ = functools.partial(allreduce, peer)
    return peer


def hivemind_round(peers: list[SimpleNamespace], grads: list[list[torch.Tensor]], weights: list[float]) -> None:
    ids = [f"peer{i}".encode() for i in range(len(peers))]
    gathered = tuple(MSGPackSerializer.dumps([1.0, AveragingMode.NODE.value, MSGPackSerializer.dumps(None)])
                     for _ in peers)
    group = GroupInfo(group_id=b"group", peer_ids=tuple(ids), gathered=gathered)

    async def run():
        for peer, g in zip(peers, grads, strict=True):
            peer.grads = [t.clone() for t in g]
        await asyncio.gather(*(PowerSGDGradientAverager._aggregate_with_group(peer, group, 0, weight=w)
                               for peer, w in zip(peers, weights, strict=True)))

    asyncio.run(run())


def test_a_round_is_hivemind_powersgd_on_the_same_inputs():
    """Three rounds of two peers (weights 3 and 1): each round's gradients, residuals and Q matrices are those of
    hivemind's PowerSGDGradientAverager started from the same Q (error feedback and the warm start included)."""
    ours = [state(), state()]
    assert ours[0].compressed == (0, 4) and ours[0].whole == (1, 2, 3)
    assert all(torch.equal(a, b) for a, b in zip(ours[0].qs, ours[1].qs, strict=True))  # one seed, one Q
    allreduce = FakeAllReduce(2)
    theirs = [hivemind_peer(ours[0].qs, allreduce), hivemind_peer(ours[0].qs, allreduce)]
    weights = [3.0, 1.0]
    for step in range(3):
        allreduce.calls.clear()
        allreduce.done.clear()
        grads = [grads_of(10 * step + 1), grads_of(10 * step + 2)]
        installed = collabopt_round(ours, grads, weights)
        hivemind_round(theirs, grads, weights)
        for mine, peer in zip(ours, theirs, strict=True):
            for a, b in zip(installed[ours.index(mine)], peer.grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(mine.ms + mine.qs, peer._ms + peer._qs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(*installed, strict=True))  # the members' gradients: the same
        assert any(m.abs().sum() > 0 for m in ours[0].ms)  # (rank 2 leaves a residual to feed back)


def test_phase_q_hands_the_round_contiguous_copies_of_a_transposed_parameters_gradient():
    # a parameter made as another tensor's transpose keeps those strides, and so does its gradient buffer
    # (zeros_like); the all-reduce cuts its tensors as flat views, which a non-contiguous tensor cannot give
    grads = grads_of(1)
    grads[3] = grads[3].t()  # (3, 3), averaged whole
    assert not grads[3].is_contiguous()
    ours = state()
    residuals, ps = ours.phase_p(grads)
    _, tensors = ours.phase_q(residuals, ps, grads)
    assert all(t.is_contiguous() for t in tensors)
    whole = tensors[len(ours.qs):]
    assert all(torch.equal(t, grads[i]) and t.data_ptr() != grads[i].data_ptr()
               for t, i in zip(whole, ours.whole, strict=True))
    AllReduceRound(group_id=b"g", members=[PeerID(b"a")], me=0, tensors=tensors, weight=1.0, stub_for=None,
                   fractions=[1.0])  # (cuts them: no error)


def test_a_parameter_with_a_zero_dimension_is_averaged_whole():
    # (0, 5) has no element: no factors to save anything; hivemind's rule divided by its 0 elements
    shapes = [(0, 5), (32, 16), (4, 0, 3)]
    ours = PowerSGDState([(torch.Size(s), torch.float32) for s in shapes], RANK, seed=1)
    assert ours.compressed == (1,) and ours.whole == (0, 2)
    grads = [torch.randn(s) for s in shapes]
    (installed,) = collabopt_round([ours], [grads], [1.0])
    assert [t.shape for t in installed] == [torch.Size(s) for s in shapes]
    residuals, ps = ours.phase_p(grads)
    _, tensors = ours.phase_q(residuals, ps, grads)
    AllReduceRound(group_id=b"g", members=[PeerID(b"a")], me=0, tensors=tensors, weight=1.0, stub_for=None,
                   fractions=[1.0])  # (cuts them: no error)


def test_error_feedback_keeps_every_gradients_mass():
    """A peer alone (the average is its own): over several rounds, what was installed plus the residual left is
    the sum of its gradients, while each round installed only a rank-2 approximation of the compressed ones."""
    peer = state()
    total = [torch.zeros(s) for s in SHAPES]
    installed_sum = [torch.zeros(s) for s in SHAPES]
    for step in range(5):
        grads = grads_of(step)
        (installed,) = collabopt_round([peer], [grads], [1.0])
        for acc, out in zip(installed_sum, installed, strict=True):
            acc += out
        for acc, g in zip(total, grads, strict=True):
            acc += g
        assert not torch.allclose(installed[0], grads[0], atol=1e-3)  # (compressed: an approximation)
        assert torch.equal(installed[1], grads[1])  # (averaged whole)
    for k, i in enumerate(peer.compressed):
        torch.testing.assert_close(installed_sum[i] + peer.ms[k], total[i], rtol=1e-5, atol=1e-5)


# ---- the all-or-nothing rule of a round (PowerSGDRound, with fake phases)

class Scheduled:
    """A ScheduledRound whose phase P ends as ``received`` says."""

    def __init__(self, received: float):
        self.received, self.triggered, self.began_allreduce, self.group, self.timeout = received, False, True, None, 5
        self.handed: list = []

    def run(self, tensors, weight: float) -> None:
        self.triggered = True
        self.handed.append(([t.clone() for t in tensors], weight))

    def tag_along(self) -> None:
        self.triggered = True
        self.handed.append((None, 0.0))

    def done(self) -> bool:
        return self.triggered

    def cancel(self) -> None:
        pass

    def result(self, timeout: float | None = None) -> AveragingResult:
        tensors, _ = self.handed[-1]
        return AveragingResult([t * 2 for t in tensors], ("T", "X"), {"T": {"epoch": 3}, "X": {"epoch": 3}},
                               evidence(self.received))


def evidence(received: float) -> RoundEvidence:
    return RoundEvidence(group_id=b"g", members=("T", "X"), me=0, received=received, results_from={},
                         contributions=(1.0, 1.0), missing=(), my_slice={}, errors={})


def fake_rounds(buffers: list[torch.Tensor]) -> PowerSGDRounds:
    made = PowerSGDRounds.__new__(PowerSGDRounds)
    made._buffers, made._lock = buffers, threading.RLock()
    made.powersgd = state()
    made._last = None
    made.service = SimpleNamespace(p2p=SimpleNamespace(peer_id="T"), reducer_timeout=1.0)
    return made


@pytest.mark.parametrize("p_received, q_received", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.5)])
def test_a_round_installs_its_average_only_where_both_phases_are_whole(monkeypatch, p_received, q_received):
    buffers = grads_of(1)
    rounds = fake_rounds([b.clone() for b in buffers])
    ms, qs = copy.deepcopy(rounds.powersgd.ms), copy.deepcopy(rounds.powersgd.qs)
    sent = []

    def phase_q(self, first, tensors, weight):
        sent.append(([t.clone() for t in tensors], weight))
        return [t + 1 for t in tensors], evidence(q_received)

    monkeypatch.setattr(PowerSGDRound, "_phase_q", phase_q)
    round_ = PowerSGDRound(rounds, Scheduled(p_received))
    round_.weight = 4.0
    round_.allow_allreduce()
    gathered = round_.result(5)
    whole = p_received == 1.0 and q_received == 1.0
    assert (gathered["T"].get("received", 1.0) == 1.0) is whole
    # phase Q ran in every case (the others' stays whole): with this peer's values only where its phase P was whole
    assert len(sent) == 1 and sent[0][1] == (4.0 if p_received == 1.0 else 0.0)
    if p_received < 1.0:
        assert all(not t.any() for t in sent[0][0])
    changed = [not torch.equal(a, b) for a, b in zip(ms, rounds.powersgd.ms, strict=True)]
    assert all(changed) if whole else not any(changed)  # the residual moves only with an installed round
    q_moved = [not torch.equal(a, b) for a, b in zip(qs, rounds.powersgd.qs, strict=True)]
    assert all(q_moved) if q_received == 1.0 else not any(q_moved)  # a whole phase Q: the group's Q
    with rounds.get_tensors() as now:
        same = all(torch.equal(a, b) for a, b in zip(now, buffers, strict=True))
    assert same is not whole  # a partial round leaves this peer's own gradients to step with


def test_a_round_given_up_before_it_ended_leaves_the_residual():
    """The loop stopped waiting (its timeout): the round's late whole result is not installed, and the residual
    keeps this epoch's gradients out (the peer stepped with them, whole)."""
    rounds = fake_rounds(grads_of(1))
    ms = copy.deepcopy(rounds.powersgd.ms)
    release = threading.Event()
    scheduled = Scheduled(1.0)
    late = scheduled.result
    scheduled.result = lambda timeout=None: (release.wait(), late())[1]
    round_ = PowerSGDRound(rounds, scheduled)
    round_._phase_q = lambda first, tensors, weight: ([t + 1 for t in tensors], evidence(1.0))
    round_.weight = 4.0
    round_.allow_allreduce()
    with pytest.raises(concurrent.futures.TimeoutError):
        round_.result(0.1)
    release.set()
    round_._phases.result(5)
    assert all(torch.equal(a, b) for a, b in zip(ms, rounds.powersgd.ms, strict=True))


def test_a_peers_rounds_run_one_after_the_other():
    """Each round reads the residual the last one left: a round handed its tensors waits for the last one's end."""
    rounds, order, gate = fake_rounds(grads_of(1)), [], threading.Event()
    first = rounds.submit(lambda: (gate.wait(10), order.append(1)))
    second = rounds.submit(lambda: order.append(2))
    assert not concurrent.futures.wait([second], timeout=0.2).done and order == []
    gate.set()
    second.result(10)
    assert first.done() and order == [1, 2]


def test_a_fault_in_a_round_is_its_failure_not_a_raise(monkeypatch):
    rounds = fake_rounds(grads_of(1))
    monkeypatch.setattr(PowerSGDRound, "_phase_q", lambda *_: 1 / 0)  # (a bug of phase Q's: caught as a failure)
    round_ = PowerSGDRound(rounds, Scheduled(1.0))
    round_.weight = 4.0
    round_.allow_allreduce()
    assert isinstance(round_.exception(), RoundFailed) and "ZeroDivisionError" in str(round_.exception())
    monkeypatch.setattr(PowerSGDRound, "_run", lambda *_: 1 / 0)  # (one of the round itself)
    round_ = PowerSGDRound(rounds, Scheduled(1.0))
    round_.allow_allreduce()
    assert isinstance(round_.exception(), RoundFailed)
    with pytest.raises(RoundFailed):
        round_.result(5)


# ---- the user's factory

def test_a_partial_of_hiveminds_powersgd_runs_collabopts_round():
    factory = functools.partial(PowerSGDGradientAverager, averager_rank=2, min_compression_ratio=0.3, warn=False)
    assert powersgd_options(factory) == dict(averager_rank=2, min_compression_ratio=0.3)
    made = gradient_averager_factory(factory, 1.5)
    assert made.func is PowerSGDRounds and made.keywords == dict(averager_rank=2, min_compression_ratio=0.3,
                                                                 request_timeout=1.5)
    assert powersgd_options(GradientAverager) is None  # any other factory: as it is
    assert gradient_averager_factory(GradientAverager, None).func is GradientAverager
    assert gradient_averager_factory(None, None).func is GradientRounds


@pytest.mark.parametrize("factory, named", [
    (PowerSGDGradientAverager, "averager_rank"),
    (functools.partial(PowerSGDGradientAverager, averager_rank=0), "averager_rank"),
    (functools.partial(PowerSGDGradientAverager, averager_rank=2, averaged_grads=()), "averaged_grads"),
    (functools.partial(PowerSGDGradientAverager, (), averager_rank=2), "positional"),
])
def test_options_collabopts_round_does_not_take_are_refused_by_name(factory, named):
    with pytest.raises(ConfigurationError, match=named) as raised:
        powersgd_options(factory)
    assert raised.value.parameter == "grad_averager_factory"
