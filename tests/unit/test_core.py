"""The core's step protocol on a fake peer: step results, failed syncs, discarded progress, schedule, state."""

from __future__ import annotations

import warnings

import pytest
import torch
from fakes import FakePeer, backward, model_and_optimizer

from collabopt import CollabConfig, CollaborativeOptimizer, ConfigurationError, StepResult, SwarmOptimizer
from collabopt.engine import p2p
from collabopt.optimizer import SYNC_ATTEMPTS


def make_core(target: int = 64, reuse: bool = False, scheduler_gamma: float | None = None, **options):
    model, opt = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=scheduler_gamma) if scheduler_gamma else None
    peer = FakePeer(opt, target, reuse_grad_buffers=reuse)
    copt = CollaborativeOptimizer(opt, run_id="unit", target_batch_size=target, model=model, peer=peer,
                                  scheduler=scheduler, reuse_grad_buffers=reuse, handle_signals=False, **options)
    return model, copt, peer


def test_step_returns_what_happened():
    model, copt, peer = make_core(target=64)
    assert isinstance(copt, SwarmOptimizer)
    backward(model, 40)
    first = copt.step()
    assert first == StepResult(samples=40)
    copt.zero_grad()
    backward(model, 30)
    second = copt.step()
    assert second.samples == 30 and second.epoch_changed and copt.local_epoch == 1
    assert copt.samples_reported == 70
    copt.close()
    assert "shutdown" in peer.calls


def test_closure_loss_travels_in_the_result():
    model, copt, _ = make_core()

    def closure():
        loss = model(torch.randn(8, 3)).pow(2).mean()
        loss.backward()
        return loss

    result = copt.step(closure)
    assert result.samples == 8 and torch.is_tensor(result.loss)
    copt.close()


def test_reuse_grad_buffers_reports_reset_gradients():
    model, copt, _ = make_core(target=16, reuse=True)
    backward(model, 8)
    assert not copt.step().grads_reset
    with pytest.warns(UserWarning, match="does nothing"):
        copt.zero_grad()  # a no-op: param.grad keeps the accumulation
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())
    backward(model, 8)
    result = copt.step()
    assert result.grads_reset and result.epoch_changed
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())
    copt.close()


def steps_until_it_gives_up_syncing(model, copt) -> None:
    """SYNC_ATTEMPTS steps nobody serves the swarm's state for: each counts no samples, the last goes on from this
    peer's own parameters at the swarm's epoch, and says so."""
    for attempt in range(1, SYNC_ATTEMPTS + 1):
        backward(model, 8)
        if attempt < SYNC_ATTEMPTS:
            assert copt.step().samples == 0
        else:
            with pytest.warns(UserWarning, match="no peer could send its state"):
                assert copt.step().epoch_changed


def test_gives_up_syncing_when_nobody_serves_the_swarms_state():
    """The peers that were ahead left (their records outlive them): after SYNC_ATTEMPTS refused steps this peer
    continues from its own parameters at the swarm's epoch instead of retrying forever."""
    model, copt, peer = make_core(target=1000)
    peer.swarm_epoch, peer.serves_state = 5, False
    before = [p.detach().clone() for p in model.parameters()]
    steps_until_it_gives_up_syncing(model, copt)
    assert copt.local_epoch == 5 and "jump_to_epoch(5)" in peer.calls
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # own parameters kept
    backward(model, 8)
    assert copt.step().samples == 8  # contributing again
    copt.close()


def test_the_step_that_ends_a_boundary_behind_its_gradient_round_counts_no_samples():
    """Its group was an epoch ahead: the peer did not step and downloaded instead; the samples of that step were in
    no average (StepResult.samples 0, not in samples_reported). Where nobody serves the state, that boundary is the
    first of the SYNC_ATTEMPTS refused steps before the peer goes on from its own parameters."""
    model, copt, peer = make_core(target=16)
    peer.round_ahead = True
    backward(model, 8)
    assert copt.step().samples == 8
    backward(model, 8)
    result = copt.step()
    assert (result.samples, result.epoch_changed, copt.samples_reported) == (0, True, 8)
    assert copt.local_epoch == 2 and peer.calls.count("load_state_from_peers") == 1
    assert (peer.last_round.applied, peer.last_round.reason) == (False, "behind")
    model, copt, peer = make_core(target=8)
    peer.round_ahead, peer.serves_state = True, False
    steps_until_it_gives_up_syncing(model, copt)
    assert copt.local_epoch == 2 and "jump_to_epoch(2)" in peer.calls
    copt.close()


def test_a_served_download_counts_as_an_epoch_change():
    model, copt, peer = make_core(target=1000)
    peer.swarm_epoch = 3
    backward(model, 8)
    result = copt.step()
    assert result.samples == 0 and result.epoch_changed and copt.local_epoch == 3
    assert "load_state_from_peers" in peer.calls


