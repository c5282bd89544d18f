"""The all-reduce of DiLoCo's pseudo-gradients: every member of a group receives the same averaged values, and a
result with parts missing is never applied as if whole."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import Float16Compression, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

from collabopt.diloco import PartialRound
from collabopt.diloco_metadata import agrees_with_group
from collabopt.engine.averaging import ShieldedReducers
from collabopt.engine.member_checks import MemberChecks

logger = logging.getLogger(__name__)


def default_pseudo_gradient_compression() -> Any:
    """How pseudo-gradients travel unless ``grad_compression=`` says otherwise: fp16 (OpenDiLoCo found it lossless)."""
    return Float16Compression()


def pseudo_gradient_averager_factory(request_timeout: float | None, **options: Any) -> Callable[..., Any]:
    """``grad_averager_factory`` of a DiLoCo peer: the pseudo-gradient averager (with ``request_timeout`` and the
    aggregation ``options``, see :func:`gradient_averager_factory`)."""
    extra = dict(options) if request_timeout is None else dict(options, request_timeout=request_timeout)
    return functools.partial(PseudoGradientAverager, **extra) if extra else PseudoGradientAverager


PARTIAL_RESULTS = "collabopt_partial_results"  # what a DiLoCo round returns instead of its group's metadata when


def _member_agrees(group_info: Any, peer_id: Any, serializer: Any) -> bool:
    """(averager process) Whether this member's round metadata, as its group gathered it, holds the group's canonical
    anchor (:func:`collabopt.diloco_metadata.agrees_with_group`); True where it cannot tell."""
    try:  # each member's (bandwidth, mode, its metadata serialized), as hivemind's matchmaking gathered them
        gathered = [serializer.loads(serializer.loads(data)[2]) for data in group_info.gathered]
        mine = gathered[list(group_info.peer_ids).index(peer_id)]
        return agrees_with_group(mine, gathered)
    except Exception:  # (malformed metadata: DiLoCo's judgement after the round decides)
        return True


def raise_if_partial(gathered: Any) -> Any:
    if isinstance(gathered, dict) and PARTIAL_RESULTS in gathered:
        raise PartialRound("part of the round's average did not arrive")
    return gathered


class PartialResults(AllreduceException):
    """The all-reduce ended with part (less than half) of the average missing here: most of this peer's
    pseudo-gradient demonstrably reached its reducers (see :class:`collabopt.diloco.PartialRound`)."""


class ValueAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, except that each reducer sends back the average itself, compressed
    once, instead of ``average - what that sender sent`` compressed per sender, and uses that same compressed
    value for its own part. hivemind's way leaves every peer a different compression error (with fp16, ~1e-3
    of the pseudo-gradient): here every peer of the group receives the same values. A result with parts missing
    (a reducer failed) raises instead of mixing in local values."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.tensor_part_container.return_deltas = False  # a failed reducer's part: the local one (then we raise)
        own = self.ordered_peer_ids.index(self.peer_id)
        self._own_part_infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[own]]

    async def run(self) -> Any:
        """Write the whole result into the averaged tensors once all of it arrived, and yield an update of zero for
        each: hivemind's averager adds each yielded update to its tensor (``_run_allreduce_inplace_``), and
        ``x + (average - x)`` is not always the average in floating point."""
        values = [value async for value in super().run()]  # (the values themselves: return_deltas is off)
        failed, total = self.tensor_part_container.failed_size, self.tensor_part_container.total_size
        if failed and 2 * failed < total:
            # a reducer returns a part's average only once it holds every member's part: most of this peer's
            # pseudo-gradient reached the group (and where the rest went is unknown)
            raise PartialResults(f"{failed} of {total} values were not averaged")
        if failed:  # most of its pseudo-gradient may not have left (its link failed): a failed round
            raise AllreduceException(f"{failed} of {total} values were not averaged")
        nothing = torch.zeros(())
        for tensor, value in zip(self.tensor_part_container.local_tensors, values, strict=True):
            tensor.copy_(value)
            yield nothing

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        compression = self.tensor_part_container.compression
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                      weight=self.weight)
            as_sent = deserialize_torch_tensor(compression.compress(averaged, self._own_part_infos[part_index]))
            self.tensor_part_container.register_processed_part(peer_index, part_index, as_sent)

    async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
        """The reducer's side of the value protocol: each part a sender streams is accumulated, and answered with
        the part's average itself, compressed as the sender compressed its part (hivemind answers ``average - part``,
        so that each sender would hold its own compression error). A sender that stops short is banned from the
        round, as hivemind's reducer does."""
        received = answered = 0
        try:
            async for part, weight, compression in amap_in_executor(
                    _read_part, stream, max_prefetch=self.tensor_part_container.prefetch):
                try:
                    average = await self.tensor_part_reducer.accumulate_part(sender_index, received, part,
                                                                             weight=weight)
                except BannedException:
                    break  # banned meanwhile: it no longer needs answers
                received += 1
                yield await _averaged_part_message(average, compression)
                answered += 1
        finally:
            if answered != self.tensor_part_reducer.num_parts:
                logger.debug(f"{self}: results to sender {sender_index}: {answered} of "
                             f"{self.tensor_part_reducer.num_parts} parts sent ({received} accumulated)",
                             stack_info=True)
            if received != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


