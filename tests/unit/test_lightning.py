"""Lightning adapter, no swarm: bad arguments and unsupported modules are refused before any network starts."""

from __future__ import annotations

import functools

import pytest
import torch

# ---------------------------------------------------------------------------------------------- no swarm


def test_bad_arguments_are_refused_before_any_network():
    from collabopt.integrations.lightning import CollaborativeStrategy, HivemindStrategy

    from collabopt import ConfigurationError

    assert HivemindStrategy is CollaborativeStrategy
    with pytest.raises(ConfigurationError, match="target_batch_sise"):
        CollaborativeStrategy(target_batch_size=64, target_batch_sise=32)
    with pytest.raises(ConfigurationError, match="initial_peers"):
        CollaborativeStrategy(target_batch_size=64, initial_peers=["/ip4/1.2.3.4/tcp/notaport"])
    with pytest.raises(ConfigurationError, match="target_batch_size"):
        CollaborativeStrategy(target_batch_size=0)
    with pytest.raises(ConfigurationError, match="scheduler_fn"):
        CollaborativeStrategy(target_batch_size=64, scheduler_fn=3)


def test_signature_is_a_drop_in_for_lightning_hivemind():
    """Same parameter names, order and defaults as lightning-hivemind's HivemindStrategy (reference 003), plus its
    DHT options; hivemind options (compression, PowerSGD) are accepted through **optimizer_kwargs."""
    import inspect

    from collabopt.integrations.lightning import CollaborativeStrategy
    from hivemind.compression import Float16Compression
    from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

    reference = dict(target_batch_size=inspect.Parameter.empty, run_id="lightning_run", batch_size=None,
                     delay_state_averaging=False, delay_optimizer_step=None, delay_grad_averaging=False,
                     offload_optimizer=None, reuse_grad_buffers=False, scheduler_fn=None, matchmaking_time=5.0,
                     averaging_timeout=30.0, verbose=False, averager_opts=None, host_maddrs=None, initial_peers=None)
    params = list(inspect.signature(CollaborativeStrategy.__init__).parameters.values())[1:]
    assert [p.name for p in params[:len(reference)]] == list(reference)
    assert {p.name: p.default for p in params[:len(reference)]} == reference
    names = {p.name for p in params}
    assert {"use_ipfs", "wait_timeout", "bootstrap_timeout", "use_relay", "use_auto_relay", "identity_path"} <= names
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    strategy = CollaborativeStrategy(
        8192, "run", None, grad_compression=Float16Compression(),
        state_averaging_compression=Float16Compression(),
        grad_averager_factory=functools.partial(PowerSGDGradientAverager, averager_rank=4),
    )
    assert strategy.target_batch_size == 8192 and strategy.run_id == "run"
    assert strategy.num_peers == 1 and strategy.collaborative_optimizer is None  # nothing started yet


def test_bad_initial_peers_env_is_refused(monkeypatch):
    from collabopt.integrations.lightning import CollaborativeStrategy

    from collabopt import ConfigurationError

    monkeypatch.delenv("INITIAL_PEERS", raising=False)
    monkeypatch.setenv("PL_INITIAL_PEERS", "not-a-multiaddr")
    with pytest.raises(ConfigurationError, match="PL_INITIAL_PEERS"):
        CollaborativeStrategy(target_batch_size=64)


@pytest.mark.parametrize("case", ["two_optimizers", "manual", "two_schedulers", "scheduler_fn_and_scheduler"])
def test_unsupported_modules_are_refused_before_joining(case, monkeypatch):
    """Refused when fit sets up, before any DHT starts (so this runs safely inside the pytest process)."""
    import lightning.pytorch as pl
    from collabopt.integrations import lightning as adapter
    from torch.utils.data import DataLoader, TensorDataset

    from collabopt import ConfigurationError

    started = []
    monkeypatch.setattr(adapter.CollaborativeStrategy, "_make_optimizer", lambda *a, **k: started.append(1))

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
            self.automatic_optimization = case not in ("manual", "two_optimizers")  # Lightning: 2 need manual

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1)
            if case == "two_optimizers":
                return [opt, torch.optim.SGD(self.parameters(), lr=0.1)]
            if case == "two_schedulers":
                return [opt], [sched, torch.optim.lr_scheduler.StepLR(opt, 2)]
            if case == "scheduler_fn_and_scheduler":
                return [opt], [sched]
            return opt

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)

    scheduler_fn = None
    if case == "scheduler_fn_and_scheduler":
        scheduler_fn = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1)
    strategy = adapter.CollaborativeStrategy(target_batch_size=64, scheduler_fn=scheduler_fn)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    expected = {"two_optimizers": "one optimizer|2 optimizers", "manual": "manual optimization",
                "two_schedulers": "2 LR schedulers", "scheduler_fn_and_scheduler": "scheduler_fn"}[case]
    with pytest.raises(ConfigurationError, match=expected):
        trainer.fit(Module())
    assert started == []


