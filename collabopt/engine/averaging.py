"""collabopt's gradient averager and the part reducer of its all-reduces: the documented seams where collabopt
subclasses hivemind's averaging.

* :class:`ShieldedTensorPartReducer`: a sender that dies mid-round no longer cancels its part for every member.
* :class:`GroupKeyManagerThatDoesNotWait`: matchmaking waits at most a second for a DHT store (a peer that stopped
  answering held each of them up for two DHT timeouts).
* :class:`ShieldedReducers`: the streams to other members open in time and are closed by the side that reads last
  (:mod:`collabopt.engine.streams`).
* :class:`GradientAveragerThatTellsGaps`: tells its optimizer which share of a round's results arrived, keeps the
  accumulation of a failed round, and can accumulate in the round's own buffers.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import functools
import multiprocessing
import typing
from collections.abc import Callable
from typing import Any

import torch
from hivemind.averaging import allreduce, matchmaking
from hivemind.averaging import averager as averager_module
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.partition import AllreduceException, TensorPartReducer
from hivemind.optim.grad_averager import GradientAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, anext, as_aiter

from collabopt.engine.compat import SameHandlers
from collabopt.engine.member_checks import MemberChecks
from collabopt.engine.streams import MemberStub, serve_until_the_sender_closes


def gradient_averager_factory(factory: Callable[..., Any] | None, request_timeout: float | None,
                              **options: Any) -> Callable[..., Any]:
    """Without a factory of the user's: :class:`GradientAveragerThatTellsGaps`. hivemind 1.1.12 hands
    ``averager_opts`` to its state averager only: give the gradient averager the same join-request timeout, where
    one is set, and the same aggregation ``options`` (:class:`ShieldedReducers`' arguments)."""
    extra = dict(options) if request_timeout is None else dict(options, request_timeout=request_timeout)
    return functools.partial(factory or GradientAveragerThatTellsGaps, **extra)


class SharedPart(asyncio.Future):
    """The future of one part's average, awaited by every sender of the part: cancelling one sender's task does not
    cancel it (that task still ends, with ``CancelledError``, as the part is averaged); only :meth:`end` does."""

    def cancel(self, msg: Any = None) -> bool:
        return False

    def end(self) -> None:
        """Cancel it: the reducer is finalized, no average will come."""
        asyncio.Future.cancel(self)


class ShieldedTensorPartReducer(TensorPartReducer):
    """hivemind's ``TensorPartReducer``, whose parts' futures are :class:`SharedPart`.

    In hivemind 1.1.12 a sender that dies mid-round cancels the part's future shared by all senders, and every member
    waits until ``allreduce_timeout``; here only the dead sender's task ends and the round goes on at once. See
    docs/decisions.md, "Shielded part reducer"."""

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():  # (hivemind made a plain future for the next part)
            self.current_part_future = SharedPart()

    def finalize(self) -> None:
        future = getattr(self, "current_part_future", None)
        if not self.finished.is_set() and isinstance(future, SharedPart):
            future.end()
        super().finalize()


# How long a reducer keeps its end of a stream open for a sender that closes it itself, without a reducer_timeout
LINGER = 60.0

# How long a member's part for a group this averager has not registered yet waits for the registration (a group's
# leader registers it just after telling the followers, who may send their parts first); then hivemind answers
# BAD_GROUP_ID, as it did at once.
REGISTRATION_WAIT = 5.0

# How long matchmaking waits for one of its DHT stores (a healthy one takes milliseconds); then it goes on, and the
# store finishes in the background.
STORE_WAIT = 1.0


class GroupKeyManagerThatDoesNotWait(GroupKeyManager):
    """hivemind's group key manager, whose declarations (a peer looking for a group, or no longer) matchmaking waits
    for at most :data:`STORE_WAIT` seconds; a slower store finishes in the background.

    In hivemind 1.1.12 matchmaking awaits each DHT store: a DHT node that stopped answering (a cut link) holds each
    one up for two DHT ``wait_timeout`` (its lookup, then its store: 6 s by default) until the DHT blacklists it, and
    again when the blacklist expires (5 s, then 10 s...). The withdrawal after a group is assembled is awaited before
    the all-reduce starts, and the declaration paces the next round's matchmaking: both rounds of an epoch waited for
    the lost peer. A healthy store is still awaited, as hivemind does: stores left running into the all-reduce went
    with more rounds whose results came in part (see docs/decisions.md, "Matchmaking does not wait for the DHT").
    Nothing reads a store's result (a declaration is advisory; a withdrawal expires after the declaration it
    replaces, so the order in which they land does not matter)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._stores: set[asyncio.Task] = set()  # (asyncio keeps weak references to tasks)

    async def declare_averager(self, *args: Any, **kwargs: Any) -> bool:
        task = asyncio.create_task(super().declare_averager(*args, **kwargs))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)
        # asyncio.wait, not wait_for: Python 3.11's wait_for returns the result of a store that lands as the caller
        # is cancelled, swallowing the cancel, and matchmaking cancels its declaring task only once (see
        # docs/decisions.md, "A search that never ended")
        done, _ = await asyncio.wait({task}, timeout=STORE_WAIT)
        return task.result() if done else True  # (a slow store goes on in the background)


class ShieldedReducers:
    """A mixin for collabopt's averagers: every all-reduce of the averager builds its part reducers as
    :class:`ShieldedTensorPartReducer` (or its ``part_reducer``), its matchmaking stores its declarations with
    :class:`GroupKeyManagerThatDoesNotWait`, and the streams of both to other members open in time and are closed
    by the side that reads last (:mod:`collabopt.engine.streams`: hivemind's matchmaking and all-reduce get their
    stubs from the averager's class, and its all-reduce handler is the averager's ``rpc_aggregate_part``).

    This is the one seam where collabopt replaces hivemind classes: hivemind's averager (its all-reduce runner),
    ``AllReduceRunner`` and ``Matchmaking`` take them from their modules, and offer no argument to choose others.
    hivemind runs each averager in a process of its own, so the modules' classes are replaced there, in the
    averager's process, as it starts: the training process, and any averager not of collabopt's (a
    ``grad_averager_factory`` of the user's), keep hivemind's."""

    # how long a stream to another member may take to open, by RPC: set as the averager's process starts
    stream_open_timeouts: dict[str, float] = {}
    # how this averager aggregates (aggregation="centered_clip": collabopt.engine.robust_averaging.aggregation_options
    # sets both): the part reducer its all-reduces build, and a function of a group's gathered data applied before
    # hivemind shares the vector out by the bandwidths in it
    part_reducer: type[TensorPartReducer] = ShieldedTensorPartReducer
    # the all-reduce runner this averager's rounds build (DiLoCo's pseudo-gradient averager: one of its own)
    all_reduce_runner: type[allreduce.AllReduceRunner] = allreduce.AllReduceRunner
    cap_gathered: Callable[[tuple[bytes, ...]], tuple[bytes, ...]] | None = None

    def __init__(self, *args: Any, part_reducer: type[TensorPartReducer] | None = None,
                 cap_gathered: Callable[[tuple[bytes, ...]], tuple[bytes, ...]] | None = None, **kwargs: Any):
        if part_reducer is not None:
            self.part_reducer = part_reducer
        self.cap_gathered = cap_gathered
        super().__init__(*args, **kwargs)

    @classmethod
    def get_stub(cls, p2p: Any, peer: Any, *, namespace: str | None = None) -> Any:
        stub = super().get_stub(p2p, peer, namespace=namespace)  # type: ignore[misc]
        return MemberStub(stub, cls.stream_open_timeouts, p2p.peer_id.to_bytes())

    # (typing's AsyncIterator: hivemind tells a streaming handler by the annotation's name)
    async def rpc_aggregate_part(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        serve = functools.partial(self._serve_once_registered, context=context)
        linger = self.allreduce_kwargs["reducer_timeout"] or LINGER  # type: ignore[attr-defined]
        async for answer in serve_until_the_sender_closes(serve, stream, context.remote_id.to_bytes(), linger):
            yield answer

    async def _serve_once_registered(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                                     context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler, once this averager has registered the part's group (at most
        :data:`REGISTRATION_WAIT`). hivemind waits for an event that any registered group sets: where two rounds
        overlap (``delay_grad_averaging``: the next epoch's round forms while the last one's all-reduce runs), the
        running one had set it, and the leader of the new group answered its followers' first parts BAD_GROUP_ID
        before registering it: a partial round with no fault. See docs/decisions.md, "Parts that came before their
        group"."""
        request = await anext(stream)
        deadline = asyncio.get_event_loop().time() + REGISTRATION_WAIT
        while (request.group_id not in self._running_groups  # type: ignore[attr-defined]
               and asyncio.get_event_loop().time() < deadline):
            await asyncio.sleep(0.01)
        async for answer in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):  # type: ignore[misc]
            yield answer

    async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        if self.cap_gathered is not None:  # every member caps the same gathered data alike: same shares
            group_info = dataclasses.replace(group_info, gathered=self.cap_gathered(group_info.gathered))
        return await super()._aggregate_with_group(group_info, *args, **kwargs)  # type: ignore[misc]

    def run(self) -> None:
        allreduce.TensorPartReducer = self.part_reducer  # (this averager's own process)
        averager_module.AllReduceRunner = self.all_reduce_runner  # (read by _run_allreduce_inplace_)
        matchmaking.GroupKeyManager = GroupKeyManagerThatDoesNotWait  # (read as Matchmaking starts, in run())
        timeouts = (("rpc_join_group", self.matchmaking_kwargs["request_timeout"]),  # type: ignore[attr-defined]
                    ("rpc_aggregate_part", self.allreduce_kwargs["reducer_timeout"]))  # type: ignore[attr-defined]
        type(self).stream_open_timeouts = {name: timeout for name, timeout in timeouts if timeout is not None}
        super().run()


class GradientAveragerThatTellsGaps(SameHandlers, MemberChecks, ShieldedReducers, GradientAverager):
    """hivemind's gradient averager, telling its optimizer which share of a round's results arrived.

    When a reducer's part does not arrive in time, hivemind 1.1.12 uses this peer's own values for it and the round
    still succeeds, with parameters that differ from the group's. The share received goes into this peer's own entry
    of the round's gathered metadata (``"received"``, only when below 1), which the lineage check reads
    (:func:`collabopt.engine.protocol.sync_round`). See docs/decisions.md, "Partial gradient rounds
    reported"."""

    # set by collabopt's optimizer where it awaits the round within its step (no delay_grad_averaging)
    keeps_accumulation = False
    # the accumulators are the round's buffers (accumulate_in_place)
    accumulates_in_place = False

    def __init__(self, *args: Any, **kwargs: Any):
        # whether an all-reduce may write into the buffers now: set as a round is triggered, cleared (under the
        # buffers' lock) when the epoch's accumulation is reset. Shared with the averager process (forked below)
        self._round_open = multiprocessing.Value(ctypes.c_bool, False, lock=False)
        self._scaled = False  # the accumulation was scaled into the round's input this epoch
        super().__init__(*args, **kwargs)

    def accumulate_in_place(self) -> None:
        """Accumulate the local steps' gradients in the round's shared-memory buffers instead of accumulators
        of their own (1x the parameters less; see :data:`ACCUMULATE_IN_PLACE`). Needs ``keeps_accumulation``."""
        assert self.keeps_accumulation and not self.reuse_grad_buffers
        with self.get_tensors() as buffers:
            for buffer in buffers:
                buffer.zero_()
            self._local_accumulators = tuple(buffers)
        self.accumulates_in_place = True

    def step(self, weight: float | None = None, reset_accumulators: bool = True, control: Any = None,
             timeout: float | None = None, wait: bool = True, **kwargs: Any) -> Any:
        """hivemind's step; with ``keeps_accumulation`` the accumulators are not zeroed as they go to the round but
        stay until the epoch ends, so that a failed round steps with this peer's own gradients (hivemind 1.1.12
        stepped with zeros). See docs/decisions.md, "A failed gradient round steps with this peer's gradients"."""
        if self.accumulates_in_place:
            self._round_open.value = True
        return super().step(weight, reset_accumulators and not self.keeps_accumulation, control, timeout, wait,
                            **kwargs)

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        if not self.accumulates_in_place:
            return super().load_accumulators_into_averager_()
        with self.get_tensors() as buffers:
            if not self._scaled:  # once an epoch: a failed round's fallback loads again what the buffers hold
                scale = 1.0 / self.local_times_accumulated if self.local_times_accumulated else 0.0
                for buffer in buffers:
                    buffer.mul_(scale)
                self._scaled = True

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        if not self.accumulates_in_place:
            return super().reset_accumulated_grads_()
        with self.get_tensors():  # an all-reduce still writing the buffers holds this lock: it finishes first
            super().reset_accumulated_grads_()
            self._scaled = False
            self._round_open.value = False

    async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, group_id: Any = None,
                                      **kwargs: Any) -> Any:
        # (in the averager process, holding the buffers' lock) a round whose epoch this peer has ended must not
        # write into the next epoch's accumulation
        if self.accumulates_in_place and not self._round_open.value:
            raise AllreduceException("collabopt: this peer ended the round's epoch, its buffers accumulate anew")
        return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        runner = self._running_groups.get(group_info.group_id)  # (set by _run_allreduce_inplace_)
        done = runner is not None and runner.done() and not runner.cancelled()
        container = getattr(runner.result(), "tensor_part_container", None) if done else None
        mine = gathered.get(self.peer_id) if isinstance(gathered, dict) else None
        if container is not None and container.failed_size and isinstance(mine, dict):
            gathered[self.peer_id] = dict(mine, received=1.0 - container.failed_size / container.total_size)
        return gathered


# Gradient accumulation in place: where the round is awaited within step() and the optimizer steps there too, on CPU
# gradients without reuse_grad_buffers, the local steps accumulate in the round's shared-memory buffers instead of
# accumulators of their own (1x the parameters less). See docs/decisions.md, "Gradient accumulation in place".
ACCUMULATE_IN_PLACE = True


def can_accumulate_in_place(optimizer: Any, averager: Any) -> bool:
    """Whether ``averager`` (the gradient averager of ``optimizer``, a ``hivemind.Optimizer`` being built) can
    accumulate in the round's buffers (see above)."""
    # (keeps_accumulation: no delay_grad_averaging)
    if not ACCUMULATE_IN_PLACE or not averager.keeps_accumulation or averager.reuse_grad_buffers:
        return False
    if optimizer.delay_optimizer_step:
        return False
    return all(acc.device.type == "cpu" and param.device.type == "cpu"
               for acc, param in zip(averager._grad_accumulators(), averager.parameters, strict=True))
