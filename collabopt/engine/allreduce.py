"""collabopt's all-reduce runner: one round of a butterfly all-reduce among an assembled group, on hivemind's P2P.

Rules, and why:

* The tensors are cut into slices, one a member (by the group's fractions), and the slices into parts
  (:mod:`collabopt.engine.slices`, on hivemind's ``TensorPartContainer``); the round's compression serializes them. Each
  member reduces its slice with collabopt's :class:`~collabopt.engine.part_reducer.PartReducer`.
* A reducer serializes each part's result once, in its own compression of the part, and answers every sender with the
  same bytes; it keeps for itself the same bytes, read back. A sender's part in another compression, or beyond the
  slice's parts, is that sender's protocol violation (it is left out; the others go on). Every member thus holds
  bit-identical values for each part it received (hivemind sends ``average - local``: members ended ulps apart).
* Each answer names the senders whose values the part holds: every member learns, as data, whose contribution is in
  which part, and which parts never came (:class:`RoundEvidence`). Where a reducer's results do not come, a member
  keeps its own values for them, and says so (``missing``); nothing here decides whether the round counts
  (:mod:`collabopt.engine.protocol` does).
* Streams open within their timeouts and the side that reads last closes first (:mod:`collabopt.engine.streams`):
  otherwise p2pd can drop a stream's last results.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    NoCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, aiter_with_timeout, anext, as_aiter
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine import streams
from collabopt.engine.part_reducer import Aggregate, MeanPart, PartReducer, ReducerClosed, SenderDropped
from collabopt.engine.slices import Slices

# How long a member's parts for a group it has not registered yet wait for the registration (a follower may send
# its first parts before the member learned of the group), then are answered BAD_GROUP_ID.
REGISTRATION_WAIT = 5.0
# How long a reducer keeps its end of a stream open for the sender to close it first (see streams.py)
LINGER = 30.0
# Parts serialized ahead of the stream (hivemind's container runs the compression in its executor, which also
# deserializes the parts and results that come in): 8 kept a sender's streams fed where 2 left them waiting (B3)
PREFETCH = 8
# How often a member holding its results checks that its senders closed their streams (50 ms added 25 ms to B3)
CLOSE_POLL = 0.005


class ProtocolViolation(Exception):
    """A sender sent what no member of the round sends: more parts than its reducer's slice, or a part in another
    compression than the reducer's."""


@dataclasses.dataclass(frozen=True)
class RoundEvidence:
    """What one member saw of one round, as data. Member indices are positions in ``members``.

    ``received``: the share of the vector's elements whose result came. ``results_from``: per reducer, (result parts
    received, parts expected). ``contributions``: per member, the share of the received results' elements that
    hold that member's values. ``missing``: flat element ranges (over the tensors concatenated) where this member
    kept its own values. ``my_slice``: per sender, the parts this member's reducer received and refused. ``errors``: per
    member, what went wrong with it (its stream, its parts)."""

    group_id: bytes
    members: tuple[PeerID, ...]
    me: int
    received: float
    results_from: dict[int, tuple[int, int]]
    contributions: tuple[float, ...]
    missing: tuple[tuple[int, int], ...]
    my_slice: dict[int, tuple[int, int]]
    errors: dict[int, str]

    @property
    def complete(self) -> bool:
        """Every result came, and every result holds every member's values."""
        return self.received == 1.0 and all(share == 1.0 for share in self.contributions)

    def absent(self) -> tuple[PeerID, ...]:
        """The members whose results did not all come or whose values are not in every result."""
        short = {i for i, (got, expected) in self.results_from.items() if got < expected}
        short |= {i for i, share in enumerate(self.contributions) if share < 1.0}
        return tuple(self.members[i] for i in sorted(short))


def _answer(code: int, included: Sequence[int] = (), part: Any = None) -> averaging_pb2.DownloadData:
    metadata = MSGPackSerializer.dumps([int(code), list(included)])
    return averaging_pb2.DownloadData(metadata=metadata) if part is None else \
        averaging_pb2.DownloadData(metadata=metadata, tensor_part=part)


