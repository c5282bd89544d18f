"""Lightning: ``CollaborativeStrategy`` (also importable as ``HivemindStrategy``) trains a ``Trainer`` as a swarm peer.

A drop-in replacement for lightning-hivemind's ``HivemindStrategy``: it accepts the same arguments, so users only
change the import. It is a thin adapter over :class:`collabopt.CollaborativeOptimizer`:

* the optimizer (and scheduler) returned by ``configure_optimizers`` are wrapped when ``Trainer.fit`` sets up;
  the scheduler advances once per global epoch, also with ``offload_optimizer`` / ``delay_*`` (no ``scheduler_fn``
  needed, one is still accepted), and ``ReduceLROnPlateau`` receives the monitored metric;
* the samples of every batch that ``training_step`` trained on are counted, so ``accumulate_grad_batches`` and a
  short last batch are counted exactly;
* ``precision="16-mixed"`` (Lightning's ``torch.amp.GradScaler``) and ``"bf16-mixed"`` work;
* ``devices>1`` on one machine is ONE peer: local DDP all-reduce, only global rank 0 joins the swarm
  (see :mod:`collabopt.node`);
* checkpoints hold the collaborative optimizer state (optimizer statistics, scheduler, local epoch), restored by
  ``Trainer.fit(ckpt_path=...)``;
* swarm metrics (``swarm/num_peers``, ``swarm/local_epoch``, ``swarm/samples_per_second``, ...) go to the progress
  bar and loggers;
  the loss ``training_step`` returns goes to the swarm's monitor (``collabopt monitor``).

Example::

    from collabopt.integrations.lightning import CollaborativeStrategy   # or: import HivemindStrategy

    trainer = Trainer(strategy=CollaborativeStrategy(target_batch_size=8192), accelerator="gpu", devices=1)
    trainer.fit(model)      # other machines: INITIAL_PEERS=<printed address> python train.py
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from typing import Any

import torch
from collabopt.integrations._lightning_compat import (
    DDPStrategy,
    LightningModule,
    LightningOptimizer,
    Strategy,
    Trainer,
    TrainerFn,
    is_overridden,
    rank_zero_warn,
)
from collabopt.integrations._lightning_metrics import SwarmMetricsCallback
from collabopt.integrations._lightning_options import strategy_options
from collabopt.integrations._lightning_signals import sigterm_ends_final_wait

from collabopt.batch_size import infer_batch_size
from collabopt.errors import ConfigurationError
from collabopt.interface import is_collaborative_state, swarm_metrics
from collabopt.node import collaborative_optimizer
from collabopt.scheduling import CollaborativeScheduler, is_scheduler
from collabopt.swarm import print_join_message

INITIAL_PEERS_ENV = ("INITIAL_PEERS", "PL_INITIAL_PEERS")
"""Environment variables read for the initial peers when ``initial_peers`` is not given, the first one set wins."""


def _no_zero_grad(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``LightningModule.optimizer_zero_grad`` with ``reuse_grad_buffers=True``."""


