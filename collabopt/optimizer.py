"""``CollaborativeOptimizer``: wrap any torch optimizer so that this process trains as a peer of a swarm."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from collabopt import scheduling, swarm
from collabopt.batch_size import ForwardSampleCounter, infer_batch_size
from collabopt.errors import ConfigurationError
from collabopt.lifecycle import SigtermHandler, preserved_sigint
from collabopt.metrics import announce_progress, refresh_progress, swarm_snapshot
from collabopt.scheduling import (
    EpochSchedule,
    check_scheduler,
    install_step_guard,
    is_scheduler,
    rebind_scheduler,
    remove_step_guard,
)
from collabopt.swarm import SwarmOptions, parse_initial_peers, start_dht, validate_listen_maddrs

logger = logging.getLogger(__name__)

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_HIVEMIND_REQUEST_TIMEOUT = 3.0  # hivemind's default averager request_timeout (seconds)
# hivemind.Optimizer arguments that CollaborativeOptimizer sets itself (not accepted in **hivemind_kwargs)
_MANAGED = {"dht", "run_id", "target_batch_size", "batch_size_per_step", "optimizer", "params", "scheduler",
            "client_mode"}


def _hivemind_optimizer_parameters() -> dict[str, inspect.Parameter]:
    import hivemind

    return dict(inspect.signature(hivemind.Optimizer.__init__).parameters)


def _positive_number(name: str, value: Any, example: str, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ConfigurationError(name, f"must be a positive number, got {value!r}", f"pass e.g. {name}={example}")


def _positive_int(name: str, value: Any, example: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigurationError(name, f"must be a positive integer, got {value!r}", f"pass e.g. {name}={example}")


def _prepare_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create optimizer statistics without changing any parameter.

    hivemind needs every peer to hold statistics of the same structure and creates them by stepping the optimizer
    once with zero gradients, which applies weight decay once. Doing it with ``lr=0`` first leaves parameters
    untouched.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    old_grads = [p.grad for p in params]
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, old_grads, strict=True):
            p.grad = grad


class CollaborativeOptimizer:
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
                copt.step()          # 32 samples counted from the forward call
                copt.zero_grad()

    Args:
        optimizer: a torch optimizer instance over the model's parameters (hivemind builds its copy from it when
            offloading or delaying steps; optimizer state and per-group hyperparameters are carried over).
        run_id: name of the training run; all peers of a run use the same one.
        target_batch_size: samples the whole swarm accumulates per global optimizer step (a "global epoch").
        scheduler: an LR scheduler instance on ``optimizer`` (any ``torch.optim.lr_scheduler`` class). collabopt
            steps it once per global epoch, identically on every peer; don't call ``scheduler.step()`` yourself
            (``ReduceLROnPlateau.step(metric)`` only reports the metric).
        scheduler_fn: alternatively, ``callable(optimizer) -> scheduler`` (lightning-hivemind style).
        optimizer_factory: ``callable(param_groups) -> optimizer`` to build hivemind's copy, if the class cannot be
            rebuilt from ``optimizer.defaults``.
        model: if given, samples are counted from its forward calls in training mode.
        batch_size: fixed samples per step, used when nothing else tells the count.
        dht: a running ``hivemind.DHT`` you own (then no swarm options may be given; it is not shut down here).
        initial_peers: multiaddrs of peers of a running swarm (list or comma-separated string); default
            ``$INITIAL_PEERS``; none starts a new swarm.
        host_maddrs, announce_maddrs, client_mode, identity_path, use_ipfs, use_relay, use_auto_relay,
            wait_timeout, bootstrap_timeout: DHT options (see README).
        reuse_grad_buffers: accumulate in ``param.grad`` (saves memory); ``zero_grad()`` then does nothing.
        offload_optimizer, delay_optimizer_step, delay_grad_averaging, delay_state_averaging, average_state_every,
            use_local_updates, auxiliary, matchmaking_time, averaging_timeout, load_state_timeout,
            grad_compression, state_averaging_compression, grad_averager_factory, averager_opts, ...:
            forwarded to ``hivemind.Optimizer`` (any other keyword argument of it too). A ``matchmaking_time`` of
            3 s or less gets ``averager_opts["request_timeout"] = matchmaking_time / 2`` unless you set it
            (hivemind's 3 s join-request timeout must stay below the matchmaking time, or matchmaking can
            deadlock); the request timeout reaches the gradient averager too (hivemind passes ``averager_opts``
            to its state averager only). ``delay_state_averaging``
            defaults to False (as lightning-hivemind): parameters are averaged within the global step, so peers
            hold identical parameters after every global epoch. hivemind's default True averages in the
            background, one step later, for more throughput (benchmarks B1 measured ~20% more samples/s).
        grad_scaler: the ``torch.amp.GradScaler`` you use, needed only with ``reuse_grad_buffers=True`` when you
            call ``scaler.unscale_()`` before stepping (e.g. for gradient clipping).
        load_state_on_start: download the swarm's state before the first step when the swarm is ahead.
        handle_signals: turn SIGTERM into a clean shutdown while this optimizer is open.
        print_join_message: print how other machines join, once the DHT is up.
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale/found_inf; see step()

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str,
        target_batch_size: int,
        scheduler: Any = None,
        scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
        optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer] | None = None,
        model: torch.nn.Module | None = None,
        batch_size: int | None = None,
        dht: Any = None,
        initial_peers: str | Sequence[str] | None = None,
        host_maddrs: Sequence[str] | None = None,
        announce_maddrs: Sequence[str] | None = None,
        client_mode: bool = False,
        identity_path: str | None = None,
        use_ipfs: bool = False,
        use_relay: bool = True,
        use_auto_relay: bool = False,
        wait_timeout: float = 3.0,
        bootstrap_timeout: float | None = None,
        reuse_grad_buffers: bool = False,
        offload_optimizer: bool = False,
        delay_optimizer_step: bool = False,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = False,
        use_local_updates: bool = False,
        auxiliary: bool = False,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        load_state_timeout: float = 600.0,
        average_state_every: int = 1,
        grad_scaler: Any = None,
        load_state_on_start: bool = True,
        handle_signals: bool = True,
        print_join_message: bool = True,
        verbose: bool = False,
        initial_peers_env: Sequence[str] = ("INITIAL_PEERS",),
        **hivemind_kwargs: Any,
    ):
        # ---- validation: everything here runs before any process or socket is started ----
        self._closed = True
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(
                "optimizer",
                f"expected a torch.optim.Optimizer instance, got {type(optimizer).__name__}",
                "pass e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)",
            )
        if type(optimizer).__module__.startswith("hivemind"):
            raise ConfigurationError(
                "optimizer", "it is already a hivemind optimizer", "pass the plain torch optimizer it wraps"
            )
        if not any(p.requires_grad for group in optimizer.param_groups for p in group["params"]):
            raise ConfigurationError(
                "optimizer", "none of its parameters requires grad", "create it on the trainable parameters"
            )
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            raise ConfigurationError(
                "run_id",
                f"must be 1-128 characters of letters, digits, '_', '-', '.', got {run_id!r}",
                "pass e.g. run_id='my_experiment'",
            )
        if not auxiliary:
            _positive_int("target_batch_size", target_batch_size, "4096")
        if batch_size is not None:
            _positive_int("batch_size", batch_size, "32")
        if scheduler is not None and scheduler_fn is not None:
            raise ConfigurationError(
                "scheduler", "both scheduler and scheduler_fn were given", "pass only one of them"
            )
        if scheduler is not None:
            check_scheduler(scheduler, optimizer)
        if scheduler_fn is not None and (not callable(scheduler_fn) or is_scheduler(scheduler_fn)):
            raise ConfigurationError(
                "scheduler_fn",
                f"expected a callable(optimizer) -> scheduler, got {type(scheduler_fn).__name__}",
                "pass e.g. functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.99), "
                "or the instance as scheduler=",
            )
        if optimizer_factory is not None and not callable(optimizer_factory):
            raise ConfigurationError(
                "optimizer_factory", "must be callable(param_groups) -> optimizer", "pass e.g. a lambda"
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigurationError(
                "model", f"expected a torch.nn.Module, got {type(model).__name__}", "pass the model you train"
            )
        _positive_number("matchmaking_time", matchmaking_time, "5.0")
        _positive_number("averaging_timeout", averaging_timeout, "30.0")
        _positive_number("load_state_timeout", load_state_timeout, "600.0")
        _positive_int("average_state_every", average_state_every, "1")
        if delay_grad_averaging and not delay_optimizer_step:
            raise ConfigurationError(
                "delay_grad_averaging",
                "requires delay_optimizer_step=True (the delayed averaging result is applied by a delayed step)",
                "pass delay_optimizer_step=True and offload_optimizer=True as well",
            )
        if delay_optimizer_step and not offload_optimizer:
            raise ConfigurationError(
                "delay_optimizer_step",
                "requires offload_optimizer=True (otherwise a background step would race with your backward pass)",
                "pass offload_optimizer=True",
            )
        if delay_optimizer_step and not delay_state_averaging:
            raise ConfigurationError(
                "delay_optimizer_step",
                "requires delay_state_averaging=True (hivemind runs the delayed step inside the background averaging)",
                "pass delay_state_averaging=True as well",
            )
        if use_local_updates and (reuse_grad_buffers or delay_grad_averaging):
            name = "reuse_grad_buffers" if reuse_grad_buffers else "delay_grad_averaging"
            raise ConfigurationError(
                name, "has no effect with use_local_updates=True (gradients are not accumulated)", f"drop {name}"
            )
        if client_mode and auxiliary:
            raise ConfigurationError(
                "auxiliary", "client-mode peers cannot serve as auxiliaries", "pass client_mode=False"
            )
        if auxiliary and batch_size is not None:
            raise ConfigurationError("batch_size", "auxiliary peers do not train", "drop batch_size")
        known = _hivemind_optimizer_parameters()
        for name in hivemind_kwargs:
            if name not in known or name in _MANAGED or name == "self":
                valid = sorted(set(known) - _MANAGED - {"self"})
                raise ConfigurationError(
                    name,
                    "is not an argument of CollaborativeOptimizer or hivemind.Optimizer",
                    f"check the spelling; accepted hivemind options: {', '.join(valid)}",
                )
        if "grad_compression" in hivemind_kwargs:
            self._check_compression("grad_compression", hivemind_kwargs["grad_compression"])
        if "state_averaging_compression" in hivemind_kwargs:
            self._check_compression("state_averaging_compression", hivemind_kwargs["state_averaging_compression"])
        averager_opts = hivemind_kwargs.get("averager_opts")
        if averager_opts is not None and not isinstance(averager_opts, dict):
            raise ConfigurationError("averager_opts", f"expected a dict, got {type(averager_opts).__name__}",
                                     "pass e.g. averager_opts=dict(request_timeout=1.0)")
        if use_local_updates and hivemind_kwargs.get("grad_averager_factory") is not None:
            raise ConfigurationError(
                "grad_averager_factory", "is not used with use_local_updates=True", "drop one of them"
            )
        request_timeout = (averager_opts or {}).get("request_timeout")
        if request_timeout is None and matchmaking_time <= _HIVEMIND_REQUEST_TIMEOUT:
            # hivemind warns that a join request timeout >= matchmaking_time can deadlock matchmaking
            request_timeout = matchmaking_time / 2
            hivemind_kwargs["averager_opts"] = dict(averager_opts or {}, request_timeout=request_timeout)
        if request_timeout is not None and not use_local_updates:
            # hivemind 1.1.12 hands averager_opts to its state averager only: give the gradient averager the same
            from hivemind.optim.grad_averager import GradientAverager

            factory = hivemind_kwargs.get("grad_averager_factory") or GradientAverager
            hivemind_kwargs["grad_averager_factory"] = functools.partial(factory, request_timeout=request_timeout)

        swarm_options_given = {
            name: value
            for name, value in dict(
                initial_peers=initial_peers, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
                identity_path=identity_path, client_mode=client_mode or None, use_ipfs=use_ipfs or None,
                bootstrap_timeout=bootstrap_timeout,
            ).items()
            if value is not None
        }
        if dht is not None:
            import hivemind

            if not isinstance(dht, hivemind.DHT):
                raise ConfigurationError(
                    "dht", f"expected a hivemind.DHT, got {type(dht).__name__}", "pass hivemind.DHT(..., start=True)"
                )
            if swarm_options_given:
                raise ConfigurationError(
                    ", ".join(swarm_options_given),
                    "swarm options were given together with a dht you own",
                    "configure the DHT you create, or pass no dht= and let collabopt start one",
                )
            self._swarm_options = None
        else:
            self._swarm_options = SwarmOptions(
                initial_peers=parse_initial_peers(initial_peers, env_vars=initial_peers_env),
                host_maddrs=validate_listen_maddrs(host_maddrs, "host_maddrs"),
                announce_maddrs=validate_listen_maddrs(announce_maddrs, "announce_maddrs"),
                client_mode=bool(client_mode),
                identity_path=identity_path,
                use_ipfs=use_ipfs,
                use_relay=use_relay,
                use_auto_relay=use_auto_relay,
                wait_timeout=wait_timeout,
                bootstrap_timeout=bootstrap_timeout,
            )
            self._swarm_options.validate()

        # ---- configuration accepted: remember it ----
        self.run_id, self.target_batch_size = run_id, target_batch_size
        self.user_optimizer, self.user_scheduler = optimizer, scheduler
        self.reuse_grad_buffers, self.offload_optimizer = reuse_grad_buffers, offload_optimizer
        self.auxiliary, self.fixed_batch_size = auxiliary, batch_size
        self.grad_scaler = grad_scaler
        self.samples_reported = 0  # samples this peer passed to hivemind
        self.samples_skipped = 0  # samples of steps skipped because of inf/nan gradients (AMP)
        self.local_steps = 0
        self._failed_syncs = 0
        self._zero_grad_warned = False
        self._grad_units: float | None = None  # scale of param.grad in reuse+AMP mode
        self._sigterm = SigtermHandler()
        self._owns_dht = dht is None
        self._counter = ForwardSampleCounter(model) if model is not None else None
        self.dht = None
        self._opt = None

        needs_factory = offload_optimizer or delay_optimizer_step or delay_grad_averaging
        hivemind_args: dict[str, Any] = dict(
            run_id=run_id,
            target_batch_size=target_batch_size if not auxiliary else 1,
            batch_size_per_step=None,
            reuse_grad_buffers=reuse_grad_buffers,
            offload_optimizer=offload_optimizer,
            delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging,
            delay_state_averaging=delay_state_averaging,
            use_local_updates=use_local_updates,
            auxiliary=auxiliary,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            load_state_timeout=load_state_timeout,
            average_state_every=average_state_every,
            verbose=verbose,
            **hivemind_kwargs,
        )
        if needs_factory:
            build = optimizer_factory or scheduling.optimizer_factory(optimizer)
            hivemind_args["params"] = [dict(group) for group in optimizer.param_groups]

            def make_optimizer(param_groups: list[dict]) -> torch.optim.Optimizer:
                new_optimizer = build(param_groups)
                _prepare_optimizer_state(new_optimizer)
                return new_optimizer

            hivemind_args["optimizer"] = make_optimizer
        else:
            if optimizer_factory is not None:
                warnings.warn("optimizer_factory is only used with offload_optimizer/delay_*; ignored", stacklevel=2)
            _prepare_optimizer_state(optimizer)
            hivemind_args["optimizer"] = optimizer

        # ---- start the network ----
        import hivemind

        self._closed = False
        try:
            with preserved_sigint():
                if dht is None:
                    self.dht = start_dht(self._swarm_options)
                else:
                    self.dht = dht
                hivemind_args["client_mode"] = self.dht.client_mode  # hivemind ignores its own client_mode
                self._opt = hivemind.Optimizer(dht=self.dht, **hivemind_args)
            if handle_signals:
                self._sigterm.install()
            if print_join_message and self._owns_dht:
                swarm.print_join_message(self.dht, run_id, self.dht.client_mode)

            # the scheduler drives the optimizer hivemind really steps
            inner = self._opt.state_averager.optimizer
            if scheduler_fn is not None:
                scheduler = scheduler_fn(inner)
                if not is_scheduler(scheduler):
                    raise ConfigurationError(
                        "scheduler_fn", f"returned {type(scheduler).__name__}, not a scheduler", "return a scheduler"
                    )
            elif scheduler is not None and inner is not optimizer:
                rebind_scheduler(scheduler, inner)
            self.scheduler = scheduler
            self._schedule = EpochSchedule(scheduler, base_epoch=self.local_epoch) if scheduler is not None else None
            if scheduler is not None:
                install_step_guard(scheduler, self.report_metric)

            if load_state_on_start and not auxiliary:
                self._catch_up_on_start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _check_compression(name: str, value: Any) -> None:
        from hivemind.compression import CompressionBase

        if not isinstance(value, CompressionBase):
            raise ConfigurationError(
                name,
                f"expected a hivemind compression instance, got {type(value).__name__}",
                "pass e.g. hivemind.Float16Compression() or hivemind.Uniform8BitQuantization()",
            )

    def _catch_up_on_start(self) -> None:
        """Download the swarm's state before the first contribution if the swarm is ahead of us.

        hivemind's progress tracker reads the swarm's progress from the DHT when it is created.
        """
        tracker = self._opt.tracker
        if tracker.global_progress.num_peers > 0 and tracker.global_epoch > self._opt.local_epoch:
            logger.info("collabopt: swarm is at epoch %d, downloading its state", tracker.global_epoch)
            self._opt.load_state_from_peers()
        self._on_epoch_maybe_changed()

    def _check_open(self) -> None:
        if self._closed or self._opt is None:
            raise RuntimeError("this CollaborativeOptimizer is closed; create a new one to keep training")

    def _main_params(self) -> list[torch.Tensor]:
        return list(self._opt.state_averager.main_parameters)

    def _resolve_batch_size(self, batch: Any, batch_size: int | None) -> int:
        counted = self._counter.pop() if self._counter is not None else 0
        if batch_size is not None:
            _positive_int("batch_size", batch_size, "len(inputs)")
            return batch_size
        if batch is not None:
            return infer_batch_size(batch)
        if counted > 0:
            return counted
        if self.fixed_batch_size is not None:
            return self.fixed_batch_size
        raise ConfigurationError(
            "step",
            "cannot tell how many samples this step contributed",
            "call step(batch_size=len(x)) or step(batch=(x, y)), or pass model= (samples are then counted from "
            "its forward calls) or a fixed batch_size= to CollaborativeOptimizer",
        )

    def _on_epoch_maybe_changed(self) -> None:
        if self._schedule is not None:
            self._schedule.advance_to(self._opt.local_epoch)

    @torch.no_grad()
    def _scale_grads(self, factor: float) -> None:
        if factor == 1.0:
            return
        for p in self._main_params():
            if p.grad is not None:
                p.grad.mul_(factor)

    def _discard_local_progress(self, samples: int) -> None:
        """An AMP step overflowed: drop what this peer accumulated since the last global epoch."""
        self.samples_skipped += samples
        if self.reuse_grad_buffers:  # param.grad also held the earlier steps of this epoch: they are lost too
            lost = self._opt.grad_averager.local_samples_accumulated
            self.samples_skipped += lost
            self.samples_reported -= lost
            self._opt.tracker.report_local_progress(self._opt.local_epoch, samples_accumulated=0)
            self._opt.grad_averager.reset_accumulated_grads_()
            self._grad_units = None
        else:
            self.zero_grad()

    # ------------------------------------------------------------------ public API

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        batch: Any = None,
        batch_size: int | None = None,
    ) -> Any:
        """Report this local step's gradients; runs a global optimizer step when the swarm reaches the target.

        The number of samples is ``batch_size``, else inferred from ``batch``, else counted from the model's
        forward calls since the last step, else the fixed ``batch_size`` of the constructor.
        Works with ``torch.amp.GradScaler``: ``scaler.step(copt)`` gives the same update as fp32.
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # set by torch.amp.GradScaler.step() for the duration of this call (it deletes them afterwards)
        grad_scale = self.__dict__.get("grad_scale")
        found_inf = self.__dict__.get("found_inf")
        if self.auxiliary:
            self._opt.step()
            self._on_epoch_maybe_changed()
            return loss
        samples = self._resolve_batch_size(batch, batch_size)
        self.local_steps += 1

        amp = found_inf is not None
        if amp and float(found_inf) > 0:
            self._discard_local_progress(samples)
            return loss
        units = 1.0
        if amp:
            if grad_scale is not None:
                units = float(grad_scale)
                if self.reuse_grad_buffers and self._grad_units not in (None, units) and self._has_accumulated():
                    warnings.warn(
                        "the AMP loss scale changed while gradients were accumulating in param.grad "
                        f"({self._grad_units} -> {units}); this step's contribution is rescaled approximately",
                        stacklevel=2,
                    )
                self._scale_grads(1.0 / units)
            elif self.reuse_grad_buffers:  # the user called scaler.unscale_(): grads are unscaled already
                units = self._known_scale()

        reported_before = self._opt.tracker.local_progress.samples_accumulated
        epoch_before = self._opt.local_epoch
        self._opt.step(batch_size=samples)
        accepted = (
            self._opt.local_epoch != epoch_before
            or self._opt.tracker.local_progress.samples_accumulated != reported_before
        )
        if accepted:
            self.samples_reported += samples
            self._failed_syncs = 0
        elif self._opt.local_epoch < self._opt.tracker.global_epoch:
            self._give_up_sync_if_nobody_serves()
        if self.reuse_grad_buffers and amp:
            self._scale_grads(units)  # keep param.grad in the units of the current loss scale
            self._grad_units = units
        self._on_epoch_maybe_changed()
        return loss

    def _give_up_sync_if_nobody_serves(self, attempts: int = 3) -> None:
        """hivemind drops a step and downloads state when the swarm is ahead. When the peers that are ahead have
        left (their progress records outlive them), nobody can serve that state and hivemind would retry at every
        step forever. After ``attempts`` such steps, continue from this peer's own parameters at the swarm's epoch.
        """
        self._failed_syncs += 1
        if self._failed_syncs < attempts:
            return
        self._failed_syncs = 0
        epoch = self._opt.tracker.global_epoch
        warnings.warn(
            f"collabopt: the swarm is at epoch {epoch} but no peer could send its state ({attempts} attempts); "
            "continuing from this peer's own parameters at that epoch",
            stacklevel=3,
        )
        self._opt.state_averager.local_epoch = epoch
        self._opt.tracker.report_local_progress(epoch, samples_accumulated=0)

    def _has_accumulated(self) -> bool:
        return self._opt.grad_averager is not None and self._opt.grad_averager.local_times_accumulated > 0

    def _known_scale(self) -> float:
        if self.grad_scaler is not None:
            return float(self.grad_scaler.get_scale())
        if self._grad_units is not None:
            return self._grad_units
        raise ConfigurationError(
            "grad_scaler",
            "with reuse_grad_buffers=True, scaler.unscale_() before step() needs the scaler's current scale",
            "pass grad_scaler=scaler to CollaborativeOptimizer",
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. With ``reuse_grad_buffers=True`` this does nothing (collabopt clears them once used)."""
        self._check_open()
        if self.reuse_grad_buffers:
            if not self._zero_grad_warned:
                self._zero_grad_warned = True
                warnings.warn(
                    "zero_grad() does nothing with reuse_grad_buffers=True: gradients accumulate in param.grad "
                    "and collabopt clears them after each global step",
                    stacklevel=2,
                )
            return
        for p in self._main_params():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def report_metric(self, value: float) -> None:
        """Report a metric (e.g. validation loss) for ``ReduceLROnPlateau``; the mean per epoch is used."""
        if self._schedule is not None:
            self._schedule.report_metric(value)

    def flush(self) -> None:
        """Wait for background work (delayed optimizer steps and averaging) and apply its results now."""
        self._check_open()
        self._opt.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
        self._on_epoch_maybe_changed()

    def load_state_from_peers(self) -> None:
        """Download the newest parameters, optimizer state and epoch from the swarm now."""
        self._check_open()
        self._opt.load_state_from_peers()
        self._on_epoch_maybe_changed()

    # ------------------------------------------------------------------ visibility

    @property
    def hivemind_optimizer(self) -> Any:
        """The underlying ``hivemind.Optimizer`` (for options collabopt does not wrap)."""
        return self._opt

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that hivemind really steps (a copy of yours when offloading)."""
        return self._opt.state_averager.optimizer

    @property
    def param_groups(self) -> list[dict]:
        """Param groups over the model's parameters (used by ``torch.amp.GradScaler``)."""
        return list(self._opt.param_groups)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def local_epoch(self) -> int:
        """Number of global optimizer steps this peer has taken part in (or caught up with)."""
        return self._opt.local_epoch if self._opt is not None else 0

    @property
    def global_epoch(self) -> int:
        return self._opt.tracker.global_epoch

    @property
    def num_peers(self) -> int:
        """Peers currently training in this run, this one included (hivemind's count, refreshed every few seconds;
        at least 1: hivemind counts a peer only after its first step)."""
        return max(1, self._opt.tracker.global_progress.num_peers)

    @property
    def samples_accumulated(self) -> int:
        """Samples the swarm has accumulated toward ``target_batch_size`` in the current epoch."""
        return self._opt.tracker.global_progress.samples_accumulated

    @property
    def samples_per_second(self) -> float:
        """Throughput of the whole swarm (estimated as this peer's measured rate times the number of peers)."""
        tracker = self._opt.tracker
        # hivemind 1.1.12's GlobalTrainingProgress has no samples_per_second field
        value = getattr(tracker.global_progress, "samples_per_second", None)
        if value is None:
            value = tracker.performance_ema.samples_per_second * max(1, tracker.global_progress.num_peers)
        return float(value)

    @property
    def eta_next_epoch(self) -> float:
        """Estimated seconds until the next global epoch."""
        from hivemind.utils import get_dht_time

        return max(0.0, self._opt.tracker.estimated_next_update_time - get_dht_time())

    def get_lr(self) -> list[float]:
        """Learning rates of the optimizer that hivemind steps."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def metrics(self) -> dict[str, float]:
        """A snapshot of the swarm state, ready for a progress bar or a logger."""
        return swarm_snapshot(self)

    def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> bool:
        """Block until hivemind counts ``num_peers`` peers in the swarm, this one included; return whether it did
        within ``timeout`` seconds. Peers count once they train or while they wait here, so every peer of a small
        swarm can call it before its first step (a demo, a test, a run that should not start alone)::

            if not copt.wait_for_peers(2, timeout=120):
                print("training alone for now")

        On return, this peer's own view of the swarm includes the others, so its first global step is taken
        together with them rather than alone.
        """
        self._check_open()
        _positive_int("num_peers", num_peers, "2")
        _positive_number("timeout", timeout, "60.0", allow_zero=True)
        tracker = self._opt.tracker
        deadline = time.monotonic() + timeout
        while True:
            announce_progress(tracker)  # hivemind itself would publish this peer only after its first samples
            refresh_progress(tracker)
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            if tracker.global_progress.num_peers >= num_peers:
                return True
            if time.monotonic() >= deadline:
                return False

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Optimizer statistics, scheduler state and local epoch (save the model's parameters separately)."""
        self._check_open()
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self._schedule.state_dict() if self._schedule is not None else None,
            "local_epoch": self.local_epoch,
            "samples_reported": self.samples_reported,
            "format": "collabopt/1",
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Load the model's parameters before calling this."""
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != "collabopt/1":
            raise ConfigurationError(
                "state", "not a CollaborativeOptimizer.state_dict()", "pass what copt.state_dict() returned"
            )
        self._opt.state_averager.step(wait_for_delayed_updates=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self._opt.state_averager.local_epoch = int(state["local_epoch"])
        if self.offload_optimizer:  # the offloaded copy must hold the (restored) model parameters
            with torch.no_grad():
                opt_params = [p for group in self.optimizer.param_groups for p in group["params"]]
                for main, offloaded in zip(self._main_params(), opt_params, strict=True):
                    offloaded.copy_(main)
        if self._schedule is not None and state.get("scheduler") is not None:
            self._schedule.load_state_dict(state["scheduler"])
        self.samples_reported = int(state.get("samples_reported", 0))
        # update_epoch (not just report_local_progress): the tracker's cached global progress must move to the
        # restored epoch too, or local samples do not count toward it until its next fetch (a resumed run whose swarm
        # holds no newer record wasted ~10x the target before its first step)
        with self._opt.tracker.pause_updates():
            self._opt.tracker.update_epoch(self.local_epoch)
        self._on_epoch_maybe_changed()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Leave the swarm: shut down hivemind's averagers and the DHT this object started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with preserved_sigint():
            try:
                if self._opt is not None:
                    self._opt.shutdown()
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
        if self.user_scheduler is not None:
            remove_step_guard(self.user_scheduler)
        self._sigterm.restore()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> CollaborativeOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"epoch={self.local_epoch}"
        return f"CollaborativeOptimizer(run_id={self.run_id!r}, {state})"


def wait_for_peers(copt: Any, num_peers: int, timeout: float = 60.0) -> bool:
    """Block until the swarm has ``num_peers`` peers, ``copt``'s own included; return whether it did in time.

    Same as ``copt.wait_for_peers(num_peers, timeout)``, for a :class:`CollaborativeOptimizer` or a
    :class:`~collabopt.node.NodeOptimizer` (call it on every rank of a node).
    """
    return copt.wait_for_peers(num_peers, timeout)
