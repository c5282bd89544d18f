"""The seams where collabopt's parameter ("state") averager subclasses hivemind's averaging, and the gradient
averager the synchronous loop builds (:func:`gradient_averager_factory`).

* :class:`ShieldedTensorPartReducer`: a sender that dies mid-round no longer cancels its part for every member.
* :class:`GroupKeyManagerThatDoesNotWait`: matchmaking waits at most a second for a DHT store (a peer that stopped
  answering held each of them up for two DHT timeouts).
* :class:`ShieldedReducers`: the streams to other members open in time and are closed by the side that reads last
  (:mod:`collabopt.engine.streams`).

The synchronous mode's gradient rounds are collabopt's own (:mod:`collabopt.engine.gradient_rounds`), on no seam.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import Any

from hivemind.averaging import allreduce, matchmaking
from hivemind.averaging import averager as averager_module
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.partition import TensorPartReducer
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, anext, as_aiter

from collabopt.engine.gradient_rounds import GradientRounds
from collabopt.engine.powersgd_rounds import PowerSGDRounds, powersgd_options
from collabopt.engine.streams import MemberStub, serve_until_the_sender_closes


def gradient_averager_factory(factory: Callable[..., Any] | None, request_timeout: float | None,
                              **options: Any) -> Callable[..., Any]:
    """The synchronous loop's gradient averager: without a factory of the user's, collabopt's gradient rounds
    (:class:`~collabopt.engine.gradient_rounds.GradientRounds`, aggregating as ``options`` say: those of
    :func:`~collabopt.engine.robust_averaging.aggregation_options`); with hivemind's ``PowerSGDGradientAverager``
    (the class or a ``functools.partial`` of it), collabopt's PowerSGD rounds with its options
    (:mod:`collabopt.engine.powersgd_rounds`); any other factory's averager, as it is. hivemind 1.1.12 hands
    ``averager_opts`` to its state averager only: give the gradient averager the same join-request timeout, where one
    is set."""
    extra = dict(options) if request_timeout is None else dict(options, request_timeout=request_timeout)
    powersgd = None if factory is None else powersgd_options(factory)
    if powersgd is not None:
        return functools.partial(PowerSGDRounds, **dict(powersgd, **extra))
    if factory is not None:  # (a hivemind averager of the user's: an instance of hivemind's class)
        return functools.partial(factory, **extra)
    aggregation = "centered_clip" if extra.pop("cap_gathered", None) is not None else "mean"
    extra.pop("part_reducer", None)
    return functools.partial(GradientRounds, aggregation=aggregation, **extra)


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
