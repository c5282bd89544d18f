"""The synchronous boundary (collabopt.engine.sync_round.SyncLoop.end_epoch) on stand-in services: which round
runs and which gradients the optimizer steps with; the rounds themselves run in every swarm test."""

from __future__ import annotations

import contextlib
import logging
import threading
from types import SimpleNamespace

import pytest
import torch
from hivemind.utils import get_dht_time

from collabopt import RoundOutcome, Terminated, lineage
from collabopt.engine import lineage_check, parameter_rounds, progress, protocol, sync_round
from collabopt.engine import peer as engine_peer


class Control:
    """A round's StepControl as the loop sees it: ``result()`` is the group's gathered metadata; triggered, the round
    ends at once (as the foreground step waited for it)."""

    def __init__(self, group: dict | None = None, error: Exception | None = None):
        self.group, self.error, self.triggered, self.weight = group, error, False, None
        self.began_allreduce = self.was_cancelled = False

    def done(self) -> bool:
        return self.triggered

    def cancelled(self) -> bool:
        return self.was_cancelled

    def exception(self) -> Exception | None:
        return self.error

    def result(self, timeout: float | None = None) -> dict | None:
        if self.error is not None:
            raise self.error
        return self.group

    def allow_allreduce(self) -> None:
        self.triggered = True

    def cancel(self) -> bool:
        if self.triggered:
            return False
        self.was_cancelled = self.triggered = True
        return True


