"""A node: several local processes (torch.distributed ranks) that act as ONE peer of the swarm.

Where it sits: :class:`NodeOptimizer` composes the core — rank 0 owns a :class:`~collabopt.CollaborativeOptimizer`
and uses only its public API (``step()`` returns the :class:`~collabopt.interface.StepResult` the other ranks need);
after every collective call rank 0 sends a :class:`NodeStatus` (flags, that result, the swarm's values) in one
broadcast. Both satisfy :class:`~collabopt.interface.SwarmOptimizer`, so adapters treat them alike.

When a job runs several processes (``torchrun``, ``accelerate launch``, Lightning DDP), letting every rank join the
swarm as its own peer diverges: DDP never re-synchronizes parameters after hivemind changed them on one rank.
Instead only global rank 0 joins the swarm (it owns a :class:`~collabopt.CollaborativeOptimizer`), and every
rank runs a :class:`NodeOptimizer` with the same API:

* **samples**: each rank counts its own samples (``step(batch_size=)``, ``step(batch=)``, the model's forward calls
  or a fixed ``batch_size``); the counts are summed over ranks (all-reduce) and rank 0 reports the sum.
* **gradients**: DDP has already averaged them over ranks, so rank 0 hands its gradients to hivemind.
* **parameters**: after every step rank 0 tells the other ranks whether hivemind changed the parameters and, if
  so, broadcasts them. Detection is exact and cheap: every in-place write to a tensor increments its autograd
  version counter (``tensor._version``), and hivemind writes parameters in place (optimizer step at an epoch
  change, a delayed averaging result applied at a later step, a state download). Rank 0 compares the sum of the
  parameters' version counters with the value after the previous broadcast; a change of ``local_epoch`` also
  triggers a broadcast. Frozen parameters (not in the optimizer) are never touched and never sent.
* **LR / scheduler**: when the epoch changes, rank 0 broadcasts the optimizer's group hyperparameters (lr,
  momentum, ...) and the scheduler's state; every rank applies them to its own optimizer and scheduler, so
  ``get_lr()``, ``optimizer.param_groups`` and ``scheduler.get_last_lr()`` agree on all ranks.
* **gradient buffers** (``reuse_grad_buffers=True``): other ranks clear or rescale ``param.grad`` exactly when rank
  0's were, so DDP keeps averaging identical accumulations.
* **timeouts**: other ranks wait while rank 0 matchmakes, averages or downloads state. They wait inside a separate
  gloo process group created with a long timeout (``node_timeout``, default 24 h), so the default group's
  timeout (gloo 30 min, nccl 10 min) cannot kill the job. Parameters travel over the default group (nccl on
  GPUs), after rank 0 has finished its step, so those collectives never wait long.
* **metrics**: ``num_peers``, ``global_epoch``, ... are rank 0's values, refreshed on every rank at each step.
* **DiLoCo mode** (``outer_optimizer=``): every rank takes the inner step itself (identical gradients, identical
  step); rank 0 takes part in the rounds and sends the parameters only when the swarm wrote them (a round, a state
  download).
* **errors**: a rank that cannot tell its sample count fails every rank (before rank 0 touches the swarm); an error
  on rank 0 is raised on every rank (a ``ConfigurationError`` stays one).

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
    copt.close()                     # on every rank; rank 0 leaves the swarm, then the ranks leave together

``step``, ``flush``, ``wait_for_peers``, ``load_state_from_peers`` and construction are collective: every rank must
call them the same number of times.
``state_dict``, ``load_state_dict`` and the properties are local; ``close`` ends with a barrier (2-minute limit).
``NodeOptimizer`` supports
``torch.amp.GradScaler`` (``scaler.step(copt)``) like ``CollaborativeOptimizer``. ``is_node_job()`` tells whether
:func:`collaborative_optimizer` will build a node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from collabopt import host_memory
from collabopt.batch_size import ForwardSampleCounter, resolve_samples
from collabopt.config import (
    CORE_OBJECTS,
    CollabConfig,
    check_model,
    check_optimizer,
    make_config,
    positive_int,
    positive_number,
)
from collabopt.errors import ConfigurationError
from collabopt.grads import scale_grads, zero_grads
from collabopt.interface import RoundOutcome, StepResult, SwarmOptimizerBase, check_state, pack_state
from collabopt.node_status import SWARM_VALUES, NodeStatus
from collabopt.optimizer import CollaborativeOptimizer
from collabopt.scheduling import (
    CollaborativeScheduler,
    check_scheduler,
    group_hyperparameters,
    install_step_guard,
    remove_step_guard,
)

logger = logging.getLogger(__name__)


def is_node_job() -> bool:
    """Whether torch.distributed is initialised with more than one process (then ranks form one node)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collaborative_optimizer(
    optimizer: torch.optim.Optimizer, *, model: torch.nn.Module | None = None, **kwargs: Any
) -> CollaborativeOptimizer | NodeOptimizer:
    """Build the right object for this process: a :class:`NodeOptimizer` when torch.distributed runs several
    processes (call it on every rank), else a plain :class:`~collabopt.CollaborativeOptimizer`.

    ``kwargs`` are those of ``CollaborativeOptimizer`` (``node_timeout`` is used by a node only).
    """
    if is_node_job():
        return NodeOptimizer(optimizer, model=model, **kwargs)
    return CollaborativeOptimizer(optimizer, model=model, **kwargs)