def test_num_nodes_above_one_is_refused():
    import lightning.pytorch as pl
    from collabopt.integrations.lightning import CollaborativeStrategy

    from collabopt import ConfigurationError

    with pytest.raises(ConfigurationError, match="num_nodes"):
        pl.Trainer(strategy=CollaborativeStrategy(target_batch_size=64), accelerator="cpu", devices=1, num_nodes=2)


def test_schedule_steps_from_its_own_values_after_a_state_download():
    """A peer that reaches epoch k+1 by downloading state gets param groups already stepped by the peer it
    downloaded from; the schedule must not step them again (seen as an LR one step ahead in a Lightning swarm)."""
    from collabopt.scheduling import CollaborativeScheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = CollaborativeScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))
    schedule.advance_to(1)
    opt.param_groups[0]["lr"] = 0.1 * 0.7**2  # downloaded from a peer that is at epoch 2 already
    schedule.advance_to(2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.7**2, rel=1e-12)
    schedule.advance_to(3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.7**3, rel=1e-12)


def test_swarm_metrics_go_to_the_loggers_and_a_few_to_the_progress_bar():
    """The strategy logs the names every adapter logs (collabopt.interface.swarm_metrics)."""
    from types import SimpleNamespace

    from collabopt.integrations._lightning_metrics import PROGRESS_BAR, SwarmMetricsCallback
    from collabopt.integrations.lightning import CollaborativeStrategy

    from collabopt.interface import SNAPSHOT_FIELDS, swarm_metrics, swarm_snapshot

    strategy = CollaborativeStrategy(target_batch_size=64)
    assert strategy.swarm_metrics() == {}  # not fitting
    copt = SimpleNamespace(closed=False, get_lr=lambda: [0.1], **dict(dict.fromkeys(SNAPSHOT_FIELDS, 0),
                                                                          num_peers=2, local_epoch=3))
    copt.metrics = lambda: swarm_snapshot(copt)
    strategy._copt = copt
    assert strategy.swarm_metrics() == swarm_metrics(copt)
    assert {"swarm/num_peers": 2.0, "swarm/local_epoch": 3.0}.items() <= strategy.swarm_metrics().items()
    calls = []
    module = SimpleNamespace(log_dict=lambda values, **kwargs: calls.append((values, kwargs["prog_bar"])))
    SwarmMetricsCallback(strategy.swarm_metrics).on_train_batch_end(
        SimpleNamespace(is_global_zero=True, loggers=[object()]), module)
    bar = {name for values, prog_bar in calls if prog_bar for name in values}
    logged = {name for values, _ in calls for name in values}
    assert bar == set(PROGRESS_BAR) == {"swarm/num_peers", "swarm/local_epoch", "swarm/samples_per_second"}
    assert logged == set(swarm_metrics(copt))


@pytest.mark.parametrize(("sigterm", "calls"), [(False, ["serve_final_state"]), (True, ["flush"])])
def test_a_normal_end_of_training_serves_the_final_state(sigterm, calls):
    """on_train_end (Lightning calls it only where training ended normally) serves the final state for peers still
    behind (serve_final_state flushes first); after a SIGTERM that came with the last batch it only flushes."""
    from types import SimpleNamespace

    from collabopt.integrations.lightning import CollaborativeStrategy

    seen = []
    strategy = CollaborativeStrategy(target_batch_size=64)
    strategy._copt = SimpleNamespace(closed=False, flush=lambda: seen.append("flush"),
                                     serve_final_state=lambda: seen.append("serve_final_state"))
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(received_sigterm=sigterm))
    strategy.on_train_end()
    assert seen == calls
