"""Optimizer re-creation from an instance and schedules that follow the global epoch (no network)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as L

from collabopt.scheduling import CollaborativeScheduler, install_step_guard, optimizer_factory, rebind_scheduler

OPTIMIZERS = {
    "ASGD": dict(lr=0.01),
    "Adadelta": dict(lr=0.5),
    "Adafactor": dict(lr=0.01),
    "Adagrad": dict(lr=0.01, initial_accumulator_value=0.1),
    "Adam": dict(lr=0.01, betas=(0.8, 0.9)),
    "AdamW": dict(lr=0.01, weight_decay=0.1, amsgrad=True),
    "Adamax": dict(lr=0.01),
    "Muon": dict(lr=0.01),
    "NAdam": dict(lr=0.01),
    "RAdam": dict(lr=0.01),
    "RMSprop": dict(lr=0.01, momentum=0.9),
    "Rprop": dict(lr=0.01),
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
}


def make_params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3, 5))]


def run_steps(opt, params, steps=3):
    for i in range(steps):
        for j, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (i + 1) * (j + 1)).sin()
        opt.step()


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if hasattr(torch.optim, n)])
def test_factory_rebuilds_every_torch_optimizer(name):
    """The factory builds the same class with the same per-group hyperparameters and state."""
    cls = getattr(torch.optim, name)
    params = make_params()
    groups = [{"params": [params[0]]}, {"params": [params[1]], "lr": 0.002}]
    original = cls(groups, **OPTIMIZERS[name])
    run_steps(original, params, 2)  # the original has state already: it must be carried over

    clones = make_params()
    with torch.no_grad():
        for c, p in zip(clones, params, strict=True):
            c.copy_(p)
    rebuilt = optimizer_factory(original)([{"params": [clones[0]]}, {"params": [clones[1]]}])
    assert type(rebuilt) is cls
    for g_old, g_new in zip(original.param_groups, rebuilt.param_groups, strict=True):
        assert {k: v for k, v in g_old.items() if k != "params"} == {
            k: v for k, v in g_new.items() if k != "params"
        }
    run_steps(original, params, 2)
    run_steps(rebuilt, clones, 2)
    for p, c in zip(params, clones, strict=True):
        torch.testing.assert_close(p, c, rtol=0, atol=0)


def test_factory_survives_defaults_the_constructor_rejects():
    opt = torch.optim.AdamW(make_params(), lr=0.01)
    opt.defaults["not_a_constructor_argument"] = 1  # like the keys torch adds to defaults
    rebuilt = optimizer_factory(opt)([{"params": make_params()}])
    assert isinstance(rebuilt, torch.optim.AdamW)


SCHEDULERS = {
    "StepLR": lambda o: L.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.1, total_iters=4),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=5, power=2.0),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=4),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.2, total_steps=10),
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 1.0 / (e + 1)),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda e: 0.9),
    "SequentialLR": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.2, total_iters=2), L.ExponentialLR(o, gamma=0.7)], milestones=[2]),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.ConstantLR(o, factor=0.5, total_iters=3),
                                                      L.ExponentialLR(o, gamma=0.9)]),
}


def plain_lrs(make, steps):
    opt = torch.optim.SGD(make_params(), lr=0.1, momentum=0.9)
    sched = make(opt)
    lrs = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


@pytest.mark.parametrize("name", SCHEDULERS)
def test_schedule_on_rebuilt_optimizer_matches_plain_torch_including_jumps(name):
    """Re-bound to a rebuilt optimizer, stepped per epoch, and after jumps (a late joiner whose downloaded
    optimizer carried another LR), the LR equals plain torch after the same number of steps."""
    make = SCHEDULERS[name]
    expected = plain_lrs(make, 8)
    user_opt = torch.optim.SGD(make_params(), lr=0.1, momentum=0.9)
    sched = make(user_opt)
    inner = optimizer_factory(user_opt)([{"params": make_params()}])
    rebind_scheduler(sched, inner)
    schedule = CollaborativeScheduler(sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" noise
        for epoch in (1, 2, 5, 6, 3, 8):  # forward, a jump ahead, a jump back (checkpoint load)
            for group in inner.param_groups:
                group["lr"] = 123.0  # whatever a downloaded state carried
            if epoch in (1, 2, 6):  # single steps must not depend on it: restore what the optimizer had
                for group, lr in zip(inner.param_groups, expected[epoch - 1], strict=True):
                    group["lr"] = lr
            schedule.advance_to(epoch)
            got = [g["lr"] for g in inner.param_groups]
            assert got == pytest.approx(expected[epoch], rel=1e-12), (name, epoch)


def test_same_epoch_state_download_keeps_the_schedule_learning_rate():
    opt = torch.optim.SGD(make_params(), lr=1.0)
    schedule = CollaborativeScheduler(L.ExponentialLR(opt, gamma=0.5))
    schedule.advance_to(2)
    opt.param_groups[0]["lr"] = 0.125  # a download at epoch 2 brought another peer's (already stepped) LR
    schedule.advance_to(2)
    assert opt.param_groups[0]["lr"] == 0.25


def test_plateau_steps_once_per_epoch_with_mean_metric():
    opt = torch.optim.SGD(make_params(), lr=1.0)
    sched = L.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    schedule = CollaborativeScheduler(sched)
    reference_opt = torch.optim.SGD(make_params(), lr=1.0)
    reference = L.ReduceLROnPlateau(reference_opt, factor=0.5, patience=0)
    for epoch, metrics in enumerate([[3.0, 1.0], [2.0, 2.0], [2.5], [1.0, 0.5]], start=1):
        for m in metrics:
            schedule.report_metric(m)
        schedule.advance_to(epoch)
        reference.step(sum(metrics) / len(metrics))
        assert opt.param_groups[0]["lr"] == reference_opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"] == 0.25  # two reductions happened: the test is not vacuous


def test_plateau_state_travels_with_a_download_even_one_epoch_old():
    """A late joiner downloads a peer's param groups (LR and plateau counters of epoch 2) while hivemind says
    epoch 3: it continues exactly where plain torch is after 3 steps."""
    def reference(steps):
        opt = torch.optim.SGD(make_params(), lr=1.0)
        sched = L.ReduceLROnPlateau(opt, factor=0.5, patience=1)
        for _ in range(steps):
            sched.step(1.0)
        return opt.param_groups[0]["lr"]

    server_opt = torch.optim.SGD(make_params(), lr=1.0)
    server = CollaborativeScheduler(L.ReduceLROnPlateau(server_opt, factor=0.5, patience=1))
    for epoch in (1, 2):
        server.report_metric(1.0)
        server.advance_to(epoch)
    joiner_opt = torch.optim.SGD(make_params(), lr=1.0)
    joiner = CollaborativeScheduler(L.ReduceLROnPlateau(joiner_opt, factor=0.5, patience=1))
    joiner_opt.load_state_dict(copy.deepcopy(server_opt.state_dict()))  # what hivemind's state download does
    joiner.advance_to(3)
    assert joiner_opt.param_groups[0]["lr"] == reference(3) == 0.5
    for epoch in (4, 5):
        joiner.report_metric(1.0)
        joiner.advance_to(epoch)
        assert joiner_opt.param_groups[0]["lr"] == reference(epoch), epoch


def test_user_step_calls_are_guarded_and_state_dict_stays_picklable():
    opt = torch.optim.SGD(make_params(), lr=1.0)
    sched = L.ExponentialLR(opt, gamma=0.5)
    install_step_guard(sched, on_metric=lambda m: None)
    with pytest.warns(UserWarning, match="once per global epoch"):
        sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 1.0
    assert isinstance(sched, L.ExponentialLR)
    pickle.dumps(sched.state_dict())
    copy.deepcopy(sched.state_dict())

    metrics = []
    plateau = L.ReduceLROnPlateau(torch.optim.SGD(make_params(), lr=1.0))
    install_step_guard(plateau, on_metric=metrics.append)
    plateau.step(0.25)
    assert metrics == [0.25]
