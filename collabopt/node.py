"""A node: several local processes (torch.distributed ranks) that act as ONE peer of the swarm.

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

``step``, ``zero_grad`` and construction are collective: every rank must call them the same number of times.
``state_dict``, ``load_state_dict`` and the properties are local; ``close`` ends with a barrier (2-minute limit).
``NodeOptimizer`` supports
``torch.amp.GradScaler`` (``scaler.step(copt)``) like ``CollaborativeOptimizer``. ``is_node_job()`` tells whether
:func:`collaborative_optimizer` will build a node.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from collabopt.batch_size import ForwardSampleCounter, infer_batch_size
from collabopt.errors import ConfigurationError
from collabopt.metrics import swarm_snapshot
from collabopt.optimizer import CollaborativeOptimizer, _positive_int, _positive_number
from collabopt.scheduling import check_scheduler, install_step_guard, remove_step_guard

logger = logging.getLogger(__name__)

DEFAULT_NODE_TIMEOUT = 24 * 3600.0  # seconds other ranks may wait for rank 0 (matchmaking, state download)

# header layout (float64 tensor broadcast from rank 0 after every step)
_ERROR, _PARAMS, _OBJECT, _GRADS_RESET, _GRAD_FACTOR, _LOCAL_EPOCH, _GLOBAL_EPOCH, _NUM_PEERS = range(8)
_SAMPLES_ACC, _SAMPLES_PER_S, _ETA, _SAMPLES_REPORTED, _SAMPLES_SKIPPED = range(8, 13)
_HEADER_SIZE = 13


def is_node_job() -> bool:
    """Whether torch.distributed is initialised with more than one process (then ranks form one node)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collaborative_optimizer(
    optimizer: torch.optim.Optimizer, *, model: torch.nn.Module | None = None, **kwargs: Any
) -> CollaborativeOptimizer | NodeOptimizer:
    """Build the right object for this process: a :class:`NodeOptimizer` when torch.distributed runs several
    processes (call it on every rank), else a plain :class:`~collabopt.CollaborativeOptimizer`.

    ``kwargs`` are those of ``CollaborativeOptimizer`` (plus ``node_timeout`` for a node).
    """
    if is_node_job():
        return NodeOptimizer(optimizer, model=model, **kwargs)
    kwargs.pop("node_timeout", None)
    return CollaborativeOptimizer(optimizer, model=model, **kwargs)


def _group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups]


