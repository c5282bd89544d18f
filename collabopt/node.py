"""A node: several local processes (torch.distributed ranks) that act as ONE peer of the swarm.

Where it sits: :class:`NodeOptimizer` composes the core — rank 0 owns a :class:`~collabopt.CollaborativeOptimizer`
and uses only its public API (``step()`` returns the :class:`~collabopt.interface.StepResult` the other ranks need);
after every collective call rank 0 sends a :class:`NodeStatus` (flags, that result, the swarm's values) in one
broadcast. Both satisfy :class:`~collabopt.interface.SwarmOptimizer`, so adapters treat them alike.

When a job runs several processes (``torchrun``, ``accelerate launch``, Lightning DDP), letting every rank join the
swarm as its own peer diverges: DDP never re-synchronizes parameters after hivemind changed them on one rank.
Instead only global rank 0 joins the swarm (it owns a :class:`~collabopt.CollaborativeOptimizer`), and every
rank runs a :class:`NodeOptimizer` with the same API. What the ranks keep identical, and how (samples, gradients,
parameters, LR and scheduler, gradient buffers, timeouts, metrics, DiLoCo mode, errors): :mod:`collabopt.node_protocol`.

API for adapters (plain loop / torchrun, Accelerate, Lightning ``devices>1``)::

    from collabopt.node import collaborative_optimizer

    # call on EVERY rank, in the same order, after torch.distributed.init_process_group(...) and DDP wrapping
    copt = collaborative_optimizer(optimizer, model=ddp_model, run_id="run", target_batch_size=4096,
                                   scheduler=scheduler)
    # -> CollaborativeOptimizer when torch.distributed is not initialised (or world size 1), else NodeOptimizer

    loss.backward(); copt.step(); copt.zero_grad()      # on every rank; collectives inside
    copt.local_epoch, copt.num_peers, copt.metrics(), copt.get_lr()   # same values on every rank
    state = copt.state_dict()        # collective-free; rank 0's holds the optimizer statistics: save that one
    copt.load_state_dict(state)      # collective-free; every rank loads the same saved state (load the model first)
    copt.serve_final_state()         # on every rank, after the last step: rank 0 serves peers still behind
    copt.close()                     # on every rank; rank 0 leaves the swarm, then the ranks leave together

``step``, ``flush``, ``serve_final_state``, ``wait_for_peers``, ``load_state_from_peers`` and construction are
collective: every rank must call them the same number of times.
``state_dict``, ``load_state_dict`` and the properties are local; ``close`` ends with a barrier (2-minute limit).
``NodeOptimizer`` supports
``torch.amp.GradScaler`` (``scaler.step(copt)``) like ``CollaborativeOptimizer``. ``is_node_job()`` tells whether
:func:`collaborative_optimizer` will build a node.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from collabopt import host_memory, node_protocol
from collabopt.batch_size import ForwardSampleCounter, resolve_samples
from collabopt.config import (
    CORE_OBJECTS,
    CollabConfig,
    check_model,
    check_optimizer,
    make_config,
    positive_int,
    positive_number,
    renamed_argument,
)
from collabopt.errors import ConfigurationError
from collabopt.grads import scale_grads, zero_grads
from collabopt.interface import StepResult
from collabopt.node_status import NodeStatus
from collabopt.node_view import NodeView
from collabopt.optimizer import CollaborativeOptimizer
from collabopt.scheduling import (
    CollaborativeScheduler,
    check_scheduler,
    group_hyperparameters,
    install_step_guard,
    remove_step_guard,
)


def is_node_job() -> bool:
    """Whether torch.distributed is initialised with more than one process (then ranks form one node)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _take_scaler(options: dict[str, Any], where: str) -> None:
    """``options`` with the scaler under its name ``scaler`` (``grad_scaler``, its deprecated name, warns)."""
    scaler = renamed_argument(options, "grad_scaler", "scaler", options.pop("scaler", None), where)
    if scaler is not None:
        options["scaler"] = scaler


def collaborative_optimizer(
    optimizer: torch.optim.Optimizer, *, model: torch.nn.Module | None = None, **kwargs: Any
) -> CollaborativeOptimizer | NodeOptimizer:
    """Build the right object for this process: a :class:`NodeOptimizer` when torch.distributed runs several
    processes (call it on every rank), else a plain :class:`~collabopt.CollaborativeOptimizer`.

    ``kwargs`` are those of ``CollaborativeOptimizer`` (``node_timeout`` is used by a node only).
    """
    _take_scaler(kwargs, "collaborative_optimizer")
    if is_node_job():
        return NodeOptimizer(optimizer, model=model, **kwargs)
    return CollaborativeOptimizer(optimizer, model=model, **kwargs)


