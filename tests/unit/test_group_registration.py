"""A member's part that arrives before this averager registered its group (the leader registers it just after
telling its followers): hivemind 1.1.12 waits for an event that any registered group sets, so where two rounds
overlap (``delay_grad_averaging``) it answered BAD_GROUP_ID; collabopt's handler waits for the group itself."""

from __future__ import annotations

import asyncio

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter

from collabopt.engine.averaging import ShieldedReducers


class _Group:
    """The all-reduce runner of a registered group: answers every part with AVERAGED_PART."""

    async def rpc_aggregate_part(self, stream, context):
        async for _ in stream:
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)


class _Hivemind:
    rpc_aggregate_part = DecentralizedAverager.rpc_aggregate_part  # hivemind's handler, as it is


class _Collabopt(ShieldedReducers, _Hivemind):
    pass


def _averager(cls: type) -> object:
    averager = object.__new__(cls)
    running = asyncio.get_event_loop().create_future()
    running.set_result(_Group())
    averager._running_groups = {b"running": running}  # the last round's all-reduce, still running
    averager._pending_groups_registered = asyncio.Event()
    averager._pending_groups_registered.set()  # (set by that round's registration)
    return averager


async def _first_answer(cls: type, handler: str) -> int:
    averager = _averager(cls)

    async def register_soon() -> None:  # the leader registers the new group a moment after its followers sent
        await asyncio.sleep(0.2)
        group = asyncio.get_event_loop().create_future()
        group.set_result(_Group())
        averager._running_groups[b"new"] = group

    registering = asyncio.create_task(register_soon())
    part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"new")
    answers = [answer.code async for answer in getattr(averager, handler)(as_aiter(part), context=None)]
    await registering
    return answers[0]


def test_a_part_sent_before_its_group_is_registered_is_answered_once_it_is():
    assert asyncio.run(_first_answer(_Collabopt, "_serve_once_registered")) == averaging_pb2.AVERAGED_PART


def test_hiveminds_handler_answers_it_bad_group_id_while_another_group_runs():
    """(what the handler above exists for)"""
    assert asyncio.run(_first_answer(_Hivemind, "rpc_aggregate_part")) == averaging_pb2.BAD_GROUP_ID
