"""DiLoCo mode without a swarm: what ``outer_optimizer=`` refuses before any network starts (core and adapters),
and the round logic of collabopt/diloco.py on an in-process stand-in for the swarm."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from collabopt.integrations.pytorch import collaborate
from fakes import FakePeer

import collabopt.guard as guard_module
import collabopt.optimizer as optimizer_module
import collabopt.swarm as swarm_module
from collabopt import CollabConfig, CollaborativeOptimizer, ConfigurationError, RoundOutcome
from collabopt.diloco import INCOMPATIBLE, DiLoCo, agrees_with_group, fingerprint, report_period
from collabopt.engine import diloco_round, progress, protocol
from collabopt.guard import NonFiniteGuard

OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
SWARM = dict(run_id="unit_diloco", target_batch_size=64)


@pytest.fixture
def no_network(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a DHT or peer was started although the configuration is invalid")

    monkeypatch.setattr(swarm_module, "start_dht", forbidden)
    monkeypatch.setattr(optimizer_module, "HivemindPeer", forbidden)
    monkeypatch.setattr(optimizer_module, "DiLoCoPeer", forbidden)


def model_and_opt():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def raising_factory(params):
    raise TypeError("no lr given")


BAD_OUTER = [
    ("not callable", 0.7, "must be a callable"),
    ("an optimizer instance", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.7), "must be a callable"),
    ("raises", raising_factory, "no lr given"),
    ("returns no optimizer", lambda params: "sgd", "returned str"),
]


@pytest.mark.parametrize(("case", "outer", "text"), BAD_OUTER, ids=[c[0] for c in BAD_OUTER])
def test_bad_outer_optimizer_is_refused_before_any_network(no_network, case, outer, text):
    model, opt = model_and_opt()
    for build in (lambda: CollaborativeOptimizer(opt, outer_optimizer=outer, **SWARM),
                  lambda: collaborate(model, opt, outer_optimizer=outer, **SWARM)):
        with pytest.raises(ConfigurationError) as info:
            build()
        assert info.value.parameter == "outer_optimizer" and text in str(info.value)
        assert "torch.optim.SGD, lr=0.7" in info.value.fix


@pytest.mark.parametrize("name", sorted(INCOMPATIBLE))
def test_options_without_meaning_in_diloco_mode_are_refused(no_network, name):
    model, opt = model_and_opt()
    options = {name: True}
    if name in ("delay_optimizer_step", "delay_grad_averaging"):  # refused on their own before DiLoCo's check
        options.update(offload_optimizer=True, delay_optimizer_step=True, delay_state_averaging=True)
    with pytest.raises(ConfigurationError) as info:
        CollaborativeOptimizer(opt, outer_optimizer=OUTER, **SWARM, **options)
    assert "outer_optimizer" in str(info.value)


def test_hivemind_options_and_factory_without_meaning_are_refused(no_network):
    model, opt = model_and_opt()
    with pytest.raises(ConfigurationError, match="grad_averager_factory"):
        CollaborativeOptimizer(opt, outer_optimizer=OUTER, grad_averager_factory=object, **SWARM)
    with pytest.raises(ConfigurationError, match="average_opt_statistics"):
        CollaborativeOptimizer(opt, outer_optimizer=OUTER, average_opt_statistics=("exp_avg",), **SWARM)
    with pytest.raises(ConfigurationError, match="optimizer_factory"):
        CollaborativeOptimizer(opt, outer_optimizer=OUTER, optimizer_factory=OUTER, **SWARM)


def test_a_good_outer_optimizer_is_accepted():
    config = CollabConfig.from_options(outer_optimizer=OUTER, **SWARM)
    assert config.outer_optimizer is OUTER
    assert CollabConfig.from_options(**SWARM).outer_optimizer is None


def test_adapters_refuse_a_bad_outer_optimizer_at_construction():
    from collabopt.integrations.accelerate import CollaborativeAccelerator
    from collabopt.integrations.lightning import CollaborativeStrategy

    with pytest.raises(ConfigurationError, match="outer_optimizer"):
        CollaborativeStrategy(target_batch_size=64, outer_optimizer="sgd")
    with pytest.raises(ConfigurationError, match="reuse_grad_buffers"):
        CollaborativeStrategy(target_batch_size=64, outer_optimizer=OUTER, reuse_grad_buffers=True)
    with pytest.raises(ConfigurationError, match="outer_optimizer"):
        CollaborativeAccelerator(cpu=True, outer_optimizer=3, **SWARM)
    CollaborativeStrategy(target_batch_size=64, outer_optimizer=OUTER)  # accepted


# ---------------------------------------------------------------------------------------------- the round logic


class FakeSwarm:
    """A :class:`collabopt.diloco.RoundSwarm` in memory: ``average`` replaces the buffers by what the group
    averaged (``others``: (weight, pseudo-gradient) of the other peers) and returns what the all-reduce left: the
    gathered metadata, and with ``partial`` part of the average missing (its results holding this peer's values)."""

    def __init__(self, model: torch.nn.Module, num_peers: int = 1):
        self.parameters = list(model.parameters())
        self.anchors = [p.detach().clone() for p in self.parameters]
        self._buffers = [torch.zeros_like(p) for p in self.parameters]
        self.outer = OUTER(self.anchors_as_params())
        self.num_peers = num_peers
        self.local_epoch = 0
        self.others: list[tuple[float, list[torch.Tensor]]] = []
        self.other_metadata: list[dict] = []
        self.fail: Exception | None = None
        self.partial = False
        self.skipped = 0

    def anchors_as_params(self):
        self.anchors = [torch.nn.Parameter(a) for a in self.anchors]
        return self.anchors

    @contextlib.contextmanager
    def buffers(self):
        yield self._buffers

    def average(self, weight: float) -> protocol.DiLoCoRoundEvidence:
        if self.fail is not None:
            raise self.fail
        mine = {"epoch": self.local_epoch, "anchor": fingerprint(self.anchors)}
        metadata = [mine] + (self.other_metadata or [mine] * len(self.others))
        group = {f"peer{i}": m for i, m in enumerate(metadata)}
        if self.partial:  # (the buffers keep this peer's values where the average did not arrive)
            return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group, received=0.9, included=1.0)
        total = weight + sum(w for w, _ in self.others)
        for i, b in enumerate(self._buffers):
            b.copy_((weight * b + sum(w * g[i] for w, g in self.others)) / total)
        return protocol.DiLoCoRoundEvidence(0, 0, 0.0, group=group)

    def skip_averaging(self) -> None:
        self.skipped += 1

    @torch.no_grad()
    def outer_step(self, increment_epoch: bool = True) -> None:
        for a, b in zip(self.anchors, self._buffers, strict=True):
            a.grad = b.clone()
        self.outer.step()
        for p, a in zip(self.parameters, self.anchors, strict=True):
            p.copy_(a)
        self.local_epoch += int(increment_epoch)

    @torch.no_grad()
    def reanchor(self, source=None) -> None:
        for a, p in zip(self.anchors, source or self.parameters, strict=True):
            a.copy_(p)


