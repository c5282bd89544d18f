"""The training state's failures and shutdown (collabopt/engine/training_state.py, parameter_rounds.py): a failed
optimizer step is raised and its epoch not served; a peer without parameter rounds shuts down once. The parameter
rounds on a stand-in averaging service: the averaged tensors' lock is free during matchmaking and never taken on the
service's event loop; a round that outlives its wait is installed by the next step, unless a download or a newer
round replaced the tensors it was handed."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import TensorRole

from collabopt.engine import parameter_rounds
from collabopt.engine.averager import AveragingResult
from collabopt.engine.parameter_rounds import NoRounds, ParameterRound, ParameterRounds
from collabopt.engine.state import ConsistentStateAverager
from collabopt.engine.training_state import TrainingState


class Scheduled:
    triggered = began_allreduce = False

    def cancel(self):
        pass

    def done(self):
        return False


@pytest.mark.parametrize("averaging", [dict(), dict(averaging_round=True, delay_averaging=True)],
                         ids=["step", "step, round in the background"])
def test_an_optimizer_step_that_raises_is_raised_and_its_epoch_is_not_served(averaging):
    model = torch.nn.Linear(3, 2)
    rounds = SimpleNamespace(schedule=lambda *args: ParameterRound(Scheduled(), 1), shutdown=lambda: None)
    state = TrainingState(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), rounds=rounds)

    def fails():
        raise FloatingPointError("the step failed")

    state.optimizer.step = fails
    with pytest.raises(FloatingPointError):
        state.step(increment_epoch=True, optimizer_step=True, **averaging)
    assert state.local_epoch == 1 and state.served_epoch() == 0  # (its parameters hold no update of epoch 1)
    assert not state.pending_updates
    state.shutdown()


def test_a_peer_without_parameter_rounds_is_not_alive_after_its_shutdown():
    model = torch.nn.Linear(3, 2)
    state = TrainingState(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), rounds=NoRounds())
    assert state.is_alive()
    state.shutdown()
    assert not state.is_alive()


# ---- rounds on a stand-in averaging service: when the averaged tensors' lock is taken, and by whom; which round's
# average may write them


class Service:
    """Stand-in for :class:`~collabopt.engine.averager.AveragingService`: each round's group assembles at once
    (``assemble``) or when the test calls :meth:`Round.assemble`; its all-reduce ends with the next of ``averages``
    once it has the group and the tensors (with none left: when the test calls :meth:`Round.end`)."""

    def __init__(self, dht, *, on_group=None, **options):
        self.on_group, self.p2p, self.closed, self.rounds = on_group, SimpleNamespace(peer_id="me"), False, []
        self.assemble, self.averages = True, []

    def schedule(self, template, *, timeout, gather, contributes, target_group_size, admits, infos=None):
        scheduled = Round(self, gather, self.averages.pop(0) if self.averages else None)
        scheduled.infos = infos
        self.rounds.append(scheduled)
        if self.assemble:
            scheduled.group = ("me", "other")
        return scheduled

    def close(self):
        self.closed = True


class Round:
    """A scheduled round: ``asked`` is set once the caller waits for its group or its result; ``result()`` waits
    for its end where ``blocking``, else a round under way outlives any wait."""

    def __init__(self, service, gather, average):
        self.service, self.gather, self.average, self._group, self.callbacks = service, gather, average, None, []
        self.triggered = self.began_allreduce = self.blocking = False
        self.outcome, self.locked_at_hand_off, self.lock = None, None, None
        self.asked, self.ended = threading.Event(), threading.Event()

    @property
    def group(self):
        self.asked.set()
        return self._group

    @group.setter
    def group(self, members):
        self._group = members

    def assemble(self):
        self.group = ("me", "other")
        if self.service.on_group is not None:
            self.service.on_group(self.group)
        if self.triggered and self.average is not None:
            self.end(self.average)

    def run(self, tensors, weight):
        self.triggered, self.began_allreduce = True, self._group is not None
        self.locked_at_hand_off = self.lock is not None and self.lock.locked()
        if self._group is not None and self.average is not None:
            self.end(self.average)

    def result(self, timeout=None):
        self.asked.set()
        if not self.ended.wait(timeout if self.blocking else 0):
            raise TimeoutError
        return self.outcome

    def end(self, average):
        """The all-reduce ends with ``average`` (the service's event loop runs the callbacks)."""
        self.outcome = result_of(self, average)
        self.ended.set()
        for callback in self.callbacks:
            callback()

    def on_done(self, callback):
        self.callbacks.append(callback)
        if self.outcome is not None:
            callback()

    def done(self):
        return self.outcome is not None

    def cancel(self):
        self.triggered = True


def result_of(scheduled, average):
    members = ("me", "other")
    return AveragingResult([torch.as_tensor(t).clone() for t in average], members,
                           {member: dict(scheduled.gather) for member in members}, SimpleNamespace(received=1.0))


class Guarded:
    """``lock_averaged_tensors``, watched: the service's event loop (a thread the test marks) never takes it: it
    would wait there on the training thread, and every round and request of the service with it."""

    def __init__(self):
        self.lock, self.loop, self.taken_on_loop = threading.Lock(), None, 0

    def __enter__(self):
        if threading.current_thread() is self.loop:
            self.taken_on_loop += 1
            raise AssertionError("the service's event loop takes lock_averaged_tensors")
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()

    def locked(self):
        return self.lock.locked()

    @contextlib.contextmanager
    def on_loop(self):
        self.loop = threading.current_thread()
        try:
            yield
        finally:
            self.loop = None


@pytest.fixture
def rounds(monkeypatch):
    monkeypatch.setattr(parameter_rounds, "AveragingService", Service)
    return ParameterRounds(None, prefix="test_state_averager", matchmaking_time=1.0, timeout=30.0,
                           sender_timeout=1.0, request_timeout=1.0)


def test_a_rounds_compression_infos_reach_its_service(rounds):
    infos = parameter_rounds.round_infos([torch.zeros(2), torch.zeros(2), torch.zeros(1)], 1, ["exp_avg"], 1)
    assert [(info.key, info.role) for info in infos] == [
        (0, TensorRole.PARAMETER), ((0, "exp_avg"), TensorRole.OPTIMIZER), (0, TensorRole.UNSPECIFIED)]
    with pytest.raises(ValueError):  # (counts that do not add up to the tensors)
        parameter_rounds.round_infos([torch.zeros(2), torch.zeros(2), torch.zeros(1)], 1, ["exp_avg"], 0)
    rounds.schedule([torch.zeros(2), torch.zeros(2), torch.zeros(1)], epoch=1, infos=infos)
    assert rounds.service.rounds[0].infos is infos


def test_the_tensors_lock_is_free_during_matchmaking_and_held_from_the_group_to_the_install(rounds):
    rounds.service.assemble, rounds.service.averages = False, [[[1.0, 2.0]]]
    control = rounds.schedule([torch.zeros(2)], epoch=1)
    scheduled, lock, tensors, returned = rounds.service.rounds[0], threading.Lock(), [torch.zeros(2)], []
    scheduled.lock, scheduled.blocking = lock, True
    finishing = threading.Thread(target=lambda: returned.append(
        rounds.finish(control, tensors, lock, 30.0, lambda: True, late=lambda: None)))
    finishing.start()
    try:
        assert scheduled.asked.wait(10)  # (finish waits for the group, or for the result)
        free = lock.acquire(blocking=False)  # (a state served now copies it: matchmaking may last matchmaking_time)
        if free:
            lock.release()
        assert free, "lock_averaged_tensors is held while the group is still being searched for"
    finally:
        scheduled.assemble()
        finishing.join(10)
    assert scheduled.locked_at_hand_off  # (the tensors handed and the average written with no download between)
    assert returned and torch.equal(tensors[0], torch.tensor([1.0, 2.0]))


def averager(rounds, **options):
    """A training state on ``rounds`` with a guarded tensors' lock, able to install downloads."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = object.__new__(ConsistentStateAverager)
    vars(state).update(_open_for_downloads=threading.Event(), _closing_lock=threading.Lock(), _closings=0)
    TrainingState.__init__(state, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), rounds=rounds, **options)
    state.lock_averaged_tensors = Guarded()
    return state, model


def late_round(state, model, background=False):
    """A boundary's round (``background``: the step does not wait for it) whose all-reduce outlives its wait;
    returns it and the average it will end with."""
    state.step(increment_epoch=True, averaging_round=True, delay_averaging=background)
    for pending in list(state.pending_updates):
        pending.result(10)
    scheduled = state.rounds.service.rounds[-1]
    assert scheduled.began_allreduce and not scheduled.done()
    return scheduled, [p.detach() + 10 for p in model.parameters()]


# the three ways a round's average reaches the parameters
EVERY_MODE = pytest.mark.parametrize("options", [dict(reuse_tensors=True), dict(reuse_tensors=False),
                                                 dict(delta_rule_averaging=True)],
                                     ids=["in place", "copy", "delta rule"])


@EVERY_MODE
def test_a_round_that_outlives_its_wait_is_installed_by_the_next_step_not_on_the_services_loop(rounds, options):
    state, model = averager(rounds, **options)
    scheduled, average = late_round(state, model)
    guard = state.lock_averaged_tensors
    with guard.lock, guard.on_loop():  # (the training thread holds it meanwhile, e.g. serving its state)
        scheduled.end(average)
    assert guard.taken_on_loop == 0
    state.step()  # (the loop's next local step)
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), average, strict=True))
    state.shutdown()


@EVERY_MODE
@pytest.mark.parametrize("replaced_by", ["a download", "a newer round"])
def test_a_round_that_ends_late_never_writes_over_a_newer_state(rounds, options, replaced_by):
    state, model = averager(rounds, **options)
    scheduled, average = late_round(state, model, background=True)  # (the training thread goes on meanwhile)
    if replaced_by == "a download":
        served = [torch.full_like(p, 5.0) for p in model.parameters()]
        metadata, tensors, _ = state.state_copy()
        assert state.install_state(dict(metadata, epoch=4), [*served, *tensors[len(served):]])
    else:
        served = [p.detach() - 3 for p in model.parameters()]
        rounds.service.averages.append(served)  # (the newer round ends within its wait)
        state.step(increment_epoch=True, averaging_round=True, delay_averaging=False)
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), served, strict=True))
    scheduled.end(average)  # (the late round ends now)
    state.step()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), served, strict=True))
    state.shutdown()


@EVERY_MODE
def test_a_download_installed_during_matchmaking_is_not_written_over_by_the_rounds_average(rounds, options):
    """The tensors' lock is free until the group assembles, so a download may install meanwhile: the round, handed
    tensors earlier (its snapshot for the delta rule), then averages a state this peer no longer holds."""
    state, model = averager(rounds, **options)
    rounds.service.assemble, rounds.service.averages = False, [[p.detach() + 10 for p in model.parameters()]]
    boundary = threading.Thread(target=state.step, kwargs=dict(increment_epoch=True, averaging_round=True,
                                                               delay_averaging=False))
    boundary.start()
    try:
        while not rounds.service.rounds and boundary.is_alive():  # (the executor schedules the round)
            boundary.join(0.01)
        scheduled = rounds.service.rounds[0]
        scheduled.blocking = True
        assert scheduled.asked.wait(10)  # (the round waits for its group)
        served = [torch.full_like(p, 5.0) for p in model.parameters()]
        metadata, tensors, _ = state.state_copy()
        assert state.install_state(dict(metadata, epoch=4), [*served, *tensors[len(served):]])
    finally:
        rounds.service.rounds[0].assemble()
        boundary.join(10)
    assert scheduled.done()
    state.step()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), served, strict=True))
    state.shutdown()


@EVERY_MODE
def test_an_optimizer_step_before_a_late_round_ends_keeps_its_update(rounds, options):
    """A boundary with an optimizer step and no parameter round (average_state_every > 1) comes while an earlier
    round is in the background: that round was handed the tensors before the step, so its average would undo the
    step's update; with the delta rule only what the round changed is added."""
    state, model = averager(rounds, **options)
    scheduled, average = late_round(state, model, background=True)
    before = [p.detach().clone() for p in model.parameters()]
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    state.step(increment_epoch=True, optimizer_step=True)
    stepped = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(s, b - 0.1) for s, b in zip(stepped, before, strict=True))
    scheduled.end(average)
    state.step()
    expected = ([s + (a - b) for s, a, b in zip(stepped, average, before, strict=True)]
                if options.get("delta_rule_averaging") else stepped)
    assert all(torch.allclose(p, e) for p, e in zip(model.parameters(), expected, strict=True))
    state.shutdown()


