"""The collectives a node's ranks run together (:mod:`collabopt.node`), and what they keep identical on every rank.

Where it sits: :class:`~collabopt.node.NodeOptimizer` calls these on every rank, in the same order; rank 0 is the
source of every broadcast, and what it tells the others after each call is a
:class:`~collabopt.node_status.NodeStatus`. What the ranks keep identical, and how:

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
"""

from __future__ import annotations

import contextlib
import datetime
from collections import defaultdict
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from collabopt.errors import ConfigurationError
from collabopt.lifecycle import Terminated
from collabopt.node_status import NodeStatus


def open_wait_group(timeout_s: float) -> Any:
    """The gloo group the ranks wait in. Every rank must call it, in the same order (a torch.distributed rule)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def leave_wait_group(group: Any) -> None:
    """Every rank: leave the wait group together (a barrier, 2-minute limit), then free it now. A gloo group
    torn down while another rank still used it, or freed late (an exception's traceback keeps a failed node
    alive until the garbage collector or interpreter exit), was seen to abort a process at exit ("terminate
    called without an active exception")."""
    with contextlib.suppress(Exception):  # the default group may be gone already
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=120))
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)


def broadcast_status(status: NodeStatus, group: Any) -> NodeStatus:
    """Rank 0's status on every rank, as one float64 tensor (one broadcast)."""
    tensor = status.to_tensor()
    dist.broadcast(tensor, src=0, group=group)
    return NodeStatus.from_tensor(tensor)


def broadcast_object(value: Any, group: Any) -> Any:
    """Rank 0's ``value`` (a small picklable object) on every rank; the other ranks' ``value`` is ignored."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def raise_rank0_error(error: BaseException | None, rank: int, group: Any) -> NoReturn:
    """Rank 0 sends what went wrong (its ``error``); every rank raises it (a ConfigurationError stays one, and a
    SIGTERM's Terminated too: the node ends as rank 0 does)."""
    message: Any = None
    if rank == 0:
        if isinstance(error, ConfigurationError):
            message = ("config", error.parameter, error.problem, error.fix)
        elif isinstance(error, Terminated):
            message = ("terminated",)
        else:
            message = ("error", f"{type(error).__name__}: {error}")
    message = broadcast_object(message, group)
    if rank == 0:
        raise error
    if message[0] == "config":
        raise ConfigurationError(*message[1:])
    if message[0] == "terminated":
        raise Terminated()
    raise RuntimeError(f"collabopt: rank 0 failed ({message[1]}); see rank 0's log")


def sum_over_ranks(values: list[float], group: Any) -> list[float]:
    """The element-wise sum of every rank's ``values`` (exact in float64 for counts)."""
    totals = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(totals, group=group)
    return totals.tolist()


def every_rank(flag: bool, group: Any) -> bool:
    """Whether ``flag`` holds on every rank (one all-reduce, MIN): the ranks decide together."""
    value = torch.tensor([int(bool(flag))], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def params_version(params: list[torch.Tensor]) -> int:
    """The sum of the tensors' autograd version counters: every in-place write increments one, so a changed sum
    means a tensor was written (hivemind writes parameters in place)."""
    return sum(p._version for p in params)


@torch.no_grad()
def broadcast_params(params: list[torch.Tensor], rank: int, wait_group: Any) -> None:
    """Copy rank 0's parameters into every rank's, one flat tensor per (device, dtype): CPU tensors over the
    wait group, GPU tensors over the default group (nccl)."""
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        buckets[(p.device, p.dtype)].append(p)
    for (device, _), tensors in buckets.items():
        flat = _flatten_dense_tensors([t.detach() for t in tensors])
        dist.broadcast(flat, src=0, group=wait_group if device.type == "cpu" else None)
        if rank != 0:
            for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                t.copy_(synced)