def trained(num_peers: int = 1, steps: int = 3, guard: NonFiniteGuard | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    diloco, swarm = DiLoCo(inner, guard), FakeSwarm(model, num_peers)
    for _ in range(steps):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        diloco.inner_step(8)
        inner.zero_grad()
    return model, diloco, swarm


def test_alone_the_outer_optimizer_steps_from_the_anchor_with_the_pseudo_gradient():
    model, diloco, swarm = trained()
    anchor = [a.detach().clone() for a in swarm.anchors]
    pseudo = [a - p.detach() for a, p in zip(anchor, model.parameters(), strict=True)]
    outcome = diloco.run_round(swarm)
    assert outcome.applied and outcome.reason == "alone" and outcome.weight == 24 and swarm.skipped == 1
    reference = [torch.nn.Parameter(a.clone()) for a in anchor]
    ref_opt = OUTER(reference)
    for r, g in zip(reference, pseudo, strict=True):
        r.grad = g
    ref_opt.step()
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference, strict=True))
    assert diloco.pending_samples == 0 and diloco.rounds_applied == 1


def test_the_average_is_weighted_by_samples():
    model, diloco, swarm = trained(num_peers=2)
    mine = [a - p.detach() for a, p in zip(swarm.anchors, model.parameters(), strict=True)]
    other = [torch.ones_like(g) for g in mine]
    swarm.others = [(8.0, other)]
    outcome = diloco.run_round(swarm)
    assert outcome.applied and outcome.group_size == 2 and outcome.weight == 24
    with swarm.buffers() as buffers:
        for b, m, o in zip(buffers, mine, other, strict=True):
            torch.testing.assert_close(b, (24 * m + 8 * o) / 32)


@pytest.mark.parametrize("case", ["averaging fails", "no quorum", "non-finite average"])
def test_a_round_that_cannot_be_applied_keeps_the_local_progress(case):
    guard = NonFiniteGuard()
    model, diloco, swarm = trained(num_peers=3, guard=guard)
    before = [p.detach().clone() for p in model.parameters()]
    anchor = [a.detach().clone() for a in swarm.anchors]
    if case == "averaging fails":
        swarm.fail = ConnectionError("peer gone")
    elif case == "no quorum":
        swarm.others = []  # a group of 1 among 3 peers
    else:
        swarm.others = [(8.0, [torch.full_like(p, float("nan")) for p in before]), (8.0, before)]
    outcome = diloco.run_round(swarm)
    assert not outcome.applied and swarm.local_epoch == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(swarm.anchors, anchor, strict=True))
    assert diloco.pending_samples == 24 and diloco.rounds_failed == 1 and not diloco.needs_sync
    assert guard.refused_updates == (1 if case == "non-finite average" else 0)


