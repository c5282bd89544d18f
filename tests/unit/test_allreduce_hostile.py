"""Hostile or misconfigured members in collabopt's all-reduce runner (collabopt.engine.allreduce) and averaging
service (collabopt.engine.averager), without a network: a sender streaming parts beyond its slice, a sender in
another compression, a reducer answering results of the wrong shape or naming members not in the group, and a
round that fails after the group formed. Each is that member's failure (or the round's outcome), never a raise."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import (
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    SizeAdaptiveCompression,
    serialize_torch_tensor,
)
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine import averager
from collabopt.engine.allreduce import PREFETCH, AllReduceRound, _answer
from collabopt.engine.round_schema import round_schema

PEERS = [PeerID(f"peer-{i}".encode()) for i in range(3)]


def make_round(me, tensors, fractions, compression=NoCompression(), stub_for=None, peers=PEERS):
    return AllReduceRound(group_id=b"g", members=peers, me=me, tensors=tensors, weight=1.0, stub_for=stub_for,
                          fractions=fractions, compression=compression, part_size_bytes=4 * 100,
                          sender_timeout=5.0, reducer_timeout=10.0)


def inputs(n=3):
    torch.manual_seed(3)
    return [[torch.randn(1000), torch.randn(10, 30)] for _ in range(n)]


@pytest.mark.parametrize("compression", [NoCompression(), Float16Compression(),
                                         SizeAdaptiveCompression(50, NoCompression(), Float16Compression()),
                                         PerTensorCompression([Float16Compression(), NoCompression()])])
def test_each_part_is_known_by_its_size_and_compression_as_the_senders_cut_it(compression):
    tensors = inputs(1)[0]
    for me in range(3):
        sender = make_round((me + 1) % 3, tensors, [1.0, 2.0, 0.5], compression)
        reducer = make_round(me, tensors, [1.0, 2.0, 0.5], compression)

        async def sent(round_=sender, me=me):
            return [part async for part in round_.container.iterate_input_parts_for(me)]

        parts = asyncio.run(sent())
        assert reducer.part_types == [part.compression for part in parts]
        assert reducer.sizes[me] == [part.numel() for part in reducer.local_parts] == sender.sizes[me]


def serve_all(reducer, requests, sender):
    async def answers():
        return [answer async for answer in reducer.serve(requests, sender_id=PEERS[sender])]
    return asyncio.create_task(answers())


def codes(answers):
    return [MSGPackSerializer.loads(answer.metadata)[0] for answer in answers]


def test_a_sender_streaming_parts_beyond_its_slice_is_left_out_and_read_no_further():
    data = inputs()
    rounds = [make_round(i, data[i], [1.0, 0.0, 0.0]) for i in range(3)]
    pulled = []

    async def endless():  # its parts, then its last part again and again
        last = None
        async for message in rounds[2]._requests(0):
            pulled.append(1)
            last = message
            yield message
        while len(pulled) < 5000:
            pulled.append(1)
            yield last

    async def main():
        reducer = rounds[0]
        running = asyncio.create_task(reducer.run(time.monotonic() + 10))
        hostile = serve_all(reducer, endless(), 2)
        await asyncio.sleep(0.2)  # (the honest sender comes late: the hostile one streams meanwhile)
        honest = serve_all(reducer, rounds[1]._requests(0), 1)
        return await honest, await hostile, await running

    honest, hostile, (outputs, evidence) = asyncio.run(main())
    parts = rounds[0].reducer.num_parts
    assert len(pulled) <= parts + 1, "the reducer read past the slice's parts"
    assert codes(honest) == [averaging_pb2.AVERAGED_PART] * parts
    assert codes(hostile)[-1] == averaging_pb2.PROTOCOL_VIOLATION
    assert "ProtocolViolation" in evidence.errors[2] and set(evidence.errors) == {2}


def test_a_reducer_reads_a_sender_at_most_prefetch_parts_ahead():
    data = inputs()
    rounds = [make_round(i, data[i], [1.0, 0.0, 0.0]) for i in range(3)]
    pulled = []

    async def counted():
        async for message in rounds[2]._requests(0):
            pulled.append(1)
            yield message

    async def main():  # sender 1 sends nothing yet: part 0 waits for it, and sender 2's parts wait behind it
        task = serve_all(rounds[0], counted(), 2)
        await asyncio.sleep(0.3)
        task.cancel()
        rounds[0].reducer.close()

    asyncio.run(main())
    assert rounds[0].reducer.num_parts > PREFETCH + 4
    assert len(pulled) <= PREFETCH + 3, f"read {len(pulled)} parts ahead"


def test_a_sender_in_another_compression_is_refused_and_every_answer_is_in_the_parts_compression():
    data = inputs()
    fp16 = Float16Compression()
    rounds = [make_round(0, data[0], [1.0, 0.0, 0.0], fp16), make_round(1, data[1], [1.0, 0.0, 0.0], fp16),
              make_round(2, data[2], [1.0, 0.0, 0.0], NoCompression())]  # (misconfigured, or hostile)

    async def main():
        reducer = rounds[0]
        running = asyncio.create_task(reducer.run(time.monotonic() + 10))
        other = serve_all(reducer, rounds[2]._requests(0), 2)
        honest = serve_all(reducer, rounds[1]._requests(0), 1)
        return await honest, await other, await running

    honest, other, (outputs, evidence) = asyncio.run(main())
    assert codes(other) == [averaging_pb2.PROTOCOL_VIOLATION]
    assert "compression" in evidence.errors[2]
    assert codes(honest) == [averaging_pb2.AVERAGED_PART] * rounds[0].reducer.num_parts
    assert all(answer.tensor_part.compression == runtime_pb2.FLOAT16 for answer in honest)
    assert all(MSGPackSerializer.loads(answer.metadata)[1] == [0, 1] for answer in honest)


def test_the_matchmaking_key_covers_compression_part_size_and_aggregation():
    shapes = [(torch.Size([10, 3]), torch.float32)]
    key = round_schema(shapes, NoCompression(), 2**19, "mean")
    assert key == round_schema(shapes, NoCompression(), 2**19, "mean")
    others = [round_schema(shapes, Float16Compression(), 2**19, "mean"),
              round_schema(shapes, SizeAdaptiveCompression(10, NoCompression(), Float16Compression()), 2**19, "mean"),
              round_schema(shapes, SizeAdaptiveCompression(20, NoCompression(), Float16Compression()), 2**19, "mean"),
              round_schema(shapes, NoCompression(), 2**18, "mean"),
              round_schema(shapes, NoCompression(), 2**19, "centered_clip"),
              round_schema([(torch.Size([10, 3]), torch.float16)], NoCompression(), 2**19, "mean")]
    assert len({key, *others}) == 1 + len(others)


# ---------------------------------------------------------------- a hostile reducer
class HostileReducer:
    """Reducer 1's stub: answers each part with ``answer(index, part)``."""

    def __init__(self, answer):
        self.answer = answer

    async def rpc_aggregate_part(self, requests):
        async def answers():
            index = 0
            async for _ in requests:
                for reply in self.answer(index):
                    yield reply
                index += 1
        return answers()


