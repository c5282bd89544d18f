"""The non-finite guard on a fake peer: NaN/inf is never contributed, never applied when it arrives."""

from __future__ import annotations

import logging

import pytest
import torch
from fakes import FakePeer, backward, model_and_optimizer

from collabopt import CollaborativeOptimizer, RoundOutcome, StepResult, guard
from collabopt.guard import all_finite


def make_core(target: int = 16, **options):
    model, opt = model_and_optimizer()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    peer = FakePeer(opt, target, reuse_grad_buffers=options.get("reuse_grad_buffers", False))
    return model, CollaborativeOptimizer(opt, run_id="guard", target_batch_size=target, model=model, peer=peer,
                                         handle_signals=False, **options), peer


def nan_backward(model: torch.nn.Module, samples: int) -> None:
    (model(torch.randn(samples, 3)).sum() * float("nan")).backward()


def test_all_finite_is_exact_also_for_large_fp16_values():
    assert all_finite([torch.full((4,), 60000.0, dtype=torch.float16), None, torch.zeros(0)])
    assert not all_finite([torch.ones(2), torch.tensor([float("inf")])])
    assert not all_finite([torch.tensor([float("nan")], dtype=torch.float16)])


class PeerThatAppliesEachStep(FakePeer):
    """A peer whose gradients are applied at every step (use_local_updates, DiLoCo): nothing accumulates."""

    def accumulators(self) -> None:
        return None


@pytest.fixture
def check_every_step(monkeypatch):
    monkeypatch.setattr(guard, "CHECK_INTERVAL", 0.0)
    monkeypatch.setattr(guard, "CHECK_COST_SHARE", 1.0)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_nan_accumulation_is_dropped_at_the_boundary_before_it_is_averaged(reuse, monkeypatch):
    monkeypatch.setattr(guard, "CHECK_INTERVAL", 3600.0)  # only the first step and the boundary are checked
    model, copt, peer = make_core(target=16, reuse_grad_buffers=reuse)
    before = [p.detach().clone() for p in model.parameters()]
    for samples, step_backward in ((8, backward), (4, nan_backward), (4, backward)):
        step_backward(model, samples)
        result = copt.step()
        if not reuse:
            copt.zero_grad()
    assert result == StepResult(skipped=16, epoch_changed=True, grads_reset=reuse,
                                round=RoundOutcome(True, "alone", weight=0.0, epoch=0))  # (it contributed nothing)
    assert copt.samples_skipped == 16 and copt.samples_reported == 0 and copt.nonfinite_steps == 1
    assert copt.local_epoch == 1  # the epoch goes on: this peer takes part with nothing
    for old, p in zip(before, model.parameters(), strict=True):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, old)  # Adam's first step on zero gradients moves nothing


@pytest.mark.parametrize("reuse", [False, True])
def test_a_nan_accumulation_is_dropped_at_the_next_check(reuse, check_every_step, caplog):
    model, copt, peer = make_core(target=1000, reuse_grad_buffers=reuse)
    backward(model, 8)
    copt.step()
    if not reuse:
        copt.zero_grad()
    nan_backward(model, 4)
    with caplog.at_level(logging.WARNING, logger="collabopt.guard"):
        result = copt.step()
    # NaN is sticky in the accumulation: the steps accumulated with it (8 samples) are dropped too
    assert result == StepResult(skipped=12, grads_reset=reuse)
    assert copt.samples_skipped == 12 and copt.samples_reported == 0 and copt.nonfinite_steps == 1
    assert peer.accumulated_samples == 0 and "drop_accumulated" in peer.calls
    assert "non-finite gradients were not contributed" in caplog.text
    if not reuse:
        copt.zero_grad()
    backward(model, 8)  # training goes on: finite steps count again
    assert copt.step().samples == 8
    assert copt.metrics()["nonfinite_steps"] == 1


def test_the_accumulation_is_checked_at_most_once_per_interval(monkeypatch):
    checked = []
    monkeypatch.setattr(guard, "CHECK_INTERVAL", 3600.0)
    check = guard.NonFiniteGuard.accumulation_finite
    monkeypatch.setattr(guard.NonFiniteGuard, "accumulation_finite",
                        lambda self, tensors: checked.append(len(tensors)) or check(self, tensors))
    model, copt, _ = make_core(target=80)
    for _ in range(10):  # 10 steps of 8: the 10th reaches the boundary
        backward(model, 8)
        copt.step()
        copt.zero_grad()
    assert copt.local_epoch == 1
    assert len(checked) == 2  # the first step (no check yet), then the boundary; none in between


