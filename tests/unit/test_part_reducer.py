"""collabopt's part reducer (collabopt.engine.averaging.ShieldedTensorPartReducer) against hivemind's, in one event
loop: a sender whose task is cancelled while it waits for a part's average must not cancel that part for the others."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import TensorPartReducer

from collabopt.engine.averaging import ShieldedTensorPartReducer

SHAPES = [torch.Size([4]), torch.Size([2])]


async def _a_sender_dies_waiting(reducer_type: type) -> list[object]:
    """Three senders; sender 2 gives part 0 and its task is cancelled while it waits; senders 0 and 1 give both
    parts. What senders 0 and 1 got for each part (a tensor, or the exception)."""
    reducer = reducer_type(SHAPES, num_senders=3)
    dead = asyncio.create_task(reducer.accumulate_part(2, 0, torch.full((4,), 9.0)))
    await asyncio.sleep(0)
    dead.cancel()
    await asyncio.sleep(0)
    reducer.on_sender_failed(2)  # hivemind's runner does this as the dead sender's stream ends

    async def sender(index: int) -> list[object]:
        got: list[object] = []
        for part, shape in enumerate(SHAPES):
            try:
                got.append(await asyncio.wait_for(reducer.accumulate_part(index, part, torch.full(shape, 3.0)), 2))
            except (asyncio.CancelledError, asyncio.TimeoutError, asyncio.InvalidStateError) as e:
                got.append(e)
                break
        return got

    results = await asyncio.gather(sender(0), sender(1))
    with pytest.raises(asyncio.CancelledError):
        await dead
    reducer.finalize()
    return [item for got in results for item in got]


def test_a_sender_cancelled_while_it_waits_leaves_the_part_to_the_others():
    got = asyncio.run(_a_sender_dies_waiting(ShieldedTensorPartReducer))
    assert len(got) == 4 and all(isinstance(item, torch.Tensor) for item in got), got
    # part 0 holds the dead sender's share (it was given before it died); part 1, which it never sent, does not
    assert torch.allclose(got[0], torch.full((4,), 5.0)) and torch.allclose(got[2], torch.full((4,), 5.0))
    assert torch.allclose(got[1], torch.full((2,), 3.0)) and torch.allclose(got[3], torch.full((2,), 3.0))


def test_hiveminds_reducer_loses_the_part_for_every_sender():
    """The reason for collabopt's reducer: with hivemind 1.1.12's, the others never get part 0's average (its future
    was cancelled with the dead sender's task)."""
    got = asyncio.run(_a_sender_dies_waiting(TensorPartReducer))
    assert not isinstance(got[0], torch.Tensor), got


def test_a_finalized_reducer_ends_every_wait():
    async def run() -> None:
        reducer = ShieldedTensorPartReducer(SHAPES, num_senders=2)
        waiting = asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(4)))
        await asyncio.sleep(0)
        reducer.finalize()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 2)

    asyncio.run(run())
