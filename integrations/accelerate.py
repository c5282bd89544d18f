"""Hugging Face Accelerate: an existing ``accelerate launch`` script joins a swarm by changing two lines.

.. code-block:: diff

    -from accelerate import Accelerator
    +from collabopt.integrations.accelerate import CollaborativeAccelerator as Accelerator
    -accelerator = Accelerator(gradient_accumulation_steps=2)
    +accelerator = Accelerator(gradient_accumulation_steps=2, run_id="my_run", target_batch_size=4096)

Everything else stays: ``accelerator.prepare(model, optimizer, dataloader, scheduler)``,
``with accelerator.accumulate(model)``, ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_``,
``optimizer.step()`` / ``scheduler.step()`` / ``optimizer.zero_grad()``, mixed precision (fp16 with its scaler,
bf16), ``accelerator.save_state`` / ``load_state`` and ``accelerator.log``.

What changes under the hood:

* ``prepare`` wraps the optimizer with :func:`collabopt.node.collaborative_optimizer`: with
  ``--num_processes N`` on one machine, the N processes act as ONE peer (only rank 0 joins the swarm, the samples
  of all ranks are counted, parameters and LR stay identical on every rank; see :mod:`collabopt.node`).
* samples are counted from the prepared model's forward calls, so gradient accumulation and uneven last batches
  count exactly; the optimizer steps only when Accelerate syncs gradients.
* the scheduler advances once per **global epoch**, on every rank: ``prepare`` returns its
  :class:`~collabopt.scheduling.CollaborativeScheduler`, whose ``step()`` (called by your loop) does nothing
  (``ReduceLROnPlateau.step(metric)`` reports the metric). ``scheduler.get_last_lr()`` and
  ``optimizer.param_groups`` show the learning rate in use.
* the prepared optimizer shows the swarm's state: ``optimizer.local_epoch``, ``optimizer.num_peers``,
  ``optimizer.metrics()``, ...
* ``accelerator.log(values)`` adds the swarm's metrics (``swarm/num_peers``, ``swarm/local_epoch``, ...), the names
  every adapter logs.
* the loss passed to ``accelerator.backward(loss)`` is reported to the swarm's monitor (``collabopt monitor``).
* ``accelerator.end_training()`` serves this peer's final state while a live peer is behind its epoch (not while
  an exception propagates), then leaves the swarm; process exit without it only leaves.

Refused with a :class:`~collabopt.ConfigurationError`: DeepSpeed, FSDP, Megatron-LM and XLA (they shard or own
the optimizer step), several optimizers in one accelerator.
"""

from __future__ import annotations

import atexit
import inspect
import sys
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer, move_to_device
from accelerate.utils import DistributedType

from collabopt.config import CollabConfig, option_names
from collabopt.errors import ConfigurationError
from collabopt.interface import SwarmOptimizer, swarm_metrics
from collabopt.node import collaborative_optimizer
from collabopt.scheduling import CollaborativeScheduler, check_scheduler, is_scheduler

_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}
_PLUGINS = {"deepspeed_plugin": "DeepSpeed", "fsdp_plugin": "FSDP", "megatron_lm_plugin": "Megatron-LM"}
# set by prepare() from the objects it is given
_DERIVED = {"optimizer", "scheduler", "scheduler_fn", "model", "scaler", "grad_scaler", "dht"}