def result(size, included=(0, 1)):
    return _answer(averaging_pb2.AVERAGED_PART, included, serialize_torch_tensor(torch.zeros(size)))


@pytest.mark.parametrize("case", ["shape", "included", "negative", "repeated", "extra"])
def test_a_reducers_bad_answer_is_its_failure_and_its_slice_keeps_local_values(case):
    peers, data = PEERS[:2], inputs(2)
    member = make_round(0, data[0], [1.0, 1.0], peers=peers)
    reducer = make_round(1, data[1], [1.0, 1.0], peers=peers)  # (sends its parts to member 0's slice)
    sizes = [part.numel() for part in reducer.local_parts]
    answers = {"shape": lambda i: [result(sizes[i] + 1)], "included": lambda i: [result(sizes[i], (0, 2))],
               "negative": lambda i: [result(sizes[i], (0, -1))], "repeated": lambda i: [result(sizes[i], (0, 0))],
               "extra": lambda i: [result(sizes[i])] * (2 if i == len(sizes) - 1 else 1)}
    member.stub_for = lambda peer: HostileReducer(answers[case])

    async def main():
        running = asyncio.create_task(member.run(time.monotonic() + 10))
        await serve_all(member, reducer._requests(0), 1)
        return await running

    outputs, evidence = asyncio.run(main())
    assert 1 in evidence.errors and "reducer" in evidence.errors[1]
    flat, own = torch.cat([t.flatten() for t in outputs]), torch.cat([t.flatten() for t in data[0]])
    start = sum(part.numel() for part in member.local_parts)
    if case == "extra":  # (its results came, then one too many)
        assert torch.equal(flat[start:], torch.zeros_like(flat[start:]))
    else:
        assert evidence.missing == ((start, own.numel()),) and torch.equal(flat[start:], own[start:])
    assert all(0 <= share <= 1 for share in evidence.contributions)


def test_a_round_that_fails_after_its_group_formed_is_an_outcome_not_a_raise():
    entry = MSGPackSerializer.dumps([True, {"epoch": 1}, None])
    group = SimpleNamespace(peer_ids=PEERS[:2], gathered=[entry, entry], group_id=b"g")

    async def look_for_group(search):
        return group

    async def main():
        service = SimpleNamespace(_busy=asyncio.Lock(), _my_entry=lambda gather: entry, on_group=None,
                                  _hints=averager.PeerHints(),
                                  _matchmaker=lambda schema: SimpleNamespace(look_for_group=look_for_group),
                                  _refusal=lambda members, entries: None)
        trigger = asyncio.get_running_loop().create_future()
        trigger.set_result(([torch.ones(3)], 1.0))
        scheduled = SimpleNamespace(timeout=5.0, group=None, _trigger=trigger)

        def contributes(gathered):
            raise RuntimeError("a hostile gathered value")

        return await averager.AveragingService._scheduled(service, scheduled, b"schema", SimpleNamespace(),
                                                          None, contributes)

    outcome = asyncio.run(main())
    assert outcome.tensors is None and outcome.group == tuple(PEERS[:2]) and outcome.evidence is None
    assert outcome.error.startswith("round failed: RuntimeError(")