class NodeOptimizer:
    """One peer made of all ranks of a torch.distributed job; only global rank 0 talks to the swarm.

    Create it on every rank with the same arguments as :class:`~collabopt.CollaborativeOptimizer` (``model`` is
    used for counting the samples of each rank). See the module docstring for what is synchronized and how.

    Args:
        optimizer: the rank's torch optimizer over the (DDP-wrapped) model's parameters.
        model: count each rank's samples from this module's forward calls in training mode.
        scheduler: LR scheduler on ``optimizer``; advanced once per global epoch, identically on every rank.
        batch_size: fixed samples per step *per rank*, used when nothing else tells the count.
        node_timeout: seconds other ranks may wait for rank 0 (matchmaking, averaging, state download).
        **kwargs: every other ``CollaborativeOptimizer`` argument; only rank 0 uses the swarm options.
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler sets grad_scale / found_inf before step()

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: torch.nn.Module | None = None,
        scheduler: Any = None,
        batch_size: int | None = None,
        node_timeout: float = DEFAULT_NODE_TIMEOUT,
        **kwargs: Any,
    ):
        self._closed = True
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError(
                "torch.distributed", "is not initialised", "call torch.distributed.init_process_group() first, or "
                "use collabopt.node.collaborative_optimizer(), which builds a plain CollaborativeOptimizer then"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(
                "optimizer", f"expected a torch.optim.Optimizer instance, got {type(optimizer).__name__}",
                "pass e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)",
            )
        if scheduler is not None:
            check_scheduler(scheduler, optimizer)
        if kwargs.get("scheduler_fn") is not None:
            raise ConfigurationError(
                "scheduler_fn", "is not supported with several processes per peer",
                "pass the scheduler instance as scheduler=",
            )
        if not isinstance(node_timeout, (int, float)) or node_timeout <= 0:
            raise ConfigurationError("node_timeout", f"must be a positive number, got {node_timeout!r}",
                                     "pass e.g. node_timeout=86400")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigurationError("model", f"expected a torch.nn.Module, got {type(model).__name__}",
                                     "pass the model you train")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module

        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.user_optimizer = optimizer
        self.user_scheduler = scheduler
        self.fixed_batch_size = batch_size
        self.reuse_grad_buffers = bool(kwargs.get("reuse_grad_buffers", False))
        self.target_batch_size = kwargs.get("target_batch_size")
        self.run_id = kwargs.get("run_id")
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._counter = ForwardSampleCounter(model) if model is not None else None
        self._copt: CollaborativeOptimizer | None = None
        self._header = torch.zeros(_HEADER_SIZE, dtype=torch.float64)
        self._lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._versions = -1
        self._zero_grad_warned = False
        # every rank takes part in creating the group, in the same order (a torch.distributed requirement)
        self._wait_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=float(node_timeout)))
        self._closed = False

        error: BaseException | None = None
        if self.rank == 0:
            try:
                self._copt = CollaborativeOptimizer(optimizer, scheduler=scheduler, batch_size=batch_size, **kwargs)
            except BaseException as e:  # tell the other ranks, then raise here
                error = e
            self._send_error_or_ok(error)
            if error is not None:
                self._closed = True
                if self._counter is not None:
                    self._counter.remove()
                raise error
        else:
            self._receive_error_or_ok()
            if scheduler is not None:
                install_step_guard(scheduler, lambda metric: None)  # rank 0 steps the real schedule
        try:
            self._sync(initial=True)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ collectives

    def _send_error_or_ok(self, error: BaseException | None) -> None:
        payload: Any = None
        if isinstance(error, ConfigurationError):
            payload = ("config", error.parameter, error.problem, error.fix)
        elif error is not None:
            payload = ("error", f"{type(error).__name__}: {error}")
        dist.broadcast_object_list([payload], src=0, group=self._wait_group)

    def _receive_error_or_ok(self) -> None:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self._wait_group)
        payload = box[0]
        if payload is None:
            return
        self._closed = True
        if self._counter is not None:
            self._counter.remove()
        if payload[0] == "config":
            raise ConfigurationError(*payload[1:])
        raise RuntimeError(f"collabopt: rank 0 failed to join the swarm ({payload[1]}); see rank 0's log")

    def _params_version(self) -> int:
        return sum(p._version for p in self._params)

    def _build_header(self, *, params_changed: bool, send_object: bool, grads_reset: bool,
                      grad_factor: float) -> torch.Tensor:
        copt = self._copt
        assert copt is not None
        header = torch.zeros(_HEADER_SIZE, dtype=torch.float64)
        header[_PARAMS] = float(params_changed)
        header[_OBJECT] = float(send_object)
        header[_GRADS_RESET] = float(grads_reset)
        header[_GRAD_FACTOR] = grad_factor
        header[_LOCAL_EPOCH] = copt.local_epoch
        header[_SAMPLES_REPORTED] = copt.samples_reported
        header[_SAMPLES_SKIPPED] = copt.samples_skipped
        for index, read in ((_GLOBAL_EPOCH, lambda: copt.global_epoch), (_NUM_PEERS, lambda: copt.num_peers),
                            (_SAMPLES_ACC, lambda: copt.samples_accumulated),
                            (_SAMPLES_PER_S, lambda: copt.samples_per_second), (_ETA, lambda: copt.eta_next_epoch)):
            try:  # informational values: a failure to read one must not break the node
                header[index] = float(read())
            except Exception as e:
                logger.debug("collabopt: cannot read a swarm metric: %r", e)
                header[index] = float("nan")
        return header

    def _sync(self, *, initial: bool = False, grads_reset: bool = False, grad_factor: float = 1.0,
              error: BaseException | None = None) -> None:
        """Rank 0 tells every rank what changed, then sends parameters / hyperparameters as needed."""
        if self.rank == 0:
            if error is None:
                try:
                    epoch_changed = self._copt.local_epoch != int(self._header[_LOCAL_EPOCH])
                    params_changed = initial or epoch_changed or self._params_version() != self._versions
                    header = self._build_header(params_changed=params_changed, send_object=initial or epoch_changed,
                                                grads_reset=grads_reset, grad_factor=grad_factor)
                except BaseException as e:
                    error = e
            if error is not None:
                header = torch.zeros(_HEADER_SIZE, dtype=torch.float64)
                header[_ERROR] = 1.0
        else:
            header = torch.zeros(_HEADER_SIZE, dtype=torch.float64)
        dist.broadcast(header, src=0, group=self._wait_group)
        if header[_ERROR] > 0:
            if self.rank != 0:
                raise RuntimeError("collabopt: rank 0 failed during a step; see rank 0's log")
            raise error
        self._header = header
        if header[_PARAMS] > 0:
            self._broadcast_params()
        if self.rank != 0 and self.reuse_grad_buffers:
            if header[_GRADS_RESET] > 0:
                self._zero_local_grads(set_to_none=False)
            elif float(header[_GRAD_FACTOR]) != 1.0:
                self._scale_local_grads(float(header[_GRAD_FACTOR]))
        if header[_OBJECT] > 0:
            self._broadcast_hyperparameters()
        self._versions = self._params_version()

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
            copt = self._copt
            scheduler_state = copt._schedule.state_dict() if copt._schedule is not None else None
            box[0] = {"groups": _group_hyperparameters(copt.optimizer), "scheduler": scheduler_state}
        dist.broadcast_object_list(box, src=0, group=self._wait_group)
        payload = box[0]
        self._apply_hyperparameters(payload["groups"])
        if self.rank != 0 and self.user_scheduler is not None and payload["scheduler"] is not None:
            self.user_scheduler.load_state_dict(payload["scheduler"]["scheduler"])

    def _apply_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        """Make the user's optimizer show the hyperparameters hivemind's optimizer uses (lr, betas, ...)."""
        self._lrs = [float(g["lr"]) for g in groups]
        if self._copt is not None and self._copt.optimizer is self.user_optimizer:
            return
        for group, values in zip(self.user_optimizer.param_groups, groups, strict=True):
            group.update(copy.deepcopy(values))

    @torch.no_grad()
    def _zero_local_grads(self, set_to_none: bool) -> None:
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def _scale_local_grads(self, factor: float) -> None:
        for p in self._params:
            if p.grad is not None:
                p.grad.mul_(factor)

    # ------------------------------------------------------------------ public API

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this NodeOptimizer is closed; create a new one to keep training")

    def _local_samples(self, batch: Any, batch_size: int | None) -> int:
        counted = self._counter.pop() if self._counter is not None else 0
        if batch_size is not None:
            return int(batch_size)
        if batch is not None:
            return infer_batch_size(batch)
        if counted > 0:
            return counted
        return self.fixed_batch_size or 0

    def step(self, closure: Callable[[], Any] | None = None, *, batch: Any = None,
             batch_size: int | None = None) -> Any:
        """Collective: report the samples of all ranks; rank 0 steps the swarm optimizer; parameters, LR and
        scheduler state reach every rank. ``batch``/``batch_size`` are this rank's (they are summed)."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # set by torch.amp.GradScaler.step(); it deletes them itself afterwards
        grad_scale = self.__dict__.get("grad_scale")
        found_inf = self.__dict__.get("found_inf")
        try:
            samples = self._local_samples(batch, batch_size)
        except ConfigurationError:
            samples = -(10**12)  # make every rank fail together below
        amp_inf = float(found_inf) if found_inf is not None else 0.0
        totals = torch.tensor([float(samples), amp_inf], dtype=torch.float64)
        dist.all_reduce(totals, group=self._wait_group)
        total, inf_sum = int(totals[0]), float(totals[1])
        if total <= 0:
            raise ConfigurationError(
                "step", "cannot tell how many samples this step contributed on some rank",
                "call step(batch_size=len(x)) or step(batch=(x, y)) on every rank, or pass model= / batch_size=",
            )
        if self.rank != 0:
            self._sync()
            return loss
        copt = self._copt
        assert copt is not None
        error: BaseException | None = None
        grads_reset, grad_factor = False, 1.0
        try:
            if found_inf is not None:
                copt.grad_scale = grad_scale
                copt.found_inf = torch.tensor(inf_sum)
            copt.step(batch_size=total)
            if self.reuse_grad_buffers:
                averager = copt.hivemind_optimizer.grad_averager
                grads_reset = averager is not None and averager.local_times_accumulated == 0
                if found_inf is not None and grad_scale is None and inf_sum == 0 and copt._grad_units is not None:
                    grad_factor = float(copt._grad_units)  # the core rescaled grads unscaled by the user
        except BaseException as e:
            error = e
        finally:
            copt.__dict__.pop("grad_scale", None)
            copt.__dict__.pop("found_inf", None)
        self._sync(grads_reset=grads_reset, grad_factor=grad_factor, error=error)  # raises error on every rank
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients on this rank (does nothing with ``reuse_grad_buffers=True``, as in the core)."""
        self._check_open()
        if self.rank == 0:
            self._copt.zero_grad(set_to_none=set_to_none)
        elif self.reuse_grad_buffers:
            if not self._zero_grad_warned:
                self._zero_grad_warned = True
                warnings.warn("zero_grad() does nothing with reuse_grad_buffers=True", stacklevel=2)
        else:
            self._zero_local_grads(set_to_none)

    def report_metric(self, value: float) -> None:
        """Report a metric for ``ReduceLROnPlateau`` (rank 0's reports are used)."""
        if self._copt is not None:
            self._copt.report_metric(value)

    def flush(self) -> None:
        """Collective: apply delayed background updates now, then bring every rank up to date."""
        self._check_open()
        error = None
        if self.rank == 0:
            try:
                self._copt.flush()
            except BaseException as e:
                error = e
        self._sync(error=error)

    def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> bool:
        """Collective: rank 0 waits as :meth:`CollaborativeOptimizer.wait_for_peers` (the node counts once); every
        rank returns its answer, with the swarm metrics refreshed."""
        self._check_open()
        _positive_int("num_peers", num_peers, "2")  # on every rank, before any collective
        _positive_number("timeout", timeout, "60.0", allow_zero=True)
        error, reached = None, [False]
        if self.rank == 0:
            try:
                reached[0] = self._copt.wait_for_peers(num_peers, timeout)
            except BaseException as e:
                error = e
        self._sync(error=error)  # a failure on rank 0 is raised on every rank, as in step() and flush()
        dist.broadcast_object_list(reached, src=0, group=self._wait_group)
        return bool(reached[0])

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

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.user_optimizer.defaults

    @property
    def scheduler(self) -> Any:
        return self.user_scheduler

    def _value(self, index: int, live: Callable[[CollaborativeOptimizer], Any]) -> Any:
        if self._copt is not None and not self._copt.closed:
            try:
                return live(self._copt)
            except Exception as e:  # informational value; fall back to the last broadcast one
                logger.debug("collabopt: cannot read a swarm metric: %r", e)
        return self._header[index].item()

    @property
    def local_epoch(self) -> int:
        return int(self._value(_LOCAL_EPOCH, lambda c: c.local_epoch))

    @property
    def global_epoch(self) -> int:
        return int(self._value(_GLOBAL_EPOCH, lambda c: c.global_epoch))

    @property
    def num_peers(self) -> int:
        return int(self._value(_NUM_PEERS, lambda c: c.num_peers))

    @property
    def samples_accumulated(self) -> int:
        return int(self._value(_SAMPLES_ACC, lambda c: c.samples_accumulated))

    @property
    def samples_per_second(self) -> float:
        return float(self._value(_SAMPLES_PER_S, lambda c: c.samples_per_second))

    @property
    def eta_next_epoch(self) -> float:
        return float(self._value(_ETA, lambda c: c.eta_next_epoch))

    @property
    def samples_reported(self) -> int:
        """Samples of all ranks that this node passed to the swarm."""
        return int(self._value(_SAMPLES_REPORTED, lambda c: c.samples_reported))

    @property
    def samples_skipped(self) -> int:
        return int(self._value(_SAMPLES_SKIPPED, lambda c: c.samples_skipped))

    def get_lr(self) -> list[float]:
        """Learning rates of the optimizer hivemind steps (the same on every rank)."""
        if self._copt is not None and not self._copt.closed:
            return self._copt.get_lr()
        return list(self._lrs)

    def metrics(self) -> dict[str, float]:
        """A snapshot of the swarm state (the same on every rank), for a progress bar or a logger."""
        return swarm_snapshot(self)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Local (no collective). Rank 0's holds the optimizer statistics: save rank 0's."""
        self._check_open()
        if self._copt is not None:
            return self._copt.state_dict()
        scheduler = None
        if self.user_scheduler is not None:
            scheduler = {"scheduler": self.user_scheduler.state_dict(), "epoch": self.local_epoch}
        return {
            "optimizer": self.user_optimizer.state_dict(),
            "scheduler": scheduler,
            "local_epoch": self.local_epoch,
            "samples_reported": self.samples_reported,
            "format": "collabopt/1",
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Local (no collective): every rank loads the same saved state. Load the model's parameters first."""
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != "collabopt/1":
            raise ConfigurationError("state", "not a collabopt optimizer state_dict()",
                                     "pass what copt.state_dict() returned (on rank 0)")
        if self._copt is not None:
            self._copt.load_state_dict(state)
            self._apply_hyperparameters(_group_hyperparameters(self._copt.optimizer))
        else:
            groups = state["optimizer"]["param_groups"]
            self._apply_hyperparameters([{k: v for k, v in g.items() if k != "params"} for g in groups])
            if self.user_scheduler is not None and state.get("scheduler") is not None:
                self.user_scheduler.load_state_dict(state["scheduler"]["scheduler"])
        self._header[_LOCAL_EPOCH] = int(state["local_epoch"])
        self._header[_SAMPLES_REPORTED] = int(state.get("samples_reported", 0))

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Rank 0 leaves the swarm; every rank releases its hooks; the ranks then leave together (a barrier with a
        2-minute limit, so a rank that never closes cannot block the others for long). Idempotent. Call it on
        every rank."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._copt is not None:
                self._header = self._build_header(params_changed=False, send_object=False, grads_reset=False,
                                                  grad_factor=1.0)
                self._copt.close()
        finally:
            if self._counter is not None:
                self._counter.remove()
            if self.rank != 0 and self.user_scheduler is not None:
                remove_step_guard(self.user_scheduler)
            if self._wait_group is not None:
                with contextlib.suppress(Exception):  # the default group may be gone already
                    # leave together: a rank that tore its gloo groups down while rank 0 was still leaving the
                    # swarm was seen to abort at exit ("terminate called without an active exception")
                    dist.monitored_barrier(group=self._wait_group, timeout=datetime.timedelta(seconds=120))
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(self._wait_group)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> NodeOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"epoch={self.local_epoch}"
        return f"NodeOptimizer(rank={self.rank}/{self.world_size}, run_id={self.run_id!r}, {state})"


__all__ = ["DEFAULT_NODE_TIMEOUT", "NodeOptimizer", "collaborative_optimizer", "is_node_job"]