class NodeOptimizer(SwarmOptimizerBase):
    """One peer made of all ranks of a torch.distributed job; only global rank 0 talks to the swarm.

    Create it on every rank with the same arguments as :class:`~collabopt.CollaborativeOptimizer` (``model`` is
    used for counting the samples of each rank). See the module docstring for what is synchronized and how.

    Args:
        optimizer: the rank's torch optimizer over the (DDP-wrapped) model's parameters.
        model: count each rank's samples from this module's forward calls in training mode.
        scheduler: LR scheduler on ``optimizer``; advanced once per global epoch, identically on every rank.
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
        config: CollabConfig | None = None,
        core_factory: Callable[..., CollaborativeOptimizer] = CollaborativeOptimizer,
        **options: Any,
    ):
        self._closed = True
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
        self._wait_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=config.node_timeout))
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
        tensor = status.to_tensor()
        dist.broadcast(tensor, src=0, group=self._wait_group)
        status = NodeStatus.from_tensor(tensor)
        if status.error:
            self._raise_rank0_error(error)
        self._status = status
        if inner_step is not None and status.result.skipped == 0:
            inner_step()
        if status.params_changed:
            self._broadcast_params()
        if self.rank != 0 and self.config.reuse_grad_buffers:
            if status.result.grads_reset:
                zero_grads(self._params, set_to_none=False)
            elif status.result.grad_factor != 1.0:
                scale_grads(self._params, status.result.grad_factor)
        if status.hyperparameters_follow:
            self._broadcast_hyperparameters()
        self._versions = self._params_version()

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
            params_changed = epoch_changed or self._params_version() != self._versions
        return NodeStatus.read(copt, params_changed=params_changed, hyperparameters_follow=epoch_changed,
                               result=result or StepResult())

    def _raise_rank0_error(self, error: BaseException | None) -> None:
        """Rank 0 sends what went wrong; every rank raises it (a ConfigurationError stays one)."""
        box: list[Any] = [None]
        if self.rank == 0:
            if isinstance(error, ConfigurationError):
                box[0] = ("config", error.parameter, error.problem, error.fix)
            else:
                box[0] = ("error", f"{type(error).__name__}: {error}")
        dist.broadcast_object_list(box, src=0, group=self._wait_group)
        if self.rank == 0:
            raise error
        if box[0][0] == "config":
            raise ConfigurationError(*box[0][1:])
        raise RuntimeError(f"collabopt: rank 0 failed ({box[0][1]}); see rank 0's log")

    def _params_version(self) -> int:
        return sum(p._version for p in self._params)

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for p in self._params:
            buckets[(p.device, p.dtype)].append(p)
        for (device, _), tensors in buckets.items():
            flat = _flatten_dense_tensors([t.detach() for t in tensors])
            group = self._wait_group if device.type == "cpu" else None  # GPU tensors go over the default (nccl) group
            dist.broadcast(flat, src=0, group=group)
            if self.rank != 0:
                for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                    t.copy_(synced)

    def _broadcast_hyperparameters(self) -> None:
        box: list[Any] = [None]
        if self.rank == 0:
            scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
            box[0] = {"groups": group_hyperparameters(self._copt.optimizer), "scheduler": scheduler}
        dist.broadcast_object_list(box, src=0, group=self._wait_group)
        self._apply_hyperparameters(box[0]["groups"])
        if self.rank != 0 and self.scheduler is not None and box[0]["scheduler"] is not None:
            self.scheduler.load_state_dict(box[0]["scheduler"])

    def _apply_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        """Make the user's optimizer show the hyperparameters hivemind's optimizer uses (lr, betas, ...)."""
        self._lrs = [float(g["lr"]) for g in groups]
        if self._copt is not None and self._copt.optimizer is self.user_optimizer:
            return
        for group, values in zip(self.user_optimizer.param_groups, groups, strict=True):
            group.update(values)

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
        totals = torch.tensor([float(samples), float(uncounted), amp_inf], dtype=torch.float64)
        dist.all_reduce(totals, group=self._wait_group)
        total, uncounted_ranks, inf_sum = int(totals[0]), int(totals[1]), float(totals[2])
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

    def report_metric(self, value: float) -> None:
        """Report a metric for ``ReduceLROnPlateau`` (rank 0's reports are used)."""
        if self._copt is not None:
            self._copt.report_metric(value)

    def report_loss(self, loss: Any) -> None:
        """Report a training loss for ``collabopt monitor`` (rank 0's are published; on other ranks it does
        nothing). Local: no collective."""
        if self._copt is not None:
            self._copt.report_loss(loss)

    def _on_rank0(self, action: Callable[[CollaborativeOptimizer], Any]) -> Any:
        """Collective: run ``action`` on rank 0's core, then bring every rank up to date; rank 0's result (or
        error) reaches every rank."""
        self._check_open()
        error, box = None, [None]
        if self._copt is not None:
            try:
                box[0] = action(self._copt)
            except BaseException as e:
                error = e
        self._sync(error=error)
        dist.broadcast_object_list(box, src=0, group=self._wait_group)
        return box[0]

    def flush(self) -> None:
        """Collective: apply delayed background updates now, then bring every rank up to date."""
        self._on_rank0(lambda copt: copt.flush())

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

    # ------------------------------------------------------------------ visibility

    @property
    def is_swarm_rank(self) -> bool:
        """True on the rank that talks to the swarm (global rank 0)."""
        return self.rank == 0

    @property
    def collaborative_optimizer(self) -> CollaborativeOptimizer | None:
        """Rank 0's CollaborativeOptimizer (None on other ranks)."""
        return self._copt

    @property
    def dht(self) -> Any:
        """Rank 0's DHT (None on other ranks)."""
        return self._copt.dht if self._copt is not None else None

    @property
    def hivemind_optimizer(self) -> Any:
        return self._copt.hivemind_optimizer if self._copt is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer hivemind steps on rank 0; this rank's optimizer elsewhere."""
        return self._copt.optimizer if self._copt is not None else self.user_optimizer

    @property
    def param_groups(self) -> list[dict]:
        """This rank's param groups over the model's parameters (hyperparameters kept equal to rank 0's)."""
        return self.user_optimizer.param_groups

    def _live(self, name: str) -> Any:
        """Rank 0 reads its core; other ranks (and a closed core) the last status rank 0 sent."""
        if self._copt is not None and not self._copt.closed:
            try:
                return getattr(self._copt, name)
            except Exception as e:  # informational value; fall back to the last broadcast one
                logger.debug("collabopt: cannot read a swarm metric: %r", e)
        return self._status.swarm[name]

    def __getattr__(self, name: str) -> Any:
        """The swarm's values of :data:`SWARM_VALUES` (``local_epoch``, ``num_peers``, ``samples_reported`` — of all
        ranks —, ...; see :class:`~collabopt.interface.SwarmOptimizer`): rank 0's own, elsewhere what rank 0 sent
        with the last collective call. Only called for names not found otherwise."""
        if name in SWARM_VALUES:
            return type(SWARM_VALUES[name])(self._live(name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def last_round(self) -> RoundOutcome | None:
        """The outcome of the node's last round (see :attr:`CollaborativeOptimizer.last_round`): rank 0's own,
        elsewhere what rank 0 sent with the last collective call (without its ``detail``)."""
        if self._copt is not None and not self._copt.closed:
            return self._copt.last_round
        return self._status.last_round

    def get_lr(self) -> list[float]:
        """Learning rates of the optimizer hivemind steps (the same on every rank)."""
        if self._copt is not None and not self._copt.closed:
            return self._copt.get_lr()
        return list(self._lrs)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Local (no collective). Rank 0's holds the optimizer statistics: save rank 0's."""
        self._check_open()
        if self._copt is not None:
            return self._copt.state_dict()
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        return pack_state(self.user_optimizer.state_dict(), scheduler, self.local_epoch, self.samples_reported)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Local (no collective): every rank loads the same saved state. Load the model's parameters first."""
        self._check_open()
        state = check_state(state)
        if self._copt is not None:
            self._copt.load_state_dict(state)
            self._apply_hyperparameters(group_hyperparameters(self._copt.optimizer))
        else:
            groups = state["optimizer"]["param_groups"]
            self._apply_hyperparameters([{k: v for k, v in g.items() if k != "params"} for g in groups])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
        self._status.swarm.update(local_epoch=int(state["local_epoch"]),
                                  samples_reported=int(state.get("samples_reported", 0)))

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
        """Every rank: leave the wait group together (a barrier, 2-minute limit), then free it now. A gloo group
        torn down while another rank still used it, or freed late (an exception's traceback keeps a failed node
        alive until the garbage collector or interpreter exit), was seen to abort a process at exit ("terminate
        called without an active exception")."""
        group, self._wait_group = self._wait_group, None  # this attribute held the group's last reference
        if group is None:
            return
        with contextlib.suppress(Exception):  # the default group may be gone already
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=120))
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)

    def _describe(self) -> str:
        return f"rank={self.rank}/{self.world_size}, run_id={self.run_id!r}, "


__all__ = ["NodeOptimizer", "NodeStatus", "collaborative_optimizer", "is_node_job"]