class AllReduceRound:
    """One member's side of one round: it sends its slices to their reducers, reduces its own slice for every sender
    (:meth:`serve`), and assembles the results (:meth:`run`).

    ``stub_for(peer)`` gives the stub of a member (:class:`AllReduceService`'s, wrapped by
    :class:`~collabopt.engine.streams.MemberStub`). ``fractions``: each member's share of the vector to reduce (0 for
    a client-mode member). A sender that sends nothing within ``sender_timeout`` (or pauses that long), and a reducer
    that answers nothing within ``reducer_timeout``, is left out; ``reducer_timeout`` must exceed ``sender_timeout``
    (a reducer waits for its slowest sender before it answers). ``tensor_infos``: each tensor's compression info
    (:class:`~collabopt.engine.slices.Slices`; default: its index as key, no role)."""

    def __init__(self, *, group_id: bytes, members: Sequence[PeerID], me: int, tensors: Sequence[torch.Tensor],
                 weight: float, stub_for: Callable[[PeerID], Any], fractions: Sequence[float],
                 aggregate: Callable[[torch.Size], Aggregate] = MeanPart,
                 compression: CompressionBase = NoCompression(), part_size_bytes: int = 2**19,
                 sender_timeout: float = 5.0, reducer_timeout: float = 10.0,
                 tensor_infos: Sequence[CompressionInfo] | None = None):
        if not reducer_timeout > sender_timeout:
            raise ValueError(f"reducer_timeout ({reducer_timeout}) must exceed sender_timeout ({sender_timeout}): a "
                             "reducer answers once its slowest sender's part came")
        self.group_id, self.members, self.me = group_id, tuple(members), me
        self.weight, self.stub_for, self.compression = float(weight), stub_for, compression
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self.slices = Slices(tensors, fractions, compression, part_size_bytes, PREFETCH, tensor_infos)
        self.container = self.slices.container
        self.expected = self.container.num_parts_by_peer
        self.local_parts = self.container.get_raw_input_parts(me)
        layout, first = self.slices.layout(), sum(self.expected[:me])
        self.sizes = [[size for _, size in layout[sum(self.expected[:k]):sum(self.expected[:k + 1])]]
                      for k in range(len(self.expected))]  # per reducer: its parts' numbers of elements
        # each part of this member's slice in one compression type, the one every member sends it in
        self.part_types = [kind for kind, _ in layout[first:first + len(self.local_parts)]]
        self.reducer = PartReducer([part.shape for part in self.local_parts], len(self.members), aggregate,
                                   patience=sender_timeout)
        n = len(self.members)
        self.results = [0] * n  # result parts received, per reducer
        self.result_elements = [0] * n  # their elements
        self.slice_elements = [0] * n  # elements of each reducer's slice
        self.held = [0] * n  # per member: received elements whose result holds its values
        self.errors: dict[int, str] = {}
        self.started: set[int] = {me}  # senders whose parts began to come
        self._serialized: dict[int, Any] = {}  # part -> the result's bytes
        self._open_streams: dict[PeerID, int] = {}  # senders' streams being served (run: they close before it ends)

    # ---------------------------------------------------------------- the reducer's side
    def _result_bytes(self, index: int, result: torch.Tensor) -> Any:
        """Part ``index``'s result serialized in the part's compression: once, the same bytes for every sender."""
        if index not in self._serialized:
            self._serialized[index] = serialize_torch_tensor(result, self.part_types[index])
        return self._serialized[index]

    async def serve(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                    sender_id: PeerID) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """Answer one sender's parts of this member's slice with the parts' results, in order.

        The sender's parts are read as they come (:meth:`_read_parts`), added to the reducer in order as their turn
        comes (:meth:`_add_parts`), and answered as their results come, three steps apart: a step that waited for
        another held back the parts' results for every member (B3 measured it: an answer's write waits for the link
        to the sender, where it queues behind this member's own parts, and a part read only after the previous
        answer was written came late to its reducer)."""
        if sender_id not in self.members or sender_id == self.members[self.me]:
            yield _answer(averaging_pb2.PROTOCOL_VIOLATION)
            return
        sender = self.members.index(sender_id)
        self.started.add(sender)
        parts: asyncio.Queue = asyncio.Queue(PREFETCH)  # (part, weight); then None or an exception
        taken: asyncio.Queue = asyncio.Queue()  # (part index, result's future); then the same
        steps = [asyncio.create_task(self._read_parts(stream, parts)),
                 asyncio.create_task(self._add_parts(sender, parts, taken))]
        try:
            while (item := await taken.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                index, future = item
                result, included = await asyncio.shield(future)
                yield _answer(averaging_pb2.AVERAGED_PART, included, self._result_bytes(index, result))
        except (ProtocolViolation, SenderDropped, ReducerClosed, ValueError, asyncio.TimeoutError) as e:
            self.errors.setdefault(sender, f"as a sender: {e!r}")
            yield _answer(averaging_pb2.PROTOCOL_VIOLATION if isinstance(e, ProtocolViolation) else
                          averaging_pb2.INTERNAL_ERROR)
        finally:
            for step in steps:
                step.cancel()

    async def _read_parts(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                          parts: asyncio.Queue) -> None:
        """Read and deserialize a sender's parts as they come, at most ``PREFETCH`` ahead of the reducer and at most
        the slice's parts: a part beyond them, or in another compression than the part's, is the sender's protocol
        violation: it is left out from there (a hostile sender would grow this member's memory without bound, or
        make it answer others in other bytes than it keeps)."""
        loop, count, end = asyncio.get_running_loop(), 0, None
        try:
            async for message in aiter_with_timeout(stream, self.sender_timeout):
                if count >= self.reducer.num_parts:
                    raise ProtocolViolation(f"sent more than the slice's {self.reducer.num_parts} parts")
                if message.tensor_part.compression != self.part_types[count]:
                    raise ProtocolViolation(f"sent part {count} in compression type {message.tensor_part.compression}"
                                            f" where the group's is {self.part_types[count]}")
                part = await loop.run_in_executor(None, deserialize_torch_tensor, message.tensor_part)
                await parts.put((part, message.weight))
                count += 1
        except Exception as e:  # (serve raises it: answered as hivemind's handler would)
            end = e
        await parts.put(end)

    async def _add_parts(self, sender: int, parts: asyncio.Queue, taken: asyncio.Queue) -> None:
        """Add a sender's parts to the reducer in order, queueing their results' futures in ``taken``; a sender
        whose parts did not all come is left out of those that did not (once those that came are added)."""
        index, end = 0, None
        try:
            while (item := await parts.get()) is not None and not isinstance(item, BaseException):
                part, weight = item
                taken.put_nowait((index, await self.reducer.add(sender, index, part, weight)))
                index += 1
            end = item
        except Exception as e:
            end = e
        finally:
            if index != self.reducer.num_parts or isinstance(end, ProtocolViolation):
                self.reducer.sender_failed(sender)
            taken.put_nowait(end)

    @contextlib.contextmanager
    def stream_open(self, sender_id: PeerID) -> typing.Iterator[None]:
        """Counts a sender's stream open while its handler runs (until the sender closes it)."""
        self._open_streams[sender_id] = self._open_streams.get(sender_id, 0) + 1
        try:
            yield
        finally:
            self._open_streams[sender_id] -= 1

    def _streams_to_close(self) -> bool:
        """Whether a stream of a sender still in the round is open (one left out may hang on a dead member)."""
        return any(count and not (sender in self.members and self.reducer.failed(self.members.index(sender)))
                   for sender, count in self._open_streams.items())

    async def _leave_out_silent_senders(self) -> None:
        await asyncio.sleep(self.sender_timeout)
        for sender in range(len(self.members)):
            if sender not in self.started:
                self.errors.setdefault(sender, f"as a sender: sent nothing within {self.sender_timeout} s")
                self.reducer.sender_failed(sender)

    # ---------------------------------------------------------------- the sender's side
    def _register(self, reducer: int, index: int, result: torch.Tensor, included: Sequence[int]) -> None:
        self.container.register_processed_part(reducer, index, result)
        self.results[reducer] += 1
        self.result_elements[reducer] += result.numel()
        for member in included:
            self.held[member] += result.numel()

    async def _reduce_own_slice(self) -> None:
        for index, part in enumerate(self.local_parts):
            result, included = await self.reducer.accumulate(self.me, index, part, self.weight)
            serialized = self._result_bytes(index, result)  # (kept as the senders get it)
            self._register(self.me, index, deserialize_torch_tensor(serialized), included)

    async def _requests(self, reducer: int) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        async for part in self.container.iterate_input_parts_for(reducer):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id,
                                              tensor_part=part, weight=self.weight)

    async def _exchange_with(self, reducer: int) -> None:
        stream = await self.stub_for(self.members[reducer]).rpc_aggregate_part(self._requests(reducer))
        loop = asyncio.get_running_loop()
        async for answer in aiter_with_timeout(stream, self.reducer_timeout):
            code, included = MSGPackSerializer.loads(answer.metadata)
            if code != averaging_pb2.AVERAGED_PART:
                raise ConnectionError(f"answered {averaging_pb2.MessageCode.Name(code)}")
            index = self.results[reducer]  # (a bad answer is this reducer's failure: its slice keeps local values)
            if index >= self.expected[reducer]:
                raise ConnectionError(f"sent more than the slice's {self.expected[reducer]} results")
            if not isinstance(included, list) or len(set(included)) != len(included) or \
                    not all(type(m) is int and 0 <= m < len(self.members) for m in included):
                raise ConnectionError(f"named members {included!r} of part {index}, not in the group")
            result = await loop.run_in_executor(None, deserialize_torch_tensor, answer.tensor_part)
            if result.shape != (self.sizes[reducer][index],):
                raise ConnectionError(f"sent part {index} of shape {tuple(result.shape)}, not "
                                      f"({self.sizes[reducer][index]},)")
            self._register(reducer, index, result, included)
        if self.results[reducer] != self.expected[reducer]:
            raise ConnectionError(f"sent {self.results[reducer]} results of {self.expected[reducer]}")

    async def _slice(self, reducer: int) -> None:
        """Exchange one slice with its reducer (this member's own slice: with its own reducer); whatever happens,
        every part of the slice ends registered (this member's own values for those that did not come)."""
        try:
            if reducer == self.me:
                await self._reduce_own_slice()
            else:
                await self._exchange_with(reducer)
        except BaseException as e:
            self.errors.setdefault(reducer, f"as a reducer: {e!r}")
            if not isinstance(e, (Exception, asyncio.CancelledError)):
                raise
        finally:
            before = self.container.failed_size
            self.container.register_failed_reducer(reducer)  # (registers only the parts that did not come)
            self.slice_elements[reducer] = self.result_elements[reducer] + self.container.failed_size - before

    # ---------------------------------------------------------------- the round
    async def run(self, deadline: float) -> tuple[list[torch.Tensor], RoundEvidence]:
        """Run the round until every slice ended or ``deadline`` (``time.monotonic()``) passed; return this member's
        averaged tensors (its own values where results did not come) and the round's evidence."""
        watcher = asyncio.create_task(self._leave_out_silent_senders())
        slices = [asyncio.create_task(self._slice(k)) for k in range(len(self.members)) if self.expected[k]]
        try:
            if slices:
                _, pending = await asyncio.wait(slices, timeout=max(0.0, deadline - time.monotonic()))
                for task in pending:
                    task.cancel()
                await asyncio.gather(*slices, return_exceptions=True)
            outputs = self.slices.whole([piece async for piece in self.container.iterate_output_tensors()])
            # the senders close their streams once their last results came: a member that ended its round (and
            # maybe its process) with a stream still open lost results on their way (p2pd drops them)
            while self._streams_to_close() and time.monotonic() < deadline:
                await asyncio.sleep(CLOSE_POLL)
        finally:
            watcher.cancel()
            self.reducer.close()
            for task in slices:
                task.cancel()
        return outputs, self.evidence()

    def evidence(self) -> RoundEvidence:
        total = max(1, self.container.total_size)
        received = sum(self.result_elements)
        missing, start = [], 0
        for reducer in range(len(self.members)):
            got, size = self.result_elements[reducer], self.slice_elements[reducer]
            if got < size:
                missing.append((start + got, start + size))
            start += size
        return RoundEvidence(
            group_id=self.group_id, members=self.members, me=self.me, received=received / total,
            results_from={k: (self.results[k], self.expected[k]) for k in range(len(self.members)) if self.expected[k]},
            contributions=tuple(held / max(1, received) for held in self.held), missing=tuple(missing),
            my_slice={s: (self.reducer.received[s], self.reducer.refused[s]) for s in range(len(self.members))},
            errors=dict(self.errors))