def test_a_peer_whose_anchor_differs_from_its_group_resyncs_keeping_all_its_progress():
    """It took part with weight 0 (protocol.diloco_contributes): its pseudo-gradient is not in the group's
    round, so all its progress since its own anchor stays for its next round, after the download."""
    model, diloco, swarm = trained(num_peers=3)
    anchors = [a.detach().clone() for a in swarm.anchors]
    before = [p.detach().clone() for p in model.parameters()]
    other_anchor = {"epoch": 0, "anchor": fingerprint([a + 1 for a in swarm.anchors])}
    swarm.others = [(8.0, [torch.zeros_like(p) for p in swarm.parameters])] * 2
    swarm.other_metadata = [other_anchor, other_anchor]
    outcome = diloco.run_round(swarm)
    assert not outcome.applied and outcome.reason == "anchor differs" and diloco.needs_sync
    assert diloco.pending_samples == 24
    assert all(torch.equal(a, b) for a, b in zip(swarm.anchors, anchors, strict=True))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_non_finite_local_pseudo_gradient_is_not_contributed():
    guard = NonFiniteGuard()
    model, diloco, swarm = trained(num_peers=2, guard=guard)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    other = [torch.ones_like(p) for p in swarm.parameters]
    swarm.others = [(8.0, other)]
    outcome = diloco.run_round(swarm)
    assert outcome.applied and outcome.weight == 0.0 and guard.refused_steps == 1
    with swarm.buffers() as buffers:  # the average is the other peer's alone: nothing of this peer's NaN
        assert all(torch.equal(b, o) for b, o in zip(buffers, other, strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def inner_steps(model: torch.nn.Module, diloco: DiLoCo, steps: int = 1, samples: int = 8) -> None:
    for _ in range(steps):
        model(torch.randn(samples, 4)).pow(2).mean().backward()
        diloco.inner_step(samples)
        diloco.inner.zero_grad()


@pytest.mark.parametrize("anchor_moved", [True, False])
def test_after_a_partial_round_a_download_keeps_the_progress_the_swarm_has_not_applied(anchor_moved):
    """A download of the next epoch tells whether the others applied the round (the anchor moved): then the peer
    keeps only what came after its pseudo-gradient; else everything since its anchor."""
    model, diloco, swarm = trained(num_peers=3)  # 24 samples since the anchor
    swarm.partial = True
    contributed = [p.detach().clone() for p in model.parameters()]
    outcome = diloco.run_round(swarm)
    assert not outcome.applied and diloco.needs_sync  # no next round before the download tells
    assert diloco.pending_samples == 24 and all(torch.equal(b, c) for b, c in zip(diloco.delivered[0], contributed,
                                                                                 strict=True))
    inner_steps(model, diloco)  # 8 more samples before the download
    now = [p.detach().clone() for p in model.parameters()]
    old_anchor = [a.detach().clone() for a in swarm.anchors]
    progress, since = diloco.progress_to_keep(swarm)
    with torch.no_grad():  # the download: the swarm's anchor, moved by the round if the others applied it
        for p, a in zip(model.parameters(), swarm.anchors, strict=True):
            a.add_(0.5 if anchor_moved else 0.0)
            p.copy_(a)
    swarm.local_epoch = 1  # (the round was of epoch 0)
    diloco.restore_after_download(swarm, progress, since, downloaded=True, anchor_moved=anchor_moved)
    kept = ([n - c for n, c in zip(now, contributed, strict=True)] if anchor_moved  # applied: only what came after
            else [n - a for n, a in zip(now, old_anchor, strict=True)])  # not applied: everything since the anchor
    for p, a, k in zip(model.parameters(), swarm.anchors, kept, strict=True):
        torch.testing.assert_close(p.detach(), a.detach() + k)
    assert diloco.pending_samples == (8 if anchor_moved else 32) and diloco.delivered is None


def test_a_download_of_the_rounds_own_epoch_does_not_tell_whether_the_round_was_applied():
    """The state of a peer still at the partial round's epoch (its all-reduce done, its outer step not yet) holds the
    old anchor though that peer is about to apply the round: the peer keeps all its progress and the round, and the
    download of the next epoch decides (its pseudo-gradient counted once)."""
    model, diloco, swarm = trained(num_peers=3)
    swarm.partial = True
    contributed = [p.detach().clone() for p in model.parameters()]
    diloco.run_round(swarm)
    inner_steps(model, diloco)  # 8 more samples
    now = [p.detach().clone() for p in model.parameters()]
    progress, since = diloco.progress_to_keep(swarm)
    assert diloco.restore_after_download(swarm, progress, since, downloaded=True, anchor_moved=False)  # (epoch 0)
    for p, n in zip(model.parameters(), now, strict=True):
        torch.testing.assert_close(p.detach(), n)
    assert diloco.delivered is not None and diloco.pending_samples == 32
    progress, since = diloco.progress_to_keep(swarm)
    with torch.no_grad():  # the next download: epoch 1, the anchor the round moved
        for p, a in zip(model.parameters(), swarm.anchors, strict=True):
            a.add_(0.5)
            p.copy_(a)
    swarm.local_epoch = 1
    assert not diloco.restore_after_download(swarm, progress, since, downloaded=True, anchor_moved=True)
    for p, a, n, c in zip(model.parameters(), swarm.anchors, now, contributed, strict=True):
        torch.testing.assert_close(p.detach(), a.detach() + n - c)
    assert diloco.pending_samples == 8 and diloco.delivered is None


def test_downloads_that_keep_finding_the_rounds_epoch_conclude_it_was_not_applied():
    """Every peer asked is still at the partial round's epoch, UNDECIDED_DOWNLOADS times: nobody applied it; the
    peer keeps its whole progress and contributes it in its next round (no endless downloads)."""
    from collabopt.diloco import UNDECIDED_DOWNLOADS

    model, diloco, swarm = trained(num_peers=3)
    swarm.partial = True
    diloco.run_round(swarm)
    owed = []
    for _ in range(UNDECIDED_DOWNLOADS):
        progress, since = diloco.progress_to_keep(swarm)
        owed.append(diloco.restore_after_download(swarm, progress, since, downloaded=True, anchor_moved=False))
    assert owed == [True] * (UNDECIDED_DOWNLOADS - 1) + [False]
    assert diloco.delivered is None and diloco.pending_samples == 24


def test_a_failed_download_after_a_partial_round_keeps_what_it_must_decide():
    model, diloco, swarm = trained(num_peers=3)
    swarm.partial = True
    diloco.run_round(swarm)
    before = [p.detach().clone() for p in model.parameters()]
    progress, since = diloco.progress_to_keep(swarm)
    assert diloco.restore_after_download(swarm, progress, since, downloaded=False, anchor_moved=False)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert diloco.delivered is not None and diloco.pending_samples == 24  # the next download decides


def test_overlap_a_partial_round_remembers_where_its_pseudo_gradient_was_taken():
    model, diloco, swarm = trained(num_peers=3)
    diloco.overlap = True
    diloco.start_round(swarm)
    base = diloco.pending.base
    inner_steps(model, diloco)
    outcome = diloco.land_round(swarm, protocol.DiLoCoRoundEvidence(0, 0, 0.0, group={"peer0": {}}, received=0.9))
    assert not outcome.applied and diloco.needs_sync and diloco.pending_samples == 32
    assert diloco.delivered[0] is base and diloco.delivered[1] == 24


def test_other_failures_and_restarts_leave_no_partial_round_behind():
    model, diloco, swarm = trained(num_peers=3)
    swarm.fail = ConnectionError("peer gone")  # its pseudo-gradient never left: kept for the next round
    diloco.run_round(swarm)
    assert diloco.delivered is None and not diloco.needs_sync
    swarm.fail, swarm.partial = None, True
    diloco.run_round(swarm)
    assert diloco.delivered is not None
    diloco.restart_from_last_round(swarm)  # (NaN): back at the anchor, nothing left to keep
    assert diloco.delivered is None
    diloco.run_round(swarm)
    swarm.partial = False
    diloco.run_round(swarm)  # a round since (its download failed): what it sent is what counts from now on
    assert diloco.delivered is None


def nan_inner_step(model: torch.nn.Module, diloco: DiLoCo) -> None:
    """An inner step whose weight gradient is NaN (the bias's stays finite)."""
    model(torch.randn(8, 4)).pow(2).mean().backward()
    model.weight.grad[0, 0] = float("nan")
    diloco.inner_step(8)
    diloco.inner.zero_grad()


def test_non_finite_parameters_restart_from_the_last_round_with_the_inner_statistics_they_spoiled_reset():
    guard = NonFiniteGuard()
    model, diloco, swarm = trained(guard=guard)
    bias_state = {k: v.clone() for k, v in diloco.inner.state[model.bias].items()}
    nan_inner_step(model, diloco)
    assert not torch.isfinite(model.weight).all()
    assert not torch.isfinite(diloco.inner.state[model.weight]["exp_avg"]).all()
    undone = diloco.pending_samples
    diloco.restart_from_last_round(swarm)
    assert undone > 0 and diloco.samples_discarded == undone  # (a CollaborativeOptimizer's samples_skipped)
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), swarm.anchors, strict=True))
    assert model.weight not in diloco.inner.state  # AdamW starts its statistics afresh for the weight only
    assert diloco.inner.state[model.bias]["exp_avg"].isfinite().all()
    assert not torch.equal(diloco.inner.state[model.bias]["exp_avg"], bias_state["exp_avg"])  # (the NaN step's)
    assert diloco.pending_samples == 0 and guard.refused_steps == 1
    model(torch.randn(8, 4)).pow(2).mean().backward()  # training goes on, and the next round contributes it
    diloco.inner_step(8)
    outcome = diloco.run_round(swarm)
    assert outcome.applied and outcome.weight == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_with_a_round_in_flight_a_restart_goes_back_to_where_that_round_started():
    model, diloco, swarm = trained(num_peers=2)
    diloco.overlap = True
    swarm.others = [(8.0, [torch.ones_like(p) for p in swarm.parameters])]
    weight = diloco.start_round(swarm)
    base = [p.detach().clone() for p in model.parameters()]
    gathered = swarm.average(weight)
    nan_inner_step(model, diloco)
    diloco.restart_from_last_round(swarm)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), base, strict=True))
    outcome = diloco.land_round(swarm, gathered)  # the round lands with no progress made meanwhile
    assert outcome.applied
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), swarm.anchors, strict=True))