class NodeOptimizer(NodeView):
    """One peer made of all ranks of a torch.distributed job; only global rank 0 talks to the swarm.

    Create it on every rank with the same arguments as :class:`~collabopt.CollaborativeOptimizer` (``model`` is
    used for counting the samples of each rank). What is synchronized and how: :mod:`collabopt.node_protocol`.

    Args:
        optimizer: the rank's torch optimizer over the (DDP-wrapped) model's parameters.
        model: count each rank's samples from this module's forward calls in training mode.
        scheduler: LR scheduler on ``optimizer``; advanced once per global epoch, identically on every rank.
        scaler: the ``torch.amp.GradScaler`` you use (rank 0's core needs it as the core does); ``grad_scaler=``
            is its deprecated name.
        config: a ready :class:`~collabopt.config.CollabConfig` instead of options.
        core_factory: builds rank 0's core (``CollaborativeOptimizer``; tests pass one over a fake peer).
        **options: every other ``CollaborativeOptimizer`` option; ``batch_size`` counts *per rank*;
            ``node_timeout``: seconds other ranks may wait for rank 0 (matchmaking, averaging, state download).
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler sets grad_scale / found_inf before step()

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: torch.nn.Module | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        config: CollabConfig | None = None,
        core_factory: Callable[..., CollaborativeOptimizer] = CollaborativeOptimizer,
        **options: Any,
    ):
        self._closed = True
        scaler = renamed_argument(options, "grad_scaler", "scaler", scaler, "NodeOptimizer")
        if scaler is not None:  # (rank 0's core takes it)
            options["scaler"] = scaler
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError(
                "torch.distributed", "is not initialised", "call torch.distributed.init_process_group() first, or "
                "use collabopt.node.collaborative_optimizer(), which builds a plain CollaborativeOptimizer then"
            )
        # every rank validates everything before any collective: bad input fails on all ranks alike
        check_optimizer(optimizer)
        wrapper = scheduler if isinstance(scheduler, CollaborativeScheduler) else None  # wrapped by an adapter
        if wrapper is not None:
            scheduler = wrapper.scheduler
        if scheduler is not None:
            check_scheduler(scheduler, optimizer)
        if options.pop("scheduler_fn", None) is not None:
            raise ConfigurationError("scheduler_fn", "is not supported with several processes per peer",
                                     "pass the scheduler instance as scheduler=")
        check_model(model)
        core_objects = {name: options.pop(name) for name in CORE_OBJECTS if name in options}
        config = make_config(config, options)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module

        self.config = config
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.run_id, self.target_batch_size = config.run_id, config.target_batch_size
        self.user_optimizer = optimizer
        self._user_scheduler = scheduler
        self.scheduler: CollaborativeScheduler | None = None
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        host_memory.keep_freed_memory_for(self._params)  # every rank steps alike (rank 0's core does it again)
        self._counter = ForwardSampleCounter(model) if model is not None else None
        self._copt: CollaborativeOptimizer | None = None
        self._status = NodeStatus()
        self._lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._versions = -1
        self._swarm_writes = 0  # DiLoCo mode: copt.diloco.swarm_writes when rank 0 last sent parameters
        self._zero_grad_warned = False
        # every rank takes part in creating the group, in the same order (a torch.distributed requirement)
        self._wait_group = node_protocol.open_wait_group(config.node_timeout)
        self._closed = False

        error: BaseException | None = None
        if self.rank == 0:
            try:  # the node counts samples itself: the core gets each step's total
                self._copt = core_factory(optimizer, scheduler=wrapper or scheduler, config=config, **core_objects)
                if self._copt.diloco is not None:  # every rank takes the inner steps: refuse NaN/inf before they do
                    self._copt.check_gradients_each_step()
                self.scheduler = self._copt.scheduler
            except BaseException as e:  # tell the other ranks, then raise here
                error = e
        elif scheduler is not None:
            self.scheduler = wrapper or CollaborativeScheduler(scheduler)  # holds rank 0's state, not stepped here
            install_step_guard(scheduler, lambda metric: None)  # rank 0's metrics drive the schedule
        try:
            self._sync(initial=True, error=error)
        except BaseException:  # leave nothing behind: the swarm, the hooks, the wait group
            self._closed = True
            self._release_hooks()
            if self._copt is not None:
                self._copt.close()
            self._leave_wait_group()
            raise

    # ------------------------------------------------------------------ collectives

    def _sync(self, *, result: StepResult | None = None, initial: bool = False,
              error: BaseException | None = None, inner_step: Callable[[], None] | None = None) -> None:
        """Rank 0 tells every rank what changed (one broadcast), then sends parameters / hyperparameters as needed.
        An ``error`` on rank 0 is raised on every rank. DiLoCo mode: the other ranks run ``inner_step`` when rank 0
        took its inner step, before any parameters arrive."""
        if self.rank == 0:
            if error is None:
                try:
                    status = self._rank0_status(result, initial)
                except BaseException as e:
                    error = e
            if error is not None:
                status = NodeStatus(error=True)
        else:
            status = NodeStatus()
        status = node_protocol.broadcast_status(status, self._wait_group)
        if status.error:
            node_protocol.raise_rank0_error(error, self.rank, self._wait_group)
        self._status = status
        if inner_step is not None and status.result.skipped == 0:
            inner_step()
        if status.params_changed:
            node_protocol.broadcast_params(self._params, self.rank, self._wait_group)
        if self.rank != 0 and self.config.reuse_grad_buffers:
            if status.result.grads_reset:
                zero_grads(self._params, set_to_none=False)
            elif status.result.grad_factor != 1.0:
                scale_grads(self._params, status.result.grad_factor)
        if status.hyperparameters_follow:
            self._broadcast_hyperparameters()
        self._versions = node_protocol.params_version(self._params)

    def _rank0_status(self, result: StepResult | None, initial: bool) -> NodeStatus:
        copt = self._copt
        assert copt is not None
        epoch_changed = initial or copt.local_epoch != self._status.swarm["local_epoch"]
        if copt.diloco is not None:  # every rank takes the inner steps: send only what the swarm wrote
            params_changed = epoch_changed or copt.diloco.swarm_writes != self._swarm_writes
            self._swarm_writes = copt.diloco.swarm_writes
        else:
            # hivemind writes parameters in place (epoch step, delayed averaging result, state download): every
            # in-place write bumps the tensor's version counter, so a changed sum means changed parameters
            params_changed = epoch_changed or node_protocol.params_version(self._params) != self._versions
        return NodeStatus.read(copt, params_changed=params_changed, hyperparameters_follow=epoch_changed,
                               result=result or StepResult())

    def _broadcast_hyperparameters(self) -> None:
        """Rank 0's optimizer hyperparameters and scheduler state reach every rank's optimizer and scheduler."""
        sent = None
        if self.rank == 0:
            scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
            sent = {"groups": group_hyperparameters(self._copt.optimizer), "scheduler": scheduler}
        sent = node_protocol.broadcast_object(sent, self._wait_group)
        self._apply_hyperparameters(sent["groups"])
        if self.rank != 0 and self.scheduler is not None and sent["scheduler"] is not None:
            self.scheduler.load_state_dict(sent["scheduler"])

    # ------------------------------------------------------------------ public API

    def step(self, closure: Callable[[], Any] | None = None, *, batch: Any = None,
             batch_size: int | None = None) -> StepResult:
        """Collective: report the samples of all ranks; rank 0 steps the swarm optimizer; parameters, LR and
        scheduler state reach every rank. ``batch``/``batch_size`` are this rank's (they are summed). Returns rank
        0's :class:`~collabopt.interface.StepResult` on every rank (``loss`` is this rank's)."""
        loss, grad_scale, found_inf = self._begin_step(closure)
        try:
            samples, uncounted = resolve_samples(batch, batch_size, self._counter, self.config.batch_size), 0
        except ConfigurationError:
            samples, uncounted = 0, 1
        amp_inf = float(found_inf) if found_inf is not None else 0.0
        totals = node_protocol.sum_over_ranks([float(samples), float(uncounted), amp_inf], self._wait_group)
        total, uncounted_ranks, inf_sum = int(totals[0]), int(totals[1]), totals[2]
        if uncounted_ranks:  # every rank fails alike, before rank 0 touches the swarm
            raise ConfigurationError(
                "step", f"{uncounted_ranks} of {self.world_size} ranks cannot tell how many samples this step had",
                "call step(batch_size=len(x)) or step(batch=(x, y)) on every rank, or pass model= / batch_size=",
            )
        result: StepResult | None = None
        error: BaseException | None = None
        if self.rank == 0:
            copt = self._copt
            try:
                if found_inf is not None:  # any rank's overflow is the node's (DDP averaged the gradients)
                    copt.grad_scale = grad_scale
                    copt.found_inf = torch.tensor(inf_sum)
                result = copt.step(batch_size=total)
            except BaseException as e:
                error = e
            finally:
                copt.__dict__.pop("grad_scale", None)
                copt.__dict__.pop("found_inf", None)
        inner_step = None
        if self.rank != 0 and self.config.outer_optimizer is not None:  # DiLoCo: every rank steps its optimizer
            inner_step = functools.partial(self._inner_step, grad_scale)
        self._sync(result=result, error=error, inner_step=inner_step)  # raises rank 0's error on every rank
        return dataclasses.replace(self._status.result, loss=loss)

    def _inner_step(self, grad_scale: Any) -> None:
        """DiLoCo mode, ranks other than 0: the inner step rank 0 took, on the same (DDP-averaged) gradients."""
        if grad_scale is not None:  # AMP: rank 0's core unscaled its gradients before stepping
            scale_grads(self._params, 1.0 / float(grad_scale))
        self.user_optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients on this rank (does nothing with ``reuse_grad_buffers=True``, as in the core)."""
        self._check_open()
        if self._copt is not None:
            self._copt.zero_grad(set_to_none=set_to_none)
        elif self.config.reuse_grad_buffers:
            if not self._zero_grad_warned:
                self._zero_grad_warned = True
                warnings.warn("zero_grad() does nothing with reuse_grad_buffers=True", stacklevel=2)
        else:
            zero_grads(self._params, set_to_none)

    def _on_rank0(self, action: Callable[[CollaborativeOptimizer], Any]) -> Any:
        """Collective: run ``action`` on rank 0's core, then bring every rank up to date; rank 0's result (or
        error) reaches every rank."""
        self._check_open()
        error, value = None, None
        if self._copt is not None:
            try:
                value = action(self._copt)
            except BaseException as e:
                error = e
        self._sync(error=error)
        return node_protocol.broadcast_object(value, self._wait_group)

    def flush(self) -> None:
        """Collective: apply delayed background updates now, then bring every rank up to date."""
        self._on_rank0(lambda copt: copt.flush())

    def serve_final_state(self, timeout: float | None = None) -> str:
        """Collective, after the last step, before :meth:`close`: rank 0 flushes and serves the node's final state
        (:meth:`CollaborativeOptimizer.serve_final_state`) while the other ranks wait in the wait group (limit
        ``node_timeout``, so no default-group timeout ends them); every rank returns rank 0's reason."""
        return self._on_rank0(lambda copt: copt.serve_final_state(timeout))

    def end_run(self, serve: bool) -> str | None:
        """Collective: as :meth:`~collabopt.interface.SwarmOptimizerBase.end_run`, the ranks deciding together
        (one all-reduce): the node serves only where ``serve`` holds on every rank. Reason: a rank that serves waits
        in a collective that a rank ending on an exception (which only closes) never enters."""
        try:
            serve = not self._closed and node_protocol.every_rank(serve, self._wait_group)
        except BaseException:
            self.close()
            raise
        return super().end_run(serve)

    def load_state_from_peers(self) -> None:
        """Collective: rank 0 downloads the swarm's state; every rank receives it."""
        self._on_rank0(lambda copt: copt.load_state_from_peers())

    def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> bool:
        """Collective: rank 0 waits as :meth:`CollaborativeOptimizer.wait_for_peers` (the node counts once); every
        rank returns its answer, with the swarm metrics refreshed."""
        self._check_open()
        positive_int("num_peers", num_peers, "2")  # on every rank, before any collective
        positive_number("timeout", timeout, "60.0", allow_zero=True)
        return bool(self._on_rank0(lambda copt: copt.wait_for_peers(num_peers, timeout)))

    # ------------------------------------------------------------------ lifecycle

    def _release_hooks(self) -> None:
        if self._counter is not None:
            self._counter.remove()
        if self.rank != 0 and self._user_scheduler is not None:
            remove_step_guard(self._user_scheduler)

    def close(self) -> None:
        """Rank 0 leaves the swarm; every rank releases its hooks; the ranks then leave together (a barrier with a
        2-minute limit, so a rank that never closes cannot block the others for long). Idempotent. Call it on
        every rank."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._copt is not None:
                self._status = NodeStatus.read(self._copt)  # the last values stay readable after closing
                self._copt.close()
        finally:
            self._release_hooks()
            self._leave_wait_group()

    def _leave_wait_group(self) -> None:
        """Every rank: leave the wait group together and free it now
        (:func:`~collabopt.node_protocol.leave_wait_group`)."""
        group, self._wait_group = self._wait_group, None  # this attribute held the group's last reference
        if group is not None:
            node_protocol.leave_wait_group(group)

    def _describe(self) -> str:
        return f"rank={self.rank}/{self.world_size}, run_id={self.run_id!r}, "


__all__ = ["NodeOptimizer", "NodeStatus", "collaborative_optimizer", "is_node_job"]