class CollaborativeStrategy(DDPStrategy):
    """Train with a Lightning ``Trainer`` as one peer of a hivemind swarm, across unreliable machines.

    Accepts every argument of lightning-hivemind's ``HivemindStrategy``. The first peer prints how other machines
    join; they run the same script with ``INITIAL_PEERS=...`` (or ``PL_INITIAL_PEERS``, or ``initial_peers=``).

    Args:
        target_batch_size: samples the whole swarm accumulates per global optimizer step (a global epoch).
        run_id: name of the training run, common to all its peers.
        batch_size: fixed samples per batch; by default every batch is measured (first dimension of its tensors).
        delay_state_averaging, delay_optimizer_step, delay_grad_averaging, offload_optimizer: overlap
            communication with computation / keep the optimizer in host memory (``None`` means hivemind's default:
            ``offload_optimizer=False``, ``delay_optimizer_step=delay_grad_averaging``).
        reuse_grad_buffers: accumulate in ``param.grad``; ``optimizer_zero_grad`` of the module is disabled.
        scheduler_fn: ``callable(optimizer) -> scheduler``; not needed: the scheduler from ``configure_optimizers``
            keeps working in every mode.
        matchmaking_time, averaging_timeout, verbose, averager_opts: hivemind options.
        host_maddrs, initial_peers, use_ipfs, wait_timeout, bootstrap_timeout, use_relay, use_auto_relay,
            identity_path: DHT options (``initial_peers`` defaults to ``$INITIAL_PEERS``, then ``$PL_INITIAL_PEERS``).
        log_swarm_metrics: log the swarm's metrics (``swarm/num_peers``, ``swarm/local_epoch``, ...) on every batch.
        **optimizer_kwargs: any other argument of :class:`~collabopt.CollaborativeOptimizer` or
            ``hivemind.Optimizer`` (``grad_compression``, ``state_averaging_compression``,
            ``grad_averager_factory``, ``client_mode``, ``load_state_timeout``, ...).
    """

    strategy_name = "collaborative"

    def __init__(
        self,
        target_batch_size: int,
        run_id: str = "lightning_run",
        batch_size: int | None = None,
        delay_state_averaging: bool = False,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        offload_optimizer: bool | None = None,
        reuse_grad_buffers: bool = False,
        scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        verbose: bool = False,
        averager_opts: dict | None = None,
        host_maddrs: list[str] | None = None,
        initial_peers: str | list[str] | None = None,
        use_ipfs: bool = False,
        wait_timeout: float = 3,
        bootstrap_timeout: float | None = None,
        use_relay: bool = True,
        use_auto_relay: bool = False,
        identity_path: str | None = None,
        log_swarm_metrics: bool = True,
        **optimizer_kwargs: Any,
    ):
        arguments = dict(locals())
        super().__init__(start_method="popen")
        self._options = strategy_options(arguments, INITIAL_PEERS_ENV)  # checks every argument now
        self.target_batch_size = target_batch_size
        self.run_id = run_id
        self.batch_size = batch_size
        self.reuse_grad_buffers = reuse_grad_buffers
        self.log_swarm_metrics = log_swarm_metrics
        self._scheduler_fn = scheduler_fn
        self._copt: Any = None  # the CollaborativeOptimizer (or node wrapper) of the last fit
        self._fit_plan: dict[str, Any] | None = None  # set between setup() and on_train_start()
        self._pending_samples = 0  # samples trained on since the last optimizer step
        self._saved_zero_grad: Any = None
        self._metrics_callback: SwarmMetricsCallback | None = None
        self._original_scheduler_config: tuple[Any, Any] | None = None
        self._original_optimizers: list[torch.optim.Optimizer] | None = None

    # ------------------------------------------------------------------ one process = plain, several = one node

    @property
    def _several_processes(self) -> bool:
        return self.num_processes * self.num_nodes > 1

    def _configure_launcher(self) -> None:
        if self.num_nodes > 1:
            raise ConfigurationError(
                "num_nodes", f"is {self.num_nodes}; each machine is its own peer of the swarm",
                "start one Trainer(num_nodes=1) per machine with the same run_id (INITIAL_PEERS=... on the others)",
            )
        if self._several_processes:
            super()._configure_launcher()
        else:
            self._launcher = None

    def setup_environment(self) -> None:
        if self._several_processes:
            super().setup_environment()
        else:  # one process: no process group, no DDP wrapper
            assert self.accelerator is not None
            self.accelerator.setup_device(self.root_device)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return super()._setup_model(model) if self._several_processes else model

    # ------------------------------------------------------------------ setup / teardown

    def setup(self, trainer: Trainer) -> None:
        if self._several_processes:
            super().setup(trainer)
        else:  # one process: no DDP wrapper, no process group
            Strategy.setup(self, trainer)
        self._fit_plan = self._plan_collaboration() if trainer.state.fn == TrainerFn.FITTING else None

    def _plan_collaboration(self) -> dict[str, Any]:
        """Check what ``configure_optimizers`` returned; nothing touches the network yet."""
        module = self.lightning_module
        assert module is not None
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        if len(optimizers) != 1:
            raise ConfigurationError(
                "configure_optimizers", f"returned {len(optimizers)} optimizers; a swarm peer trains with one",
                "return a single optimizer (and at most one LR scheduler)",
            )
        if not module.automatic_optimization:
            raise ConfigurationError(
                "automatic_optimization", "manual optimization is not supported by CollaborativeStrategy",
                "use automatic optimization (return the loss from training_step, one optimizer)",
            )
        configs = self.lr_scheduler_configs
        if len(configs) > 1:
            raise ConfigurationError(
                "configure_optimizers", f"returned {len(configs)} LR schedulers",
                "return one scheduler (combine several with torch.optim.lr_scheduler.SequentialLR / ChainedScheduler)",
            )
        scheduler_fn = self._scheduler_fn
        if scheduler_fn is not None and configs:
            raise ConfigurationError(
                "scheduler_fn", "was given while configure_optimizers also returns a scheduler",
                "drop scheduler_fn: the scheduler from configure_optimizers keeps working in every mode",
            )
        if configs:  # wrapped now, so that a checkpoint's scheduler state is restored into the wrapper
            self._original_scheduler_config = (configs[0], configs[0].scheduler)
            configs[0].scheduler = CollaborativeScheduler(configs[0].scheduler)
        return {"optimizer": optimizers[0], "saved_state": None}

    def on_train_start(self) -> None:
        """Join the swarm: after Lightning restored a checkpoint, before the first batch."""
        super().on_train_start()
        plan = self._fit_plan
        if plan is None:
            return
        self._fit_plan = None
        configs = self.lr_scheduler_configs
        scheduler = configs[0].scheduler if configs else None
        scheduler_fn = self._scheduler_fn
        if is_scheduler(scheduler_fn):  # lightning-hivemind also took a scheduler instance here
            scheduler, scheduler_fn = scheduler_fn, None
        copt = self._make_optimizer(plan["optimizer"], scheduler=scheduler, scheduler_fn=scheduler_fn)
        self._copt = copt
        self._pending_samples = 0
        if plan["saved_state"] is not None:
            copt.load_state_dict(plan["saved_state"])
        if self._options.get("load_state_on_start", True) and not self._several_processes:
            copt.catch_up()  # the swarm is ahead of this peer (or of its checkpoint); a node caught up when built
        # the optimizer Lightning hands out (trainer.optimizers, LightningModule.optimizers()) is the collaborative
        # one, as with lightning-hivemind: local_epoch, num_peers, metrics() ... are read from it
        self._original_optimizers = list(self.optimizers)
        self.optimizers = [copt]
        module = self.lightning_module
        assert module is not None and module.trainer is not None
        if self.reuse_grad_buffers:
            self._disable_zero_grad(module)
        if self.log_swarm_metrics and self._metrics_callback is None:
            self._metrics_callback = SwarmMetricsCallback(self.swarm_metrics)
            module.trainer.callbacks.append(self._metrics_callback)

    def _make_optimizer(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """A CollaborativeOptimizer, or with several processes a node (only global rank 0 joins the swarm)."""
        options = dict(self._options, run_id=self.run_id, target_batch_size=self.target_batch_size, **kwargs)
        options.setdefault("handle_signals", False)  # Lightning handles SIGTERM: it stops the loop, then teardown
        print_join = options.pop("print_join_message", True)
        options["print_join_message"] = False  # printed below, in Lightning's words
        if not self._several_processes:
            options["load_state_on_start"] = False  # done after the checkpoint is restored, see on_train_start
        # hivemind forks its DHT and averager processes now: they must not inherit Lightning's SIGTERM handler
        # (which only sets a flag), or they ignore the termination hivemind sends them at shutdown
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            copt = collaborative_optimizer(optimizer, **options)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if print_join and copt.dht is not None:  # rank 0 of a node, or the single process
            print_join_message(copt.dht, self.run_id, copt.dht.client_mode, constructor="CollaborativeStrategy")
        return copt

    def _disable_zero_grad(self, module: LightningModule) -> None:
        if is_overridden("optimizer_zero_grad", module):
            rank_zero_warn(
                "CollaborativeStrategy(reuse_grad_buffers=True) disables your optimizer_zero_grad override: "
                "gradients accumulate in param.grad until the swarm averages them, and collabopt clears them after."
            )
        self._saved_zero_grad = module.__dict__.get("optimizer_zero_grad", _no_zero_grad)
        module.optimizer_zero_grad = _no_zero_grad  # type: ignore[method-assign]

    def on_train_end(self) -> None:
        """Training ended normally (an exception, Ctrl+C or SIGTERM in training raise past this hook): flush and serve
        the final state while a live peer is behind (``serve_final_state``; a node's ranks all call it, rank 0
        serves). After a SIGTERM with the last batch it only flushes; one during the wait ends it (on a node, one that
        reaches rank 0: :mod:`~collabopt.integrations._lightning_signals`)."""
        copt = self._copt
        if copt is not None and not copt.closed:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            if getattr(trainer, "received_sigterm", False):
                copt.flush()
            else:
                with sigterm_ends_final_wait(trainer, self._several_processes, self.global_rank):
                    copt.serve_final_state()
        super().on_train_end()

    def teardown(self) -> None:
        module = self.lightning_module
        if self._saved_zero_grad is not None and module is not None:
            if self._saved_zero_grad is _no_zero_grad:
                module.__dict__.pop("optimizer_zero_grad", None)
            else:
                module.optimizer_zero_grad = self._saved_zero_grad  # type: ignore[method-assign]
            self._saved_zero_grad = None
        if self._original_optimizers is not None:
            self.optimizers = self._original_optimizers
            self._original_optimizers = None
        if self._original_scheduler_config is not None:
            config, scheduler = self._original_scheduler_config
            config.scheduler = scheduler
            self._original_scheduler_config = None
        if self._metrics_callback is not None and self._lightning_module is not None:
            trainer = self._lightning_module._trainer
            if trainer is not None and self._metrics_callback in trainer.callbacks:
                trainer.callbacks.remove(self._metrics_callback)
            self._metrics_callback = None
        if self._copt is not None:
            self._copt.close()
        super().teardown()

    # ------------------------------------------------------------------ training

    def _samples_in(self, batch: Any) -> int:
        if self.batch_size is not None:
            return self.batch_size
        try:
            return infer_batch_size(batch)
        except ConfigurationError as error:
            raise ConfigurationError(
                "batch_size", f"cannot tell how many samples a batch holds ({error})",
                "pass CollaborativeStrategy(batch_size=<samples per batch>)",
            ) from None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self._copt is not None and output is not None:  # None: the user skipped this batch
            batch = args[0] if args else kwargs.get("batch")
            self._pending_samples += self._samples_in(batch)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                self._copt.report_loss(loss)  # for the swarm's monitor (collabopt monitor)
        return output

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``training_step`` and backward (the closure), then report the samples to the swarm."""
        if self._copt is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = self.lightning_module if model is None else model
        closure_result = closure()  # run it first: the samples of this step are counted in training_step
        samples, self._pending_samples = self._pending_samples, 0
        if samples == 0:  # every batch since the last step was skipped: nothing to contribute
            return closure_result
        return self.precision_plugin.optimizer_step(
            self._copt, model=model, closure=lambda: closure_result, batch_size=samples, **kwargs
        )

    # ------------------------------------------------------------------ checkpoints

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._copt is not None and not self._copt.closed:
            return self._copt.state_dict()
        return super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Restore the optimizer from a checkpoint (``Trainer.fit(ckpt_path=...)``).

        A checkpoint written by this strategy holds the collaborative state (optimizer statistics, scheduler,
        global epoch); it is applied once the swarm is joined. A checkpoint of ordinary (non-swarm) training
        restores the torch optimizer's statistics; the swarm run then starts at global epoch 0.
        """
        states = checkpoint["optimizer_states"]
        state = states[0] if states else None
        is_collaborative = is_collaborative_state(state)
        if self._fit_plan is not None and is_collaborative:
            self._fit_plan["saved_state"] = state  # applied in on_train_start
            return
        if is_collaborative:
            raise ConfigurationError(
                "ckpt_path", "holds collaborative optimizer state, which is restored only by Trainer.fit",
                "resume with trainer.fit(model, ckpt_path=...)",
            )
        super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ visibility

    @property
    def collaborative_optimizer(self) -> Any:
        """The :class:`~collabopt.CollaborativeOptimizer` while fitting (``None`` before and after)."""
        return self._copt

    @property
    def num_peers(self) -> int:
        """Peers training in this run, this one included (1 before training starts)."""
        if self._copt is not None and not self._copt.closed:
            return self._copt.num_peers
        return 1

    @property
    def local_epoch(self) -> int:
        """Global epochs (swarm-wide optimizer steps) this peer has taken part in."""
        return self._copt.local_epoch if self._copt is not None else 0

    def swarm_metrics(self) -> dict[str, float]:
        """``swarm/num_peers``, ``swarm/local_epoch``, ``swarm/samples_per_second``, ... while fitting (empty
        otherwise): :func:`collabopt.interface.swarm_metrics`, the names every adapter logs."""
        return swarm_metrics(self._copt)


HivemindStrategy = CollaborativeStrategy
"""lightning-hivemind's name for :class:`CollaborativeStrategy` (the same class), so that only the import changes."""

__all__ = ["CollaborativeStrategy", "HivemindStrategy", "INITIAL_PEERS_ENV"]
