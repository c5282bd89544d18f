"""``CollaborativeOptimizer``, the core: wrap any torch optimizer so that this process trains as a peer of a swarm.

Where it sits: the constructor is wiring — options become a :class:`~collabopt.config.CollabConfig` (validated
before any network starts), the DHT and ``hivemind.Optimizer`` are reached only through
:class:`~collabopt.engine.peer.HivemindPeer`, the LR scheduler becomes a
:class:`~collabopt.scheduling.CollaborativeScheduler`. :meth:`CollaborativeOptimizer.step` turns one local step into
a contribution (sample count, AMP scale, gradient buffers) and returns what happened as a
:class:`~collabopt.interface.StepResult`. :class:`~collabopt.node.NodeOptimizer` composes this class through its
public API; the adapters in ``collabopt.integrations`` build one of the two. The class's other concerns live in
their own modules, one base class each: :mod:`collabopt.peer_views` (read-only properties),
:mod:`collabopt.nonfinite` (NaN/inf handling), :mod:`collabopt.checkpoint` (``state_dict``) and
:mod:`collabopt.catch_up` (waiting for peers, downloading the swarm's state).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from collabopt import diloco, host_memory, lifecycle, scheduling, swarm
from collabopt.batch_size import ForwardSampleCounter, resolve_samples
from collabopt.catch_up import SYNC_ATTEMPTS as SYNC_ATTEMPTS  # re-exported: its import path before the split
from collabopt.catch_up import CatchUp
from collabopt.checkpoint import Checkpointing
from collabopt.config import (
    CollabConfig,
    check_callable,
    check_dht,
    check_model,
    check_optimizer,
    make_config,
    renamed_argument,
)
from collabopt.engine.p2p import log_like_hivemind
from collabopt.engine.peer import DiLoCoPeer, HivemindPeer
from collabopt.errors import ConfigurationError
from collabopt.grads import scale_grads, zero_grads
from collabopt.guard import NonFiniteGuard
from collabopt.hivemind_arguments import peer_arguments
from collabopt.interface import StepResult, SwarmOptimizerBase
from collabopt.lifecycle import SigtermHandler, preserved_sigint
from collabopt.metrics import DILOCO_PUBLISH_INTERVAL, PUBLISH_INTERVAL, MetricsReporter
from collabopt.model_check import parameter_names
from collabopt.nonfinite import NonFiniteHandling
from collabopt.peer_views import PeerViews
from collabopt.rounds import RoundWatch
from collabopt.scheduling import CollaborativeScheduler, install_step_guard, is_scheduler, remove_step_guard

logger = logging.getLogger(__name__)


class CollaborativeOptimizer(PeerViews, NonFiniteHandling, Checkpointing, CatchUp, SwarmOptimizerBase):
    """Train as one peer of a hivemind swarm with any torch optimizer.

    Starts or joins a swarm (``initial_peers=``, the ``INITIAL_PEERS`` environment variable, or a ``dht=`` you
    own), counts the samples of every step toward ``target_batch_size``, keeps your LR scheduler in step with the
    global epoch, and shuts everything down cleanly on ``close()``, ``with`` exit, Ctrl+C or SIGTERM.

    Example (runs on its own as the first peer of a new swarm)::

        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: min(1.0, (epoch + 1) / 10))
        with CollaborativeOptimizer(opt, run_id="my_run", target_batch_size=256, scheduler=sched,
                                    model=model) as copt:
            for _ in range(10):
                x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
                torch.nn.functional.cross_entropy(model(x), y).backward()
                result = copt.step()   # 32 samples counted from the forward call
                copt.zero_grad()

    Args:
        optimizer: a torch optimizer instance over the model's parameters (hivemind builds its copy from it when
            offloading or delaying steps; optimizer state and per-group hyperparameters are carried over).
        run_id: name of the training run; all peers of a run use the same one.
        target_batch_size: samples the whole swarm accumulates per global optimizer step (a "global epoch").
        scheduler: an LR scheduler instance on ``optimizer`` (any ``torch.optim.lr_scheduler`` class). collabopt
            steps it once per global epoch, identically on every peer; don't call ``scheduler.step()`` yourself
            (``ReduceLROnPlateau.step(metric)`` only reports the metric). ``copt.scheduler`` is its
            :class:`~collabopt.scheduling.CollaborativeScheduler`.
        scheduler_fn: alternatively, ``callable(optimizer) -> scheduler`` (lightning-hivemind style).
        optimizer_factory: ``callable(param_groups) -> optimizer`` to build hivemind's copy, if the class cannot be
            rebuilt from ``optimizer.defaults``.
        model: if given, samples are counted from its forward calls in training mode.
        dht: a running ``hivemind.DHT`` you own (then no DHT options may be given; it is not shut down here).
        scaler: the ``torch.amp.GradScaler`` you use, needed only with ``reuse_grad_buffers=True`` when you
            call ``scaler.unscale_()`` before stepping (e.g. for gradient clipping). ``grad_scaler=`` is its
            deprecated name.
        config: a ready :class:`~collabopt.config.CollabConfig` instead of ``run_id``/``target_batch_size``/options.
        peer: for tests: an object with :class:`~collabopt.engine.peer.HivemindPeer`'s interface; no DHT is started.
        **options: every other option of :class:`~collabopt.config.CollabConfig` (``initial_peers``,
            ``batch_size``, ``reuse_grad_buffers``, ``offload_optimizer``, ``delay_*``, ``matchmaking_time``, ...)
            and any other ``hivemind.Optimizer`` argument (``grad_compression``, ``averager_opts``, ...).
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale/found_inf; see step()

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str | None = None,
        target_batch_size: int | None = None,
        scheduler: Any = None,
        scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
        optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer] | None = None,
        model: torch.nn.Module | None = None,
        dht: Any = None,
        scaler: Any = None,
        config: CollabConfig | None = None,
        peer: Any = None,
        **options: Any,
    ):
        # ---- validation: everything here runs before any process or socket is started ----
        self._closed = True
        self._peer: Any = None
        scaler = renamed_argument(options, "grad_scaler", "scaler", scaler, "CollaborativeOptimizer")
        check_optimizer(optimizer)
        config = make_config(config, dict(options, run_id=run_id, target_batch_size=target_batch_size))
        if isinstance(scheduler, CollaborativeScheduler):  # an adapter wrapped it before the swarm was joined
            scheduler_wrapper, scheduler = scheduler, scheduler.scheduler
        else:
            scheduler_wrapper = None
        scheduling.check_scheduler_arguments(scheduler, scheduler_fn, optimizer)
        check_callable("optimizer_factory", optimizer_factory, "pass callable(param_groups) -> optimizer")
        check_model(model)
        check_dht(dht, config)
        arguments = peer_arguments(config, optimizer, optimizer_factory)
        self._owns_dht = dht is None and peer is None
        self._remember(config, optimizer, model, dht, scaler, scheduler)

        # ---- start the network ----
        self._closed = False
        try:
            self._peer = peer if peer is not None else self._start_peer(arguments)
            if isinstance(self._peer, HivemindPeer):  # publishes this peer's metrics record (collabopt.metrics)
                # (a model of other shapes than the swarm's is named in the error: collabopt.model_check)
                self._peer.loop.state_averager.model_names = parameter_names(self._peer.parameters, model)
                self._reporter = MetricsReporter(
                    self, self._peer, interval=PUBLISH_INTERVAL if self.diloco is None else DILOCO_PUBLISH_INTERVAL)
            self._wire_guard()
            if config.handle_signals:
                self._sigterm.install()
                lifecycle.keep_lost_interrupts()
            if config.print_join_message and self._owns_dht:
                swarm.print_join_message(self.dht, config.run_id, self.dht.client_mode)
            self._bind_scheduler(optimizer, scheduler, scheduler_fn, scheduler_wrapper)
            if config.load_state_on_start and not config.auxiliary:
                self.catch_up()
        except BaseException:
            self.close()
            raise

    def _remember(self, config: CollabConfig, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None,
                  dht: Any, scaler: Any, scheduler: Any) -> None:
        """The accepted configuration and this peer's counters, before anything starts."""
        self.config = config
        self.run_id, self.target_batch_size = config.run_id, config.target_batch_size
        self.user_optimizer = optimizer
        self.scaler = scaler
        self.samples_reported = 0  # samples this peer passed to the swarm
        self._samples_skipped = 0  # samples of steps skipped because of inf/nan gradients (see samples_skipped)
        self.local_steps = 0
        self.scheduler: CollaborativeScheduler | None = None
        self._user_scheduler = scheduler
        self._failed_syncs = 0
        self._zero_grad_warned = False
        self._grad_units: float | None = None  # the loss scale param.grad is expressed in (reuse_grad_buffers + AMP)
        self._sigterm = SigtermHandler()
        self._guard = NonFiniteGuard() if config.nonfinite_guard else None
        # what the guard checks between boundaries (collabopt/guard.py): "each step" (its gradients), "accumulation"
        # (on its schedule) or, in DiLoCo mode, "parameters" (on its schedule); None without a guard
        self._guard_checks: str | None = None
        self._stepping_samples = 0  # samples of the step in peer.step() now (not in samples_reported yet)
        self._dropped_at_boundary = 0  # samples whose non-finite accumulation was dropped inside the last peer.step
        # DiLoCo mode's state and counters (collabopt/diloco.py); None in the synchronous mode
        self.diloco = (diloco.DiLoCo(optimizer, self._guard, overlap=config.overlap_rounds)
                       if config.outer_optimizer is not None else None)
        self._checked_version = -1  # parameters' version sum when the guard last checked them
        self._rounds = RoundWatch(self._guard, config.matchmaking_time, config.target_batch_size,
                                  judges_average=self.diloco is None)
        self._counter = ForwardSampleCounter(model) if model is not None else None
        self._reporter: MetricsReporter | None = None
        self.dht = dht

    def _start_peer(self, arguments: dict[str, Any]) -> HivemindPeer:
        """Start the DHT (unless the caller owns one) and this process's peer."""
        log_like_hivemind()
        host_memory.keep_freed_memory_for(p for group in self.user_optimizer.param_groups for p in group["params"])
        with preserved_sigint():
            if self._owns_dht:
                self.dht = swarm.start_dht(self.config.swarm_options())
            return (HivemindPeer(self.dht, arguments) if self.diloco is None
                    else DiLoCoPeer(self.dht, arguments, self.diloco))

    def _bind_scheduler(self, optimizer: torch.optim.Optimizer, scheduler: Any, scheduler_fn: Any,
                        wrapper: CollaborativeScheduler | None) -> None:
        """The scheduler drives the optimizer hivemind really steps (a copy of the user's when offloading)."""
        inner = self._peer.optimizer
        if scheduler_fn is not None:
            scheduler = scheduler_fn(inner)
            if not is_scheduler(scheduler):
                raise ConfigurationError("scheduler_fn", f"returned {type(scheduler).__name__}, not a scheduler",
                                         "return a torch LR scheduler")
        elif scheduler is not None and inner is not optimizer:
            scheduling.rebind_scheduler(scheduler, inner)
        if scheduler is None:
            return
        self._user_scheduler = scheduler
        if wrapper is None:
            wrapper = CollaborativeScheduler(scheduler, base_epoch=self.local_epoch)
        else:
            wrapper.rebase(self.local_epoch)
        self.scheduler = wrapper
        install_step_guard(scheduler, self.scheduler.report_metric)

    # ------------------------------------------------------------------ stepping

    def step(self, closure: Callable[[], Any] | None = None, *, batch: Any = None,
             batch_size: int | None = None) -> StepResult:
        """Contribute this local step's gradients; a global optimizer step runs when the swarm reaches the target.

        The number of samples is ``batch_size``, else inferred from ``batch``, else counted from the model's
        forward calls since the last step, else the fixed ``batch_size`` of the config. Works with
        ``torch.amp.GradScaler``: ``scaler.step(copt)`` gives the same update as fp32. Returns a
        :class:`~collabopt.interface.StepResult` (its ``loss`` is what ``closure`` returned).
        """
        lifecycle.raise_lost_interrupt()  # a Ctrl+C or SIGTERM that a finalizer dropped during the last step
        loss, grad_scale, found_inf = self._begin_step(closure)
        epoch_before = self._peer.local_epoch
        if self.config.auxiliary:
            self._peer.step(None)
            return self._after_step(StepResult(loss=loss), epoch_before)
        samples = resolve_samples(batch, batch_size, self._counter, self.config.batch_size)
        self.local_steps += 1
        amp = found_inf is not None
        refused = float(found_inf) > 0 if amp else (  # the scaler checked AMP gradients already
            self._guard_checks == "each step" and not self._guard.gradients_finite(self._peer.parameters))
        if refused:
            return self._after_step(self._discard_local_progress(samples, loss), epoch_before)

        reuse = self.config.reuse_grad_buffers
        units = 1.0
        if amp and grad_scale is not None:
            units = float(grad_scale)
            if reuse and self._grad_units not in (None, units) and self._peer.accumulated_steps > 0:
                warnings.warn(
                    "the AMP loss scale changed while gradients were accumulating in param.grad "
                    f"({self._grad_units} -> {units}); this step's contribution is rescaled approximately",
                    stacklevel=2,
                )
            self._scale_grads(1.0 / units)
        elif amp and reuse:  # the user called scaler.unscale_(): grads are unscaled already
            units = self._known_scale()

        self._dropped_at_boundary, self._stepping_samples = 0, samples
        try:
            accepted = self._peer.step(samples)  # may call _check_accumulation_at_boundary
        finally:
            self._stepping_samples = 0
        dropped = self._dropped_at_boundary
        if accepted and not dropped:
            self.samples_reported += samples
            self._failed_syncs = 0
        elif not accepted and self._peer.local_epoch < self._peer.global_epoch:
            self._give_up_sync_if_nobody_serves()
        if (not dropped and not amp and self._guard_checks == "accumulation"
                and self._peer.accumulated_steps > 0 and self._guard.check_due()
                and not self._guard.accumulation_finite(self._peer.accumulators())):
            dropped = self._drop_accumulation()
        if dropped:  # NaN/inf in the accumulation: it was not contributed, its samples were retracted
            self._grad_units = None
            accepted = False
        grads_reset = reuse and (dropped > 0 or self._peer.accumulated_steps == 0)
        grad_factor = 1.0
        if reuse and amp:
            self._scale_grads(units)  # keep param.grad in the units of the current loss scale
            self._grad_units = units
            grad_factor = 1.0 if grad_scale is not None else units  # net in-place factor of this step
        result = StepResult(samples=samples if accepted else 0, skipped=dropped, epoch_changed=False,
                            grads_reset=grads_reset, grad_factor=grad_factor, loss=loss)
        return self._after_step(result, epoch_before)

    def _after_step(self, result: StepResult, epoch_before: int) -> StepResult:
        epoch_changed = self._peer.local_epoch != epoch_before
        self._check_received_parameters(epoch_changed)
        self._advance_schedule()
        outcome = self._rounds.ended(self._peer.last_round, lambda: self._peer.samples_per_second)
        if epoch_changed or outcome is not None:
            result = dataclasses.replace(result, epoch_changed=result.epoch_changed or epoch_changed, round=outcome)
        return result

    def _advance_schedule(self) -> None:
        if self.scheduler is not None:
            self.scheduler.advance_to(self._peer.local_epoch)

    def _scale_grads(self, factor: float) -> None:
        scale_grads(self._peer.parameters, factor)

    def _known_scale(self) -> float:
        if self.scaler is not None:
            return float(self.scaler.get_scale())
        if self._grad_units is not None:
            return self._grad_units
        raise ConfigurationError(
            "scaler",
            "with reuse_grad_buffers=True, scaler.unscale_() before step() needs the scaler's current scale",
            "pass scaler=scaler to CollaborativeOptimizer",
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. With ``reuse_grad_buffers=True`` this does nothing (collabopt clears them once used)."""
        self._check_open()
        if self.config.reuse_grad_buffers:
            if not self._zero_grad_warned:
                self._zero_grad_warned = True
                warnings.warn(
                    "zero_grad() does nothing with reuse_grad_buffers=True: gradients accumulate in param.grad "
                    "and collabopt clears them after each global step",
                    stacklevel=2,
                )
            return
        zero_grads(self._peer.parameters, set_to_none)

    def report_metric(self, value: float) -> None:
        """Report a metric (e.g. validation loss) for ``ReduceLROnPlateau``; the mean per epoch is used."""
        if self.scheduler is not None:
            self.scheduler.report_metric(value)

    def report_loss(self, loss: Any) -> None:
        """Report a training loss (a number or a one-element tensor, not copied to the host here): the mean of those
        reported between two metrics records is published for ``collabopt monitor``. Call it once per batch::

            loss = F.cross_entropy(model(x), y)
            loss.backward()
            copt.step()
            copt.report_loss(loss)
        """
        if self._reporter is not None:
            self._reporter.report_loss(loss)

    def flush(self) -> None:
        """Wait for background work (delayed optimizer steps and averaging) and apply its results now."""
        self._check_open()
        epoch_before = self._peer.local_epoch
        self._peer.finish_background_work()
        self._check_received_parameters(self._peer.local_epoch != epoch_before)
        self._advance_schedule()

    # ------------------------------------------------------------------ lifecycle

    def serve_final_state(self, timeout: float | None = None) -> str:
        """After the last step, before :meth:`close`: :meth:`flush`, then serve this peer's state while a live peer
        is behind its epoch, at most ``timeout`` s (default ``averaging_timeout + matchmaking_time``; an open download,
        up to ``load_state_timeout`` more). Returns why it ended; SIGTERM and Ctrl+C end it at once."""
        self.flush()
        return self._peer.serve_final_state(timeout)

    def close(self) -> None:
        """Leave the swarm: shut down hivemind's averagers and the DHT this object started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reporter is not None:
            self._reporter.close()  # withdraws this peer's metrics record while the DHT still runs
        with preserved_sigint():
            try:
                if self._peer is not None:
                    self._peer.shutdown()
            except Exception as e:  # shutting down must go on
                logger.warning("collabopt: error while shutting down the optimizer: %r", e)
            finally:
                if self._owns_dht and self.dht is not None:
                    try:
                        self.dht.shutdown()
                    except Exception as e:
                        logger.warning("collabopt: error while shutting down the DHT: %r", e)
        if self._counter is not None:
            self._counter.remove()
        if self._user_scheduler is not None:
            remove_step_guard(self._user_scheduler)
        if self._guard is not None:
            self._guard.unwrap()
        self._sigterm.restore()

    def _describe(self) -> str:
        return f"run_id={self.run_id!r}, "


def wait_for_peers(copt: Any, num_peers: int, timeout: float = 60.0) -> bool:
    """Deprecated: call ``copt.wait_for_peers(num_peers, timeout)``, the one public form (see
    :meth:`CollaborativeOptimizer.wait_for_peers`). This function forwards to it, with a ``DeprecationWarning``."""
    warnings.warn("collabopt.wait_for_peers(copt, n) is deprecated: call copt.wait_for_peers(n) (the same wait)",
                  DeprecationWarning, stacklevel=2)
    return copt.wait_for_peers(num_peers, timeout)