class FakeDiLoCoPeer(FakePeer):
    """A DiLoCo peer on a :class:`FakeSwarm` whose round is far away: every step applies the inner optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module):
        super().__init__(optimizer, target_batch_size=10**9)
        self.swarm = FakeSwarm(model)
        self.diloco: DiLoCo | None = None  # the core's (set once it is built)

    def step(self, samples: int | None) -> bool:
        self.calls.append("step")
        self.diloco.inner_step(samples)
        return True

    def accumulators(self) -> None:
        return None

    def restart_from_last_round(self) -> None:
        self.calls.append("restart")
        self.diloco.restart_from_last_round(self.swarm)


def diloco_core() -> tuple[torch.nn.Module, CollaborativeOptimizer, FakeDiLoCoPeer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    peer = FakeDiLoCoPeer(inner, model)
    copt = CollaborativeOptimizer(inner, outer_optimizer=OUTER, peer=peer, handle_signals=False, **SWARM)
    peer.diloco = copt.diloco
    return model, copt, peer


def test_a_nodes_core_refuses_a_non_finite_step_before_any_rank_takes_it():
    model, copt, peer = diloco_core()
    copt.check_gradients_each_step()  # (NodeOptimizer's rank 0: every rank takes the inner steps)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    model.weight.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    result = copt.step(batch_size=8)
    assert result.skipped == 8 and "step" not in peer.calls and copt.nonfinite_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    copt.close()


def test_diloco_checkpoints_hold_finite_parameters():
    model, copt, peer = diloco_core()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    copt.step(batch_size=8)
    copt.zero_grad()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    state = copt.state_dict()  # checked now (not on the guard's schedule): the peer restarts first
    assert "restart" in peer.calls and all(torch.isfinite(p).all() for p in model.parameters())
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="not finite"):  # loaded parameters would become the anchor it serves
        copt.load_state_dict(state)
    copt.close()


def test_the_core_checks_diloco_parameters_on_the_guards_schedule_not_at_every_step(monkeypatch):
    monkeypatch.setattr(guard_module, "PARAMETER_CHECK_INTERVAL", 3600.0)
    checks = []
    check = NonFiniteGuard.parameters_finite
    monkeypatch.setattr(NonFiniteGuard, "parameters_finite", lambda self, ps: checks.append(1) or check(self, ps))
    model, copt, peer = diloco_core()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    copt.step(batch_size=8)
    copt.zero_grad()
    assert len(checks) == 1  # the first step's (none was due before)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    model.weight.grad[0, 0] = float("nan")
    copt.step(batch_size=8)  # not checked: applied, as every inner step is
    copt.zero_grad()
    assert len(checks) == 1 and not torch.isfinite(model.weight).all() and "restart" not in peer.calls
    copt._guard._next_check = -float("inf")  # the interval has passed
    model(torch.randn(8, 4)).pow(2).mean().backward()
    copt.step(batch_size=8)
    assert len(checks) == 2 and "restart" in peer.calls and copt.nonfinite_steps == 1
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), peer.swarm.anchors, strict=True))
    copt.close()


def test_local_progress_survives_a_state_download():
    model, diloco, swarm = trained()
    progress = diloco.local_progress(swarm)
    with torch.no_grad():
        for a in swarm.anchors:
            a.add_(0.5)  # the downloaded anchor
    diloco.restore_progress(swarm, progress)
    for p, a, d in zip(model.parameters(), swarm.anchors, progress, strict=True):
        torch.testing.assert_close(p.detach(), a.detach() + d)


def test_the_canonical_anchor_is_the_newest_epoch_then_the_majority():
    x, y, z = [1.0, 2.0, 3.0], [1.5, 2.0, 3.0], [9.0, 9.0, 9.0]
    e = lambda epoch, fp: {"epoch": epoch, "anchor": fp}  # noqa: E731
    assert agrees_with_group(e(3, x), [e(3, x), e(3, x), e(3, y)])
    assert not agrees_with_group(e(3, y), [e(3, x), e(3, x), e(3, y)])
    assert not agrees_with_group(e(2, z), [e(2, z), e(2, z), e(3, x)])  # behind: the newest epoch wins
    assert agrees_with_group(e(3, x), [e(3, x), e(3, y)])  # a tie: the smaller fingerprint
    assert not agrees_with_group(e(3, y), [e(3, x), e(3, y)])
    assert agrees_with_group(e(3, x), [e(3, x), "garbage", {"epoch": "3"}])
    assert agrees_with_group(e(3, [1.0, 2.0, 3.0 + 1e-9]), [e(3, x), e(3, x)])  # rounding is the same anchor


def test_overlap_applies_the_round_on_top_of_the_progress_made_meanwhile():
    model, diloco, swarm = trained(num_peers=2)
    anchor = [a.detach().clone() for a in swarm.anchors]
    swarm.others = [(8.0, [torch.ones_like(p) for p in swarm.parameters])]
    weight = diloco.start_round(swarm)  # the all-reduce would now run in the background
    assert weight == 24 and diloco.pending_samples == 0
    base = [p.detach().clone() for p in model.parameters()]
    gathered = swarm.average(weight)
    for _ in range(2):  # inner steps while it runs
        model(torch.randn(8, 4)).pow(2).mean().backward()
        diloco.inner_step(8)
        diloco.inner.zero_grad()
    progress = [p.detach() - b for p, b in zip(model.parameters(), base, strict=True)]
    outcome = diloco.land_round(swarm, gathered)
    assert outcome.applied and swarm.local_epoch == 0  # (the epoch moved when the round started)
    reference = [torch.nn.Parameter(a.clone()) for a in anchor]
    ref_opt = OUTER(reference)
    with swarm.buffers() as buffers:
        for r, b in zip(reference, buffers, strict=True):
            r.grad = b.clone()
    ref_opt.step()
    for p, a, r, d in zip(model.parameters(), swarm.anchors, reference, progress, strict=True):
        torch.testing.assert_close(a.detach(), r.detach())
        torch.testing.assert_close(p.detach(), r.detach() + d)
    assert diloco.pending_samples == 16 and diloco.rounds_applied == 1


def test_overlap_keeps_a_failed_round_and_resyncs():
    model, diloco, swarm = trained(num_peers=3)
    anchor = [a.detach().clone() for a in swarm.anchors]
    diloco.start_round(swarm)
    before = [p.detach().clone() for p in model.parameters()]
    outcome = diloco.land_round(swarm, TimeoutError("averaging timed out"))
    assert not outcome.applied and diloco.needs_sync  # the epoch moved on: only a download tells
    assert diloco.pending_samples == 24
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(swarm.anchors, anchor, strict=True))


def test_overlap_rounds_needs_diloco_mode(no_network):
    model, opt = model_and_opt()
    with pytest.raises(ConfigurationError, match="overlap_rounds"):
        CollaborativeOptimizer(opt, overlap_rounds=True, **SWARM)
    assert CollabConfig.from_options(outer_optimizer=OUTER, overlap_rounds=True, **SWARM).overlap_rounds


def test_overlap_a_round_with_another_anchor_keeps_all_the_progress():
    """Its averager took part with weight 0: the pseudo-gradient in flight stays this peer's progress, with its
    samples, for its next round after the download."""
    model, diloco, swarm = trained(num_peers=2)
    anchors = [a.detach().clone() for a in swarm.anchors]
    swarm.others = [(8.0, [torch.ones_like(p) for p in swarm.parameters])]
    swarm.other_metadata = [{"epoch": 1, "anchor": [1.0, 2.0, 3.0]}]  # the group's newer anchor
    weight = diloco.start_round(swarm)
    gathered = swarm.average(weight)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    diloco.inner_step(8)
    before = [p.detach().clone() for p in model.parameters()]
    outcome = diloco.land_round(swarm, gathered)
    assert not outcome.applied and diloco.needs_sync and diloco.pending is None
    assert all(torch.equal(a, b) for a, b in zip(swarm.anchors, anchors, strict=True))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert diloco.pending_samples == weight + 8


@pytest.mark.parametrize(("overlap", "needs_sync", "local", "global_", "samples", "expected"), [
    (False, False, 3, 3, 64, False),
    (False, False, 3, 4, 64, True),  # an anchor one round old is stale (hivemind would tolerate it)
    (False, True, 3, 3, 64, True),  # its anchor disagreed with its group's
    (True, False, 3, 4, 64, False),  # overlap: the others started the round this peer trained toward: it joins
    (True, False, 3, 4, 0, True),  # ... a peer with nothing to contribute (just joined) downloads
    (True, False, 3, 5, 64, True),
    (True, True, 3, 3, 64, True),
])
def test_when_a_peer_downloads_the_swarms_state(overlap, needs_sync, local, global_, samples, expected):
    from collabopt.diloco import should_download

    _, diloco, _ = trained()
    diloco.overlap, diloco.needs_sync, diloco.pending_samples = overlap, needs_sync, samples
    assert should_download(diloco, local, global_) is expected


def gate_only(kind: str):
    """A progress tracker's gate alone (no DHT, no thread started), built as its __init__ builds it."""
    import threading


    tracker_class = (progress.SwarmProgressTracker if kind == "synchronous"
                     else diloco_round.ThrottledProgressTracker)
    tracker = object.__new__(tracker_class)
    threading.Thread.__init__(tracker)
    tracker.min_refresh_period, tracker.max_refresh_period, tracker._last_round = 60.0, 600.0, None
    tracker._report_lock = threading.RLock()
    tracker.should_report_progress = progress._GatedEvent(tracker._may_report)
    return tracker