@pytest.mark.parametrize("reuse", [False, True])
def test_an_overflowing_amp_step_contributes_nothing(reuse):
    model, copt, peer = make_core(target=1000, reuse=reuse)
    backward(model, 8)
    copt.step()
    backward(model, 4)
    copt.grad_scale, copt.found_inf = torch.tensor(2.0**16), torch.tensor(1.0)  # what GradScaler.step sets
    result = copt.step()
    del copt.grad_scale, copt.found_inf
    if reuse:  # param.grad also held the first step: its 8 samples are dropped too
        assert result == StepResult(skipped=12, grads_reset=True)
        assert copt.samples_reported == 0 and peer.accumulated_samples == 0
        assert "drop_accumulated" in peer.calls
    else:
        assert result == StepResult(skipped=4)
        assert copt.samples_reported == 8 and peer.accumulated_samples == 8
        assert all(p.grad is None for p in model.parameters())
    assert copt.samples_skipped == result.skipped


def test_amp_scale_is_divided_out_before_the_contribution():
    model, copt, peer = make_core(target=1000)
    backward(model, 8, scale=1024.0)
    scaled = [p.grad.clone() for p in model.parameters()]
    copt.grad_scale, copt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
    assert copt.step().samples == 8
    for grad, p in zip(scaled, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, grad / 1024.0)


def test_schedule_follows_epochs_and_the_users_step_call_is_ignored():
    model, copt, _ = make_core(target=8, scheduler_gamma=0.5)
    user_scheduler = copt.scheduler.scheduler
    for _ in range(3):
        backward(model, 8)
        copt.step()
        copt.zero_grad()
    assert copt.local_epoch == 3 and copt.get_lr() == [pytest.approx(0.1 * 0.5**3)]
    with pytest.warns(UserWarning, match="called by collabopt once per global epoch"):
        user_scheduler.step()
    assert copt.get_lr() == [pytest.approx(0.1 * 0.5**3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copt.scheduler.step()  # a framework's call on the wrapper: silent, ignored
    assert copt.scheduler.get_last_lr() == [pytest.approx(0.1 * 0.5**3)]


def test_state_dict_round_trip_uses_one_format():
    model, copt, peer = make_core(target=8, scheduler_gamma=0.5)
    for _ in range(2):
        backward(model, 8)
        copt.step()
    state = copt.state_dict()
    assert state["format"] == "collabopt/1" and state["local_epoch"] == 2
    assert state["scheduler"]["format"] == "collabopt-scheduler/1"
    _, other, _ = make_core(target=8, scheduler_gamma=0.5)
    other.load_state_dict(state)
    assert other.local_epoch == 2 and other.get_lr() == copt.get_lr()
    with pytest.raises(ConfigurationError, match="not a collabopt optimizer state_dict"):
        other.load_state_dict({"optimizer": {}})


def test_properties_are_safe_after_close():
    _, copt, _ = make_core()
    copt.close()
    assert (copt.local_epoch, copt.global_epoch, copt.num_peers) == (0, 0, 1)
    with pytest.raises(RuntimeError, match="closed"):
        copt.step(batch_size=1)


def test_wait_for_peers_announces_until_counted():
    _, copt, peer = make_core()
    peer.num_peers = 2
    assert copt.wait_for_peers(2, timeout=5)
    assert "announce" in peer.calls
    assert not copt.wait_for_peers(3, timeout=0)


def test_wait_for_peers_is_a_method_and_the_function_is_a_deprecated_alias():
    import collabopt

    _, copt, peer = make_core()
    peer.num_peers = 2
    with pytest.warns(DeprecationWarning, match=r"copt\.wait_for_peers\(n\)") as caught:
        assert collabopt.wait_for_peers(copt, 2, timeout=5)
    assert len(caught) == 1 and caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert copt.wait_for_peers(2, timeout=5)


def test_config_or_options_not_both():
    _, opt = model_and_optimizer()
    config = CollabConfig.from_options(run_id="unit", target_batch_size=8, handle_signals=False, batch_size=4)
    with pytest.raises(ConfigurationError, match="together with config"):
        CollaborativeOptimizer(opt, config=config, matchmaking_time=2.0, peer=FakePeer(opt, 8))
    with CollaborativeOptimizer(opt, config=config, peer=FakePeer(opt, 8)) as copt:
        assert copt.config is config and copt.step().samples == 4  # the config's fixed batch_size


def test_collabopt_logs_through_hiveminds_handler_only_while_the_application_configured_no_logging(monkeypatch):
    import logging

    from hivemind.utils import logging as hivemind_logging


    ours = logging.getLogger("collabopt")
    saved = ours.handlers[:], ours.level
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    try:
        p2p.log_like_hivemind()
        p2p.log_like_hivemind()  # a second optimizer in the process adds nothing
        (handler,) = ours.handlers
        assert logging.getLevelName(ours.level) == hivemind_logging.loglevel  # HIVEMIND_LOGLEVEL (default INFO)
        seen = []
        monkeypatch.setattr(handler, "target", type("Target", (), {"handle": lambda self, r: seen.append(r)})())
        record = logging.LogRecord("collabopt.x", logging.INFO, __file__, 1, "a status line", None, None)
        root = logging.getLogger()
        monkeypatch.setattr(root, "handlers", [])
        handler.handle(record)
        assert seen == [record]
        monkeypatch.setattr(root, "handlers", [logging.NullHandler()])  # the application configured logging
        handler.handle(record)
        assert seen == [record]
    finally:
        ours.handlers[:] = saved[0]
        ours.setLevel(saved[1])