def test_a_decided_round_is_not_kept_until_the_next_one(rounds):
    """A round's result holds a copy of every averaged tensor: once its average is installed (or refused) nothing
    refers to it, also where it ended after its wait."""
    state, model = averager(rounds, reuse_tensors=False)
    rounds.service.averages.append([p.detach() + 1 for p in model.parameters()])
    state.step(increment_epoch=True, averaging_round=True, delay_averaging=False)
    assert state._writer is None
    scheduled, average = late_round(state, model, background=True)
    assert state._writer is not None  # (in the background: it may still write)
    scheduled.end(average)
    state.step()
    assert state._writer is None and all(torch.equal(p, a) for p, a in zip(model.parameters(), average, strict=True))
    state.shutdown()


def test_a_round_whose_service_closed_under_it_ends_the_step(monkeypatch):
    """At shutdown the service's loop may close between the group's assembly and the hand-off: handing the tensors
    and cancelling both raise RuntimeError. The step that waits for the round still returns (it waited forever)."""

    class Closing(Round):
        def run(self, tensors, weight):
            raise RuntimeError("Event loop is closed")

        def cancel(self):
            raise RuntimeError("Event loop is closed")

    class ClosingService(Service):
        def schedule(self, template, **options):
            scheduled = Closing(self, options["gather"], None)
            scheduled.group = ("me", "other")
            self.rounds.append(scheduled)
            return scheduled

    monkeypatch.setattr(parameter_rounds, "AveragingService", ClosingService)
    state, _ = averager(ParameterRounds(None, prefix="t", matchmaking_time=1.0, timeout=30.0, sender_timeout=1.0,
                                        request_timeout=1.0))
    finished = threading.Event()
    stepping = threading.Thread(target=lambda: (state.step(increment_epoch=True, averaging_round=True,
                                                           delay_averaging=False), finished.set()), daemon=True)
    stepping.start()
    assert finished.wait(10), "the step waits forever for a round whose service closed"
    state.shutdown()


@pytest.mark.parametrize(("hint", "waited"), [((0, 2), "2.0"), ((7, 2), "30.0"), (None, "30.0")])
def test_a_hinted_round_whose_group_does_not_assemble_is_given_up_after_twice_matchmaking_time(rounds, hint,
                                                                                                waited):
    """A round sized by its boundary's gradient round (a hint of that epoch) expects peers that reach the boundary
    together: one that is not in within twice ``matchmaking_time`` is not coming (it downloads, or went apart), and
    the whole ``timeout`` would keep this peer's state from the peers that download it. Other rounds wait it all."""
    rounds.service.assemble, rounds.group_size_hint = False, hint
    control = rounds.schedule([torch.zeros(2)], epoch=1)
    waits = []

    class Assembly:  # (records the wait for the group instead of waiting)
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def wait_for(self, predicate, timeout):
            waits.append(timeout)
            return predicate()

    rounds._assembly = Assembly()
    with pytest.raises(parameter_rounds.RoundFailed, match=f"no group within {waited} s"):
        rounds.finish(control, [torch.zeros(2)], threading.Lock(), 30.0, lambda: True, late=lambda: None)
    assert waits == [float(waited)] and rounds.service.rounds[0].triggered  # (left: cancelled)