@pytest.mark.parametrize("kind", ["synchronous", "diloco"])
def test_the_progress_reporter_is_woken_at_most_once_per_report_period(kind):
    """hivemind's reporter thread stores a record each time its event is set (~25 kB sent per store on the WAN bed):
    steps set it at most once per report period, changes of epoch or drops at once, and a count held back goes out
    when its period ends."""
    import time

    tracker = gate_only(kind)
    event = tracker.should_report_progress

    def report(gated: bool) -> bool:
        event.clear()
        tracker._gated = gated
        event.set()
        tracker._gated = False
        return event.is_set()

    assert report(gated=True)  # the first report goes out
    assert not report(gated=True)  # the next step's waits for the report period
    assert report(gated=False)  # an epoch change does not wait
    tracker._flush.cancel()
    tracker._flush = None
    tracker._next_report = 0.0  # the period is over
    assert report(gated=True)
    if kind == "diloco":
        from hivemind.utils import get_dht_time

        tracker._epoch_began = get_dht_time() - 800.0  # before a whole round: a quarter of the round so far
        assert report(gated=False)
        assert tracker._next_report - time.monotonic() == pytest.approx(200.0, abs=5.0)
        tracker._last_round = 1600.0  # long rounds: one store per quarter of the last round
        assert report(gated=False)
        assert tracker._next_report - time.monotonic() == pytest.approx(400.0, abs=5.0)
    tracker._next_report = time.monotonic() + 2.0
    assert not report(gated=True)  # held back ...
    assert event.wait(timeout=20.0)  # ... and sent when its period ends
    assert tracker._flush is None