class GradAverager:
    """The gradient averager's calls the boundary makes, recorded."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers, self.calls = buffers, []

    def get_tensors(self):
        return contextlib.nullcontext(self.buffers)

    def step(self, control=None, **kwargs):
        self.calls.append("step")
        control = control or Control()
        control.allow_allreduce()
        return control

    def __getattr__(self, name):  # load_accumulators_into_averager_, notify_used_averaged_gradients, ...
        return lambda *args, **kwargs: self.calls.append(name)


def sync_loop(num_peers: int = 3, local_epoch: int = 8, swarm_epoch: int = 8, group: dict | None = None,
              error: Exception | None = None, parameter_round: Control | None = None) -> sync_round.SyncLoop:
    """A SyncLoop on stand-in services, its gradient round pre-scheduled (``group``: what it gathers); its
    parameter round is ``parameter_round`` (by default one that averages with the group)."""
    loop = object.__new__(sync_round.SyncLoop)
    param = torch.nn.Parameter(torch.zeros(2))
    state_steps: list[dict] = []
    closed: list[bool] = []  # True while the loop has the state averager closed for downloads

    @contextlib.contextmanager
    def closed_for_downloads():
        closed.append(True)
        try:
            yield
        finally:
            closed.append(False)

    def state_step(**kwargs):
        state_steps.append(dict(kwargs, closed_for_downloads=bool(closed) and closed[-1]))
        if kwargs.get("averaging_control") is not None:
            kwargs["averaging_control"].allow_allreduce()  # (hivemind's step triggers the round and waits for it)

    loop.state_averager = SimpleNamespace(
        local_epoch=local_epoch, averaging_in_progress=False, main_parameters=(param,), state_sharing_priority=0,
        optimizer=SimpleNamespace(param_groups=[{"params": [param]}]), group_size_hint=None, step=state_step,
        votes=None,  # (downloads not verified: aggregation="mean")
        schedule_parameter_round=lambda timeout: parameter_round or Control(group),
        closed_for_downloads=closed_for_downloads)
    loop.state_steps, loop.closed = state_steps, closed
    loop.tracker = SimpleNamespace(global_epoch=swarm_epoch, global_progress=SimpleNamespace(num_peers=num_peers),
                                   pause_updates=contextlib.nullcontext, update_epoch=lambda new_epoch: None,
                                   record_times=(get_dht_time(),) * num_peers, extrapolation_limit=lambda: 1.0)
    loop.grad_averager = GradAverager([torch.ones(2)])
    loop.scheduled_grads = Control(group, error)
    loop.sync_state = lineage_check.SyncState(checks_lineage=group is not None)
    loop.dht = SimpleNamespace(peer_id="me")
    loop.downloads = []
    loop.load_state_from_peers = lambda: loop.downloads.append(True)
    for name, value in dict(auxiliary=False, client_mode=False, offload_optimizer=False, delay_grad_averaging=False,
                            delay_optimizer_step=False, delay_state_averaging=False, average_state_every=1,
                            averaging_timeout=5.0, matchmaking_time=2.0, status_loglevel=logging.INFO).items():
        setattr(loop, name, value)
    return loop


@pytest.mark.parametrize(("local_epoch", "delay_grad_averaging", "downloads"), [
    (3, False, True), (4, False, True), (5, False, False),
    (3, True, True), (4, True, False), (5, True, False),  # delay_grad_averaging: one behind joins the round under way
    (3, "local updates", True), (4, "local updates", False),  # no gradient round: the first to end is ahead by design
])
def test_a_boundary_begun_behind_the_swarm_downloads_instead(local_epoch, delay_grad_averaging, downloads):
    """step() checked the sync on an older view than the one that made it ready (a peer back from a cut link, or one
    whose peers ended the epoch's round without it and finished the run)."""
    loop = sync_loop(local_epoch=local_epoch, swarm_epoch=5, group={})
    if delay_grad_averaging == "local updates":  # use_local_updates: no gradient averager
        loop.grad_averager, delay_grad_averaging = None, False
    loop.delay_grad_averaging = delay_grad_averaging
    loop.end_epoch()
    assert loop.downloads == ([True] if downloads else [])
    assert bool(loop.state_steps) != downloads
    if downloads:  # the boundary's outcome: not applied, re-synchronized
        assert loop.last_round == RoundOutcome(False, "behind", num_peers=3, resync=True, epoch=local_epoch)


@pytest.mark.parametrize(("delay_grad_averaging", "samples", "swarm_epoch", "downloads"), [
    (True, 32, 9, False),  # overlap: the others announced epoch 9 as they started epoch 8's round: join it
    (True, 0, 9, True),  # nothing accumulated toward epoch 8: nothing to bring to its round
    (True, 32, 10, True),  # two epochs behind: that round is long gone
    (False, 32, 9, True),  # without delay_grad_averaging the others announce epoch 9 after its gradient round
    (True, 32, 8, False),  # (at the swarm's epoch)
])
def test_the_first_view_of_an_epoch_one_ahead_in_overlap_mode_joins_the_round(delay_grad_averaging, samples,
                                                                                swarm_epoch, downloads):
    """A peer started with the others first saw the swarm an epoch ahead: with ``delay_grad_averaging`` it joins
    the round under way instead of downloading a state that the round's peers serve only once it ends (which waited
    for it: "could not find a group" after ``averaging_timeout``)."""
    loop = sync_loop(local_epoch=8, swarm_epoch=swarm_epoch, group={})
    loop.delay_grad_averaging = delay_grad_averaging
    loop.grad_averager.local_samples_accumulated = samples
    loop.tracker.fetched_global_progress_this_epoch = threading.Event()
    loop.tracker.fetched_global_progress_this_epoch.set()
    loop._exact_check_due = True
    assert loop.should_download() is downloads
    assert loop._exact_check_due is False


@pytest.mark.parametrize(("reason", "downloads"), [("no group", True), ("averaged", False)])
def test_a_peer_that_joined_a_round_that_had_ended_downloads_then(reason, downloads):
    """The round under way it joined had ended: its own found no group, it stepped alone and is apart."""
    loop = sync_loop(local_epoch=8, swarm_epoch=9, group={})
    loop.delay_grad_averaging = True
    loop.grad_averager.local_samples_accumulated = 32
    loop.tracker.fetched_global_progress_this_epoch = threading.Event()
    loop.tracker.fetched_global_progress_this_epoch.set()
    loop._exact_check_due = True
    assert loop.should_download() is False  # joins
    loop.state_averager.local_epoch = loop.tracker.global_epoch = 9  # (its boundary, the round in the background)
    assert loop.should_download() is False  # the round has not ended
    loop.last_round = RoundOutcome(True, reason, 2 if reason == "averaged" else None, num_peers=2, epoch=8)
    assert loop.should_download() is downloads
    assert loop.should_download() is False  # once


def test_a_whole_round_steps_with_the_average_then_averages_parameters():
    group = {"me": {"epoch": 8, "lineage": [1.0]}, "b": {"epoch": 8, "lineage": [1.0]}}
    loop = sync_loop(num_peers=2, group=group)
    loop.end_epoch()
    assert loop.last_round == RoundOutcome(True, "averaged", 2, num_peers=2, epoch=8, parameters_averaged=True)
    assert "load_accumulators_into_averager_" not in loop.grad_averager.calls  # (the round's average, not its own)
    assert [(s["optimizer_step"], s["averaging_round"]) for s in loop.state_steps] == [(True, True)]
    # the boundary serves no download, from its gradient round to the step's parameter round, and then does again
    assert loop.state_steps[0]["closed_for_downloads"] and loop.closed == [True, False]


class RoundStillRunning(Control):
    """A parameter round that hivemind's step gave up on (its wait timed out): still matchmaking, or (with
    ``all_reduce``) in its all-reduce."""

    def __init__(self, all_reduce: bool = False):
        super().__init__()
        self.began_allreduce = all_reduce

    def allow_allreduce(self) -> None:
        pass  # triggered, it goes on


@pytest.mark.parametrize(("control", "averaged", "cancelled"), [
    (Control(error=TimeoutError("no group")), False, False),  # failed: hivemind's step only logged it
    (RoundStillRunning(), False, True),  # given up while matchmaking (a search that hung): stopped
    (RoundStillRunning(all_reduce=True), None, False),  # its all-reduce goes on and writes its result: not stopped
])
def test_a_parameter_round_that_did_not_average_is_in_the_outcome(control, averaged, cancelled):
    """The loop holds the parameter round's control: the boundary's outcome says whether it averaged."""
    group = {"me": {"epoch": 8, "lineage": [1.0]}, "b": {"epoch": 8, "lineage": [1.0]}}
    loop = sync_loop(num_peers=2, group=group, parameter_round=control)
    loop.end_epoch()
    assert loop.last_round.applied and loop.last_round.parameters_averaged is averaged
    assert control.was_cancelled == cancelled
    assert ("parameter round failed" in loop.last_round.summary()) == (averaged is False)


def test_a_round_that_finds_this_peer_on_another_lineage_averages_no_parameters(monkeypatch):
    """The one decision of the boundary: the lineage verdict turns the parameter round off (it would mix lineages)."""
    monkeypatch.setattr(lineage, "judge", lambda group, me: lineage.Verdict(["b", "c"], "lineage"))
    loop = sync_loop(num_peers=3, group={"me": {"epoch": 8}, "b": {"epoch": 8}, "c": {"epoch": 8}})
    loop.end_epoch()
    assert loop.last_round.reason == "apart" and loop.last_round.resync
    assert [(s["optimizer_step"], s["averaging_round"]) for s in loop.state_steps] == [(True, False)]


@pytest.mark.parametrize(("lineage_checked", "delay_grad_averaging"), [(True, False), (False, False), (False, True)])
def test_a_peer_behind_its_gradient_round_does_not_step_and_downloads_at_once(lineage_checked,
                                                                              delay_grad_averaging, caplog):
    """A late joiner whose download brought epoch 8 as the others moved on to 9: its first gradient round gathers
    them at epoch 9 and leaves its gradients out. It once stepped anyway (the average of epoch 9 on epoch 8's
    parameters: parameters of its own at epoch 9), trained on them, and downloaded at its next step. Now it keeps
    epoch 8 and downloads within the boundary, outside its locks; the boundary step's samples do not count.
    (delay_grad_averaging: the round ends in the background, after the step: nothing to hold back.)"""
    group = {"me": {"epoch": 8, "lineage": lineage.fingerprint([torch.zeros(2)]), "serves": True},
             "b": {"epoch": 9, "lineage": lineage.fingerprint([torch.ones(2)]), "serves": True}}
    if not lineage_checked:
        group = {peer: {"epoch": metadata["epoch"]} for peer, metadata in group.items()}
    loop = sync_loop(num_peers=2, group=group)
    loop.sync_state.checks_lineage = lineage_checked
    loop.delay_grad_averaging = loop.delay_optimizer_step = delay_grad_averaging
    loop.load_state_from_peers = lambda **kwargs: loop.downloads.append((loop.closed[-1], loop.sync_state.resync,
                                                                          kwargs))
    with caplog.at_level(logging.INFO):
        outcome = loop.end_epoch()
    if delay_grad_averaging:  # (the step ran; the round's verdict comes when it ends)
        assert outcome is None and loop.downloads == []
        assert [s["increment_epoch"] for s in loop.state_steps if "increment_epoch" in s] == [True]
        return
    assert outcome is loop.last_round and (outcome.applied, outcome.reason, outcome.resync) == (False, "behind", True)
    assert "it does not step, and downloads the swarm's state now" in outcome.detail
    assert caplog.text.count("downloads the swarm's state now") == 1 and "after this step" not in caplog.text
    assert f"epoch 8 ends without a step: {outcome.detail}" in caplog.text
    assert loop.state_steps == []  # no optimizer step, no new epoch, no parameter round
    [(closed, resync, kwargs)] = loop.downloads  # at once, with the boundary open for the others' downloads again
    assert kwargs == {"round_epoch": 10}  # (its group steps from epoch 9 to 10: a state of epoch 8 or 9 is no catch-up)
    assert closed is False and loop.closed == [True, False]
    assert (resync is not None and resync.peers == ["b"]) is lineage_checked  # (from the peers of its round first)
    assert not protocol.boundary_accepted(outcome)


def test_sigterm_during_the_download_of_a_peer_behind_its_round_ends_the_boundary_at_once():
    """The download runs outside the boundary's locks, after its outcome is known: SIGTERM (collabopt.Terminated)
    leaves it with the peer at its old epoch, the boundary open to the others' downloads, and the outcome said."""
    loop = sync_loop(num_peers=2, group={"me": {"epoch": 8}, "b": {"epoch": 9}})
    loop.sync_state.checks_lineage = False

    def terminated(**kwargs):
        raise Terminated()

    loop.load_state_from_peers = terminated
    with pytest.raises(Terminated):
        loop.end_epoch()
    assert loop.closed == [True, False] and loop.state_steps == [] and loop.state_averager.local_epoch == 8
    assert (loop.last_round.applied, loop.last_round.reason) == (False, "behind")


@pytest.mark.parametrize(("num_peers", "error", "reason"), [(1, None, "alone"), (3, TimeoutError(), "no group")])
def test_without_a_round_this_peer_steps_with_its_own_mean_gradient(num_peers, error, reason):
    """Alone, or the round failed: the epoch's own accumulated mean gradient is loaded into the optimizer."""
    loop = sync_loop(num_peers=num_peers, group={}, error=error)
    loop.end_epoch()
    assert "load_accumulators_into_averager_" in loop.grad_averager.calls
    assert torch.equal(loop.state_averager.main_parameters[0].grad, torch.ones(2))
    assert loop.last_round.reason == reason and loop.last_round.applied


def test_the_progress_is_fetched_at_least_every_half_matchmaking_time(monkeypatch):
    """hivemind spaces fetches by its ETA (up to 10 s), far too long while throughput estimates warm up."""
    made = []
    monkeypatch.setattr(progress, "SwarmProgressTracker", lambda **kwargs: made.append(kwargs))
    optimizer = SimpleNamespace(dht=None, run_id="r", client_mode=False, status_loglevel=10, matchmaking_time=2.0)
    progress.make_progress_tracker(optimizer, 64)
    progress.make_progress_tracker(optimizer, 64, max_refresh_period=30.0)  # the user's own setting is kept
    optimizer.matchmaking_time = 0.5
    progress.make_progress_tracker(optimizer, 64, min_refresh_period=0.4)
    assert [kwargs["max_refresh_period"] for kwargs in made] == [1.0, 30.0, 0.4]
    # while no record is found too (hivemind: 3 s, longer than short epochs: peers started together then first saw
    # the swarm an epoch ahead, and downloaded instead of ending the epoch they had counted toward)
    assert [kwargs["default_refresh_period"] for kwargs in made] == [1.0, 3.0, 0.4]  # (never slower than hivemind)


def test_tagging_along_with_weight_0_sends_zeros_not_what_the_buffers_held():
    """0 * NaN is NaN: a peer taking part with weight 0 must not send a refused non-finite result left in its
    gradient averager's buffers."""
    loop = sync_loop()
    loop.grad_averager.buffers[:] = [torch.tensor([float("nan"), 1.0]), torch.tensor([float("inf")])]
    control = Control({})
    loop.tag_along(control)
    assert all((b == 0).all() for b in loop.grad_averager.buffers)
    assert (control.weight, control.triggered) == (0, True)


def test_an_averager_that_accumulates_its_own_way_is_checked_at_every_step():
    from hivemind.optim.grad_averager import GradientAverager

    class OwnAccumulation(GradientAverager):
        def accumulate_grads_(self, batch_size: int) -> None:  # e.g. compresses as it accumulates
            pass

        def __del__(self) -> None:  # (never initialized: hivemind's __del__ would raise when it is collected)
            pass

    peer = object.__new__(engine_peer.HivemindPeer)
    peer.loop = SimpleNamespace(grad_averager=object.__new__(OwnAccumulation))
    assert peer.accumulators() is None
    peer.loop = SimpleNamespace(grad_averager=None)  # use_local_updates
    assert peer.accumulators() is None


class DoneRound:
    """A finished gradient round's StepControl: ``result()`` is the group's gathered metadata."""

    def __init__(self, group: dict | None = None, error: Exception | None = None):
        self.group, self.error = group, error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def exception(self) -> Exception | None:
        return self.error

    def result(self) -> dict | None:
        return self.group


@pytest.mark.parametrize(("control", "delayed", "ages", "expected"), [
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 5}, "c": {"epoch": 4}}), False, [0, 0, 0], (5, 2)),  # c downloads
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 3}}), False, [0, 0], (5, 1)),  # alone at its epoch: no round
    (DoneRound({"me": None, "b": None, "c": None}), False, [0, 0], (5, 3)),  # (a peer not counted yet)
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 5}}), False, [0, 0, 0], None),  # split groups: the others may come
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 5}}), False, [0, 0, 7.5], None),  # 7.5 s ago: in a round, say
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 5}}), False, [0, 0, 8.5], (5, 2)),  # 8.5 s: gone (killed, say)
    (DoneRound({"me": {"epoch": 5}, "b": {"epoch": 5}}), True, [0, 0], None),  # delayed: ends after the round began
    (DoneRound({"me": {"epoch": 5}}), False, [0], None),  # alone: hivemind's matchmaking as before
    (DoneRound(error=TimeoutError()), False, [0, 0, 0], None),
    (None, False, [0, 0, 0], None),
])
def test_the_state_round_expects_the_gradient_group_when_it_held_the_swarm_present(control, delayed, ages, expected):
    """``ages``: how old each peer's record was, seconds (a round: matchmaking_time 2 s and averaging_timeout 5 s;
    records extrapolated for 1 s)."""
    now = get_dht_time()
    optimizer = SimpleNamespace(local_epoch=5, delay_grad_averaging=delayed, matchmaking_time=2.0,
                                averaging_timeout=5.0,
                                tracker=SimpleNamespace(record_times=tuple(now - age for age in ages),
                                                        extrapolation_limit=lambda: 1.0),
                                state_averager=SimpleNamespace(group_size_hint=(1, 9)))
    lineage_check.hint_state_group(optimizer, control)
    assert optimizer.state_averager.group_size_hint == expected


@pytest.mark.parametrize(("hint", "configured", "minimum", "expected"), [
    ((5, 3), None, 2, 3), ((4, 3), None, 2, None), (None, None, 2, None),
    ((5, 3), 2, 2, 2), ((5, 3), 8, 2, 3), (None, 8, 2, 8),  # a target_group_size of the user's stays the upper bound
    ((5, 2), None, 3, 3), ((5, 3), 2, 3, 3), (None, None, 3, None),  # centered_clip's min_group_size the lower one
])
def test_a_hint_sizes_only_the_state_round_of_its_epoch(hint, configured, minimum, expected):
    rounds = SimpleNamespace(group_size_hint=hint, target_group_size=configured, min_group_size=minimum)
    assert parameter_rounds.ParameterRounds.group_size(rounds, 5) == expected
    assert rounds.group_size_hint is None  # used once