def _read_part(message: Any) -> tuple[torch.Tensor, float, Any]:
    """(runs in an executor) A sender's part message: the part, its weight, and how it was compressed."""
    return deserialize_torch_tensor(message.tensor_part), message.weight, message.tensor_part.compression


async def _averaged_part_message(average: torch.Tensor, compression: Any) -> Any:
    """The answer carrying a part's ``average``, serialized (in an executor) with ``compression``."""
    serialized = await asyncio.get_event_loop().run_in_executor(None, serialize_torch_tensor, average, compression)
    return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)


class PseudoGradientAverager(MemberChecks, ShieldedReducers, GradientAverager):
    """hivemind's gradient averager as the carrier of pseudo-gradients: it only counts samples (the round writes
    the pseudo-gradients into its tensors) and averages with :class:`ValueAllReduceRunner`, applying a result
    only once all of it arrived. A round whose average came in part is not retried when most of it came (the
    others may have applied it with this peer's pseudo-gradient: :class:`collabopt.diloco.PartialRound`); a
    retried round resends the pseudo-gradients, not a partial result."""

    all_reduce_runner = ValueAllReduceRunner

    def __init__(self, parameters: Any, *, dht: Any, prefix: str, client_mode: bool | None = None,
                 **kwargs: Any):
        for ignored in ("reuse_grad_buffers", "accumulate_grads_on", "warn", "averaged_grads"):
            kwargs.pop(ignored, None)
        parameters = tuple(parameters)
        buffers = tuple(torch.zeros(p.shape, dtype=torch.float32).share_memory_() for p in parameters)
        kwargs.setdefault("allow_state_sharing", False)  # nothing to serve: the state averager serves the state
        self._partial_groups: set[bytes] = set()  # (averager process) all-reduces whose average came in part
        super().__init__(parameters, dht=dht, prefix=prefix, reuse_grad_buffers=True, client_mode=client_mode,
                         warn=False, averaged_grads=buffers, **kwargs)
        self.reuse_grad_buffers = False

    def _grads_from_parameters(self) -> Any:  # shapes only: never allocate .grad on the model's parameters
        return (p.detach() for p in self.parameters)

    def accumulate_grads_(self, batch_size: int) -> None:
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1

    def load_accumulators_into_averager_(self) -> None:
        pass  # the round has written the pseudo-gradients already

    def reset_accumulated_grads_(self) -> None:
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._accumulators_used_in_step = False

    async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, group_id: bytes | None = None,
                                      **kwargs: Any) -> None:
        # (hivemind's builds all_reduce_runner: ValueAllReduceRunner, which writes the result once all arrived)
        group_id = group_info.group_id if group_id is None else group_id
        if kwargs.get("weight") and not _member_agrees(group_info, self.peer_id, self.serializer):
            # this peer will not apply the round (its anchor is not the group's: DiLoCo decides the same from the
            # same gathered metadata): it takes part with nothing, so that the round holds only the pseudo-gradients
            # of the members that apply it, and it keeps its progress for the round after its download
            logger.info(f"{self}: this peer's anchor is not its group's: it joins the round with weight 0")
            kwargs["weight"] = 0.0
            for tensor in tensors:
                tensor.zero_()
        try:
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        except PartialResults as e:
            # not an error hivemind may retry: this peer's pseudo-gradient may have reached the group, and a
            # retry would send it into another round (_aggregate_with_group tells the round instead)
            logger.warning(f"{self}: {e}; this peer's pseudo-gradient may have reached its group")
            self._partial_groups.add(group_id)

    async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
        if group_info.group_id in self._partial_groups:
            self._partial_groups.discard(group_info.group_id)
            return {PARTIAL_RESULTS: True}
        return gathered