def test_a_held_back_count_waits_for_the_period_of_an_epoch_change_sent_meanwhile():
    import time

    tracker = gate_only("synchronous")
    tracker.min_refresh_period = 1.5
    event = tracker.should_report_progress
    tracker._next_report = time.monotonic() + 0.5
    tracker._gated = True
    event.set()  # held back until the period ends (0.5 s) ...
    tracker._gated = False
    assert not event.is_set()
    event.set()  # ... but an epoch change goes out now: its period (1.5 s) starts
    event.clear()
    time.sleep(1.0)
    assert not event.is_set()  # the held-back count did not go out right after it
    assert event.wait(timeout=20.0)


def test_a_step_reports_at_once_only_a_new_epoch_or_a_smaller_count(monkeypatch):
    from types import SimpleNamespace

    tracker = gate_only("synchronous")
    seen = []
    monkeypatch.setattr(progress.SwarmProgressTracker, "_record_local_progress",
                        lambda self, epoch, samples, update=True: seen.append(self._gated))
    tracker.local_progress = SimpleNamespace(epoch=3, samples_accumulated=64)
    for epoch, samples in ((3, 96), (4, 0), (3, 32)):
        tracker.report_local_progress(epoch, samples)
    assert seen == [True, False, False] and not tracker._gated