class AllReduceService(ServicerBase):
    """The handlers of collabopt's rounds on one peer: join requests (handed to the matchmaking of the request's
    tensor schema, ``matchmaking_for``) and the parts other members send to this member's slices (handed to the
    round of their group, once registered with :meth:`registered`)."""

    def __init__(self, matchmaking_for: Callable[[bytes], Any]):
        self.matchmaking_for = matchmaking_for
        self.rounds: dict[bytes, AllReduceRound] = {}
        self.linger = LINGER

    @contextlib.contextmanager
    def registered(self, round_: AllReduceRound) -> typing.Iterator[AllReduceRound]:
        self.rounds[round_.group_id] = round_
        try:
            yield round_
        finally:
            self.rounds.pop(round_.group_id, None)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        matchmaking = self.matchmaking_for(request.schema_hash)
        if matchmaking is None:  # (no round of these tensors here now)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for message in streams.serve_until_the_caller_closes(matchmaking.rpc_join_group(request, context),
                                                                    streams.VERDICT_LINGER):
            yield message

    async def rpc_aggregate_part(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        first = await anext(stream)
        deadline = time.monotonic() + REGISTRATION_WAIT
        while first.group_id not in self.rounds and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        round_, reads = self.rounds.get(first.group_id), streams.ShieldedReads(stream)
        try:
            if round_ is None:
                yield _answer(averaging_pb2.BAD_GROUP_ID)
            else:
                serve = functools.partial(round_.serve, sender_id=context.remote_id)
                with round_.stream_open(context.remote_id):
                    async for answer in streams.serve_until_the_sender_closes(
                            serve, achain(as_aiter(first), reads), context.remote_id.to_bytes(), self.linger):
                        yield answer
            round_ = serve = first = None  # (the rest is read holding no round: up to the linger)
            await streams.read_to_the_end(reads, self.linger)  # (parts left unread by an early answer: streams.py)
        finally:
            reads.cancel()