class CollaborativeAcceleratedOptimizer(AcceleratedOptimizer):
    """What ``prepare`` returns for your optimizer: Accelerate's wrapper around the collaborative optimizer, which
    also shows the swarm's state (``local_epoch``, ``global_epoch``, ``num_peers``, ``samples_per_second``,
    ``metrics()``, ...): every name Accelerate's wrapper lacks is the collaborative optimizer's."""

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class CollaborativeAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose prepared optimizer trains as a peer of a hivemind swarm.

    Args:
        run_id: name of the run; all its peers use the same one.
        target_batch_size: samples the swarm accumulates per global optimizer step (a global epoch).
        log_swarm_metrics: ``accelerator.log`` adds ``swarm/...`` metrics (default True).
        **kwargs: every ``Accelerator`` argument, and every ``CollaborativeOptimizer`` / ``hivemind.Optimizer``
            argument (``initial_peers``, ``reuse_grad_buffers``, ``offload_optimizer``, ``matchmaking_time``, ...).
    """

    def __init__(self, *args: Any, run_id: str, target_batch_size: int, log_swarm_metrics: bool = True,
                 **kwargs: Any):
        accelerator_names = set(inspect.signature(Accelerator.__init__).parameters) - {"self"}
        collab_names = set(option_names()) | {"optimizer_factory"}
        accelerator_kwargs, collab_kwargs = {}, {}
        for name, value in kwargs.items():
            if name in _DERIVED:
                raise ConfigurationError(
                    name, "is taken from the objects you pass to accelerator.prepare()",
                    f"drop {name}= and pass the object to prepare(model, optimizer, dataloader, scheduler)",
                )
            if name in accelerator_names:
                accelerator_kwargs[name] = value
            elif name in collab_names:
                collab_kwargs[name] = value
            else:
                raise ConfigurationError(
                    name, "is not an argument of Accelerator, CollaborativeOptimizer or hivemind.Optimizer",
                    "check the spelling (see collabopt.CollaborativeOptimizer and accelerate.Accelerator)",
                )
        for plugin, name in _PLUGINS.items():
            if accelerator_kwargs.get(plugin) is not None:
                raise ConfigurationError(plugin, f"{name} is not supported by collabopt (it shards or owns the "
                                         "optimizer step that hivemind must run)",
                                         "launch without it (plain DDP: accelerate launch --multi_gpu)")
        super().__init__(*args, **accelerator_kwargs)
        if self.distributed_type in _UNSUPPORTED:
            raise ConfigurationError(
                "distributed_type",
                f"{_UNSUPPORTED[self.distributed_type]} is not supported by collabopt (it shards or owns the "
                "optimizer step that hivemind must run)",
                "run `accelerate config` again and choose multi-GPU / multi-CPU (DDP) or a single process",
            )
        self.collab_options: dict[str, Any] = dict(run_id=run_id, target_batch_size=target_batch_size,
                                                   **collab_kwargs)
        # every option is checked now (e.g. outer_optimizer), not when prepare() builds the optimizer
        CollabConfig.from_options(**{k: v for k, v in self.collab_options.items() if k in option_names()})
        self.log_swarm_metrics = log_swarm_metrics
        self.collaborative_optimizer: SwarmOptimizer | None = None

    # ------------------------------------------------------------------ prepare

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare like ``Accelerator.prepare``; the optimizer becomes collaborative, the scheduler per-epoch."""
        optimizer_at = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        scheduler_at = [i for i, a in enumerate(args) if is_scheduler(a)]
        if len(optimizer_at) > 1 or (optimizer_at and self.collaborative_optimizer is not None):
            raise ConfigurationError(
                "optimizer", "collabopt supports one optimizer per accelerator",
                "use one optimizer (several param groups are fine)",
            )
        if len(scheduler_at) > 1:
            raise ConfigurationError("scheduler", "only one LR scheduler is supported",
                                     "combine them with torch.optim.lr_scheduler.SequentialLR or ChainedScheduler")
        if scheduler_at and not optimizer_at:
            raise ConfigurationError("scheduler", "it was passed to prepare() without its optimizer",
                                     "pass the optimizer and the scheduler in the same prepare() call")
        optimizer = args[optimizer_at[0]] if optimizer_at else None
        scheduler = args[scheduler_at[0]] if scheduler_at else None
        if scheduler is not None:
            check_scheduler(scheduler, optimizer)

        others = [i for i in range(len(args)) if i not in optimizer_at and i not in scheduler_at]
        results: list[Any] = list(args)
        if others:
            placement = [device_placement[i] for i in others] if device_placement is not None else None
            prepared = super().prepare(*(args[i] for i in others), device_placement=placement)
            prepared = (prepared,) if len(others) == 1 else prepared
            for i, obj in zip(others, prepared, strict=True):
                results[i] = obj
        if optimizer is not None:
            wrapped, scheduler_wrapper = self._prepare_collaborative(optimizer, scheduler)
            results[optimizer_at[0]] = wrapped
            if scheduler_wrapper is not None:
                results[scheduler_at[0]] = scheduler_wrapper
        return results[0] if len(results) == 1 else tuple(results)

    def _prepare_collaborative(self, optimizer: torch.optim.Optimizer,
                               scheduler: Any) -> tuple[AcceleratedOptimizer, CollaborativeScheduler | None]:
        if self.distributed_type in _UNSUPPORTED:  # e.g. the state changed after construction
            raise ConfigurationError("distributed_type", f"{_UNSUPPORTED[self.distributed_type]} is not supported",
                                     "use DDP (accelerate launch --multi_gpu) or a single process")
        model = self._models[0] if self._models else None
        if model is None and self.collab_options.get("batch_size") is None:
            raise ConfigurationError(
                "prepare", "no model was prepared, so samples cannot be counted",
                "prepare the model before or together with the optimizer, or pass batch_size= (per process)",
            )
        if self.device_placement and optimizer.state:
            optimizer.load_state_dict(move_to_device(optimizer.state_dict(), self.device))
        copt = collaborative_optimizer(optimizer, model=model, scheduler=scheduler, scaler=self.scaler,
                                       **self.collab_options)
        self.collaborative_optimizer = copt
        atexit.register(copt.close)
        wrapped = CollaborativeAcceleratedOptimizer(copt, device_placement=False, scaler=self.scaler)
        self._optimizers.append(wrapped)
        return wrapped, copt.scheduler

    # ------------------------------------------------------------------ visibility and lifecycle

    def swarm_metrics(self) -> dict[str, float]:
        """``swarm/num_peers``, ``swarm/local_epoch``, ``swarm/samples_per_second``, ... (empty before prepare):
        :func:`collabopt.interface.swarm_metrics`, the names every adapter logs."""
        return swarm_metrics(self.collaborative_optimizer)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """``Accelerator.log`` plus the swarm metrics (unless ``log_swarm_metrics=False``)."""
        if self.log_swarm_metrics:
            values = {**self.swarm_metrics(), **values}
        super().log(values, step=step, log_kwargs=log_kwargs)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward``; the loss also goes to the swarm's monitor (``report_loss``: published in this
        peer's metrics record, see ``collabopt monitor``)."""
        super().backward(loss, **kwargs)
        copt = self.collaborative_optimizer
        if copt is not None and not copt.closed and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            copt.report_loss(loss)

    def end_training(self) -> None:
        """Serve the final state while a live peer is behind this one's epoch, leave the swarm (every rank), then
        finish trackers and the process group as Accelerate does.

        Accelerate has no hook for "training ended normally"; ``end_training()``, which a script calls on every rank
        after its loop, is the closest. It serves (``serve_final_state``: flushes, then waits for the peers behind;
        in a node every rank calls it, rank 0 serves) only where no exception is being handled: called from a
        ``finally`` or ``except`` while an error, Ctrl+C or SIGTERM (``collabopt.Terminated``) propagates, it only
        leaves. A node's ranks decide together (``end_run``): it serves only where no rank is handling an exception.
        Process exit without it only leaves too."""
        copt = self.collaborative_optimizer
        try:
            if copt is not None:
                copt.end_run(serve=sys.exc_info()[1] is None)
        finally:
            super().end_training()


__all__ = ["CollaborativeAccelerator", "CollaborativeAcceleratedOptimizer", "CollaborativeScheduler"]