def test_a_long_round_spaces_the_progress_records_out():
    assert report_period(None, 0.5, 30.0) == 0.5  # no round yet: as often as peers fetch them
    assert report_period(1.6, 0.5, 30.0) == 0.5  # short rounds (the tests'): unchanged
    assert report_period(33.0, 0.5, 30.0) == pytest.approx(8.25)  # 600 steps of 55 ms: a quarter
    assert report_period(118.0, 0.5, 30.0) == pytest.approx(29.5)  # B6's 2,000 steps
    assert report_period(1000.0, 0.5, 30.0) == 30.0  # never longer than max_refresh_period


def test_out_of_sync_says_a_download_is_pending():
    _, copt, _ = diloco_core()
    assert not copt.out_of_sync
    copt.diloco.needs_sync = True  # (a round found its anchor apart from its group's, or was partial)
    assert copt.out_of_sync


def test_samples_skipped_counts_the_inner_steps_a_restart_undid():
    copt = CollaborativeOptimizer.__new__(CollaborativeOptimizer)  # (only the counters)
    copt._samples_skipped = 3  # dropped by the guard
    copt.diloco = DiLoCo(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    copt.diloco.samples_discarded = 5
    assert copt.samples_skipped == 8
    copt.diloco = None  # the synchronous mode
    assert copt.samples_skipped == 3


def test_a_diloco_peers_view_of_the_swarm_is_never_older_than_its_fetch_period(monkeypatch):
    """(docs/decisions.md, "DiLoCo: no round alone on an old view of the swarm") The tracker fetches at least every
    max_fetch_period (after a whole round: its report period, if longer), whatever hivemind's ETA-based period
    says; a peer about to take a round alone fetches anew and waits for that view."""
    import threading
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from collabopt.engine.diloco_round import DiLoCoLoop, ThrottledProgressTracker
    from collabopt.engine.progress import SwarmProgressTracker

    monkeypatch.setattr(SwarmProgressTracker, "_parse_swarm_progress_data",
                        lambda self, metadata: SimpleNamespace(next_fetch_time=get_dht_time() + 10.0))
    tracker = object.__new__(ThrottledProgressTracker)
    tracker.max_fetch_period, tracker.min_refresh_period, tracker.max_refresh_period = 1.0, 0.5, 10.0
    assert tracker._parse_swarm_progress_data({}).next_fetch_time <= get_dht_time() + 1.0
    tracker._epoch_began = get_dht_time() - 2.0  # 2 s into a round: never longer than max_fetch_period
    assert tracker.fetch_period() == 1.0
    tracker._epoch_began = get_dht_time() - 12.0  # 12 s into it: the others store once per 3 s at least
    assert tracker.fetch_period() == pytest.approx(3.0, abs=0.1)
    tracker._last_round = 16.0  # after a whole round: the others' records change once per report period (4 s)
    assert tracker.fetch_period() == tracker.report_period() == 4.0
    assert get_dht_time() + 3.9 < tracker._parse_swarm_progress_data({}).next_fetch_time <= get_dht_time() + 4.0
    tracker._last_round = 3.0  # short rounds: never longer than max_fetch_period
    assert tracker.fetch_period() == 1.0

    class Fetcher:  # the tracker's fetcher: a new view once asked (global_state_updated)
        def __init__(self):
            self.global_progress = SimpleNamespace(next_fetch_time=get_dht_time() + 10.0, num_peers=1)
            self.global_state_updated = SimpleNamespace(set=lambda: threading.Timer(0.05, self._fetch).start())
            self.pause_updates = contextlib.nullcontext

        def _fetch(self):
            self.global_progress = SimpleNamespace(next_fetch_time=get_dht_time() + 0.5, num_peers=3)

    optimizer = SimpleNamespace(tracker=Fetcher())
    DiLoCoLoop._refresh_swarm_view(optimizer, timeout=5.0)
    assert optimizer.tracker.global_progress.num_peers == 3  # it waited for the fresh view


def test_a_step_that_ends_a_failed_round_still_counts_its_samples():
    """(a fresh-clone suite's Trainer DiLoCo test: 572 of 580 samples reported) The step that starts a round reports
    its samples first; a round that fails resets the count toward the next round to zero, so the count before and
    after the step are both 0: the count cannot tell it from a dropped step. The loop says which it was."""
    from types import SimpleNamespace

    from collabopt.engine.peer import DiLoCoPeer

    diloco = SimpleNamespace(last_round=None, pending_samples=0)
    diloco.inner_step = lambda samples: setattr(diloco, "pending_samples", diloco.pending_samples + samples)
    tracker = SimpleNamespace(local_progress=SimpleNamespace(samples_accumulated=0))

    def step(batch_size: int | None = None) -> bool:  # the loop's step: report, then the round, which fails
        diloco.last_round = RoundOutcome(False, "averaging failed", weight=float(batch_size), num_peers=2)
        return True

    peer = object.__new__(DiLoCoPeer)
    peer.diloco, peer.loop = diloco, SimpleNamespace(step=step, tracker=tracker, local_epoch=3)
    assert peer.step(8) is True and diloco.pending_samples == 8
    peer.loop.step = lambda batch_size=None: False  # dropped (a download nobody served): the loop says so
    assert peer.step(8) is False


def test_a_member_whose_anchor_is_not_its_groups_is_judged_so_before_the_all_reduce():
    """The round reads the metadata its group gathered and judges this member as DiLoCo's verdict will after it: one
    whose anchor differs takes part with weight 0 (protocol.diloco_contributes)."""
    ours, theirs = {"epoch": 3, "anchor": [1.0, 2.0, 3.0]}, {"epoch": 3, "anchor": [4.0, 5.0, 6.0]}

    def group(*metadata):
        return dict(zip(("me", "b", "c")[:len(metadata)], metadata, strict=True))

    assert protocol.diloco_contributes(group(ours, ours, theirs), "me")
    assert not protocol.diloco_contributes(group(theirs, ours, ours), "me")
    assert not protocol.diloco_contributes(group(dict(ours, epoch=2), ours), "me")  # an older epoch
    assert protocol.diloco_contributes(group(None, ours), "me")  # it cannot tell: the round judges
    assert protocol.diloco_contributes({"b": ours}, "me")  # (not in its own group: the verdict after it decides)


def test_an_overlapped_round_lands_before_the_peer_serves_its_state_again():
    """(helper-25's review) While a round is in flight the peer's epoch is the next one and its anchor the last one's,
    so it serves nothing. Sharing resumes after the outer step moved the anchor, never before: a download in between
    would get the old anchor labelled with the new epoch."""
    from types import SimpleNamespace

    from collabopt.engine.diloco_round import DiLoCoLoop
    from collabopt.interface import RoundOutcome

    loop = DiLoCoLoop.__new__(DiLoCoLoop)
    state_averager = SimpleNamespace(allow_state_sharing=False, local_epoch=5)
    sharing_while_landing = []

    def land_round(swarm, result):
        sharing_while_landing.append(state_averager.allow_state_sharing)
        return RoundOutcome(True, "averaged")

    control = SimpleNamespace(done=lambda: True, result=lambda: "the service's result")
    vars(loop).update(_in_flight=control, _sharing_paused=True, state_averager=state_averager, averaging_timeout=1.0,
                      grad_averager=SimpleNamespace(report=lambda result: result),
                      diloco=SimpleNamespace(land_round=land_round), _share_state=lambda: None,
                      status_loglevel=10)
    loop.land(wait=True)
    assert sharing_while_landing == [False] and state_averager.allow_state_sharing is True


@pytest.mark.parametrize("applied", [True, False])
def test_a_round_serves_no_state_until_it_lands(applied):
    """(a late joiner's flake under load) From the round's start, its wait for its group included, to its outer step,
    the peer serves no state, as the synchronous mode's boundary: a state served then is this epoch's anchor, about to
    be replaced, and its downloader, too late for this round's group, met the next round's with an old anchor
    (weight 0, download again). Downloads open again once the round is decided."""
    import threading
    from types import SimpleNamespace

    from collabopt.engine.diloco_round import DiLoCoLoop
    from collabopt.engine.state import ConsistentStateAverager

    state_averager = ConsistentStateAverager.__new__(ConsistentStateAverager)  # (only its download gate)
    vars(state_averager).update(_open_for_downloads=threading.Event(), _closing_lock=threading.Lock(), _closings=0,
                                _epoch=4)
    state_averager._open_for_downloads.set()
    open_during_round = []

    def run_round(swarm):
        open_during_round.append(state_averager._open_for_downloads.is_set())
        return RoundOutcome(applied, "averaged" if applied else "averaging failed")

    tracker = SimpleNamespace(global_epoch=4, global_progress=SimpleNamespace(num_peers=3, samples_accumulated=0),
                              pause_updates=contextlib.nullcontext, update_epoch=lambda new_epoch: None,
                              report_local_progress=lambda *args, **kwargs: None,
                              global_state_updated=threading.Event())
    diloco = SimpleNamespace(needs_sync=False, overlap=False, pending_samples=8, run_round=run_round)
    loop = DiLoCoLoop.__new__(DiLoCoLoop)
    vars(loop).update(_in_flight=None, state_averager=state_averager, tracker=tracker, diloco=diloco,
                      grad_averager=SimpleNamespace(reset_accumulated_grads_=lambda: None),
                      _share_state=lambda: None, status_loglevel=10)
    loop.end_epoch()
    assert open_during_round == [False] and state_averager._open_for_downloads.is_set()