def test_where_each_step_is_applied_each_step_is_checked(caplog):
    model, opt = model_and_optimizer()
    peer = PeerThatAppliesEachStep(opt, 1000)
    copt = CollaborativeOptimizer(opt, run_id="guard", target_batch_size=1000, model=model, peer=peer,
                                  handle_signals=False)
    backward(model, 8)
    copt.step()
    copt.zero_grad()
    nan_backward(model, 4)
    with caplog.at_level(logging.WARNING, logger="collabopt.guard"):
        result = copt.step()
    assert result == StepResult(skipped=4)  # this step only: the earlier one was applied already
    assert copt.samples_skipped == 4 and copt.samples_reported == 8 and copt.nonfinite_steps == 1
    assert all(p.grad is None for p in model.parameters())
    assert "local steps with non-finite gradients were not contributed" in caplog.text


def test_warnings_are_rate_limited(check_every_step, caplog):
    model, copt, _ = make_core(target=1000)
    with caplog.at_level(logging.WARNING, logger="collabopt.guard"):
        for _ in range(5):
            nan_backward(model, 2)
            copt.step()
            copt.zero_grad()
    assert copt.nonfinite_steps == 5 and caplog.text.count("NaN/inf refused") == 1


def test_non_finite_averaged_gradients_are_not_applied():
    model, copt, peer = make_core(target=8)
    backward(model, 8)
    copt.step()  # a first global step creates Adam's statistics
    copt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    stats = {k: v.clone() for k, v in copt.optimizer.state[next(model.parameters())].items()}
    peer.poison = "gradients"
    backward(model, 8)
    assert copt.step().epoch_changed
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for key, value in copt.optimizer.state[next(model.parameters())].items():
        assert torch.equal(value, stats[key]), key
    assert copt.nonfinite_steps == 1


def test_non_finite_averaged_parameters_are_undone():
    model, copt, peer = make_core(target=8)
    peer.poison = "parameters"
    backward(model, 8)
    assert copt.step().epoch_changed
    assert all_finite(list(model.parameters()))
    assert copt.nonfinite_steps == 1 and copt._guard._snapshot is None  # the copy lives only during the step


def test_without_the_guard_nan_goes_through():
    """The same poisoned round with nonfinite_guard=False: what every peer of the round got before the guard."""
    model, copt, peer = make_core(target=8, nonfinite_guard=False)
    peer.poison = "gradients"
    backward(model, 8)
    copt.step()
    assert not all_finite(list(model.parameters())) and copt.nonfinite_steps == 0


def test_scheduler_fn_works_on_the_guarded_optimizer():
    """torch's LR schedulers wrap optimizer.step as a bound method: the guard's step must stay one."""
    model, opt = model_and_optimizer()
    copt = CollaborativeOptimizer(opt, run_id="guard", target_batch_size=8, model=model, peer=FakePeer(opt, 8),
                                  handle_signals=False,
                                  scheduler_fn=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    backward(model, 8)
    assert copt.step().epoch_changed and copt.get_lr() == [pytest.approx(0.05)]
    copt.close()


def test_a_non_finite_snapshot_is_not_restored():
    """This peer's own update was already non-finite (e.g. NaN optimizer statistics): nothing finite to put back,
    so the core downloads the swarm's state instead of claiming success."""
    model, copt, peer = make_core(target=8)
    backward(model, 8)
    copt.step()
    copt.zero_grad()
    for state in copt.optimizer.state.values():
        state["exp_avg_sq"].fill_(float("nan"))
    backward(model, 8)
    copt.step()
    assert "load_state_from_peers" in peer.calls and copt._guard.restored_parameters == 0


def test_close_gives_the_optimizer_its_step_back():
    model, opt = model_and_optimizer()
    original = opt.step
    copt = CollaborativeOptimizer(opt, run_id="guard", target_batch_size=8, model=model, peer=FakePeer(opt, 8),
                                  handle_signals=False)
    assert opt.step.__func__.__name__ == "guarded_step"
    copt.close()
    assert opt.step == original and "step" not in opt.__dict__


def test_a_copy_of_the_step_is_kept_only_where_a_parameter_round_follows_it():
    """Only averaging can bring non-finite parameters after a finite step: a boundary with no parameter round (a
    lone peer, or average_state_every) keeps no copy, which on a GPU cost a synchronizing transfer of every
    parameter to the host (B2 on a GPU)."""
    model, opt = model_and_optimizer()
    due = [False]
    nonfinite = guard.NonFiniteGuard()
    nonfinite.wrap_optimizer(opt, keep_snapshot=lambda: due[0])
    params = list(model.parameters())
    for round_follows in (False, True):
        due[0] = round_follows
        backward(model, 8)
        opt.step()
        after_step = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.fill_(float("nan"))  # what a poisoned parameter round would bring
        assert nonfinite.restore_parameters(params) is round_follows
        if round_follows:
            assert all(torch.equal(p, q) for p, q in zip(params, after_step, strict=True))
        else:
            with torch.no_grad():
                for p, q in zip(params, after_step, strict=True):
                    p.copy_(q)
        nonfinite.release()
        opt.zero_grad()
