"""collabopt's own part reducers (collabopt.engine.part_reducer) and the round's part bookkeeping
(collabopt.engine.allreduce.AllReduceRound), without a network: the members' rounds run in one event loop, each
member's stub handing its parts straight to the other member's round."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.compression import Float16Compression, NoCompression, RoleAdaptiveCompression
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine.allreduce import AllReduceRound
from collabopt.engine.clipping import ClippedPart
from collabopt.engine.parameter_rounds import round_infos
from collabopt.engine.part_reducer import (
    ClipPart,
    MeanPart,
    PartReducer,
    ReducerClosed,
    SenderDropped,
    weighted_mean,
)

SHAPE = torch.Size([50])


def test_the_mean_is_the_weighted_mean_and_the_same_bits_in_any_order():
    torch.manual_seed(0)
    parts, weights = [torch.randn(SHAPE) for _ in range(4)], [1.0, 3.0, 0.5, 2.0]
    expected = sum(w * p.double() for p, w in zip(parts, weights, strict=True)) / sum(weights)
    results = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        mean = MeanPart(SHAPE)
        for sender in order:
            assert mean.add(sender, parts[sender], weights[sender])
        results.append(mean.result())
    assert torch.equal(results[0], results[1])
    assert torch.allclose(results[0].double(), expected, atol=1e-6)
    assert torch.equal(results[0], weighted_mean(parts, weights))


@pytest.mark.parametrize("aggregate", [MeanPart, ClipPart])
def test_malformed_parts_take_no_part(aggregate):
    part = aggregate(SHAPE)
    assert not part.add(0, torch.full(SHAPE, float("nan")), 1.0)
    assert not part.add(1, torch.ones(7), 1.0)
    assert not part.add(2, torch.ones(SHAPE), -1.0)
    assert not part.add(3, torch.ones(SHAPE), float("inf"))
    assert part.add(4, torch.ones(SHAPE), 1.0)
    assert torch.equal(part.result(), torch.ones(SHAPE))


def test_the_clip_bounds_a_hostile_sender_and_matches_the_shared_clipped_part():
    torch.manual_seed(1)
    honest = [torch.ones(SHAPE) + 0.01 * torch.randn(SHAPE) for _ in range(3)]
    hostile = -20 * honest[0]
    clip = ClipPart(SHAPE)
    for sender, part in enumerate([*honest, hostile]):
        clip.add(sender, part, 1.0)
    result = clip.result()
    reference = ClippedPart(SHAPE)
    for part in [*honest, hostile]:
        reference.add_(part, alpha=1.0)
    assert torch.equal(result, reference.div_(0.0))
    honest_mean = torch.stack(honest).mean(0)
    plain_mean = torch.stack([*honest, hostile]).mean(0)
    assert (result - honest_mean).norm() < 0.2 * (plain_mean - honest_mean).norm()


def test_a_sender_that_fails_is_left_out_of_the_parts_it_did_not_send():
    async def main():
        reducer = PartReducer([SHAPE, SHAPE], num_senders=3)
        ones = torch.ones(SHAPE)
        first = [asyncio.create_task(reducer.accumulate(s, 0, ones * s, 1.0)) for s in range(3)]
        results = await asyncio.gather(*first)
        assert all(included == (0, 1, 2) for _, included in results)
        assert torch.equal(results[0][0], ones)  # (0 + 1 + 2) / 3
        second = [asyncio.create_task(reducer.accumulate(s, 1, ones * s, 1.0)) for s in (0, 1)]
        await asyncio.sleep(0.01)
        assert not any(task.done() for task in second)  # (waiting for sender 2)
        reducer.sender_failed(2)
        results = await asyncio.gather(*second)
        assert all(included == (0, 1) for _, included in results) and torch.equal(results[0][0], ones * 0.5)
        assert reducer.complete and reducer.received == [2, 2, 1] and reducer.included == [(0, 1, 2), (0, 1)]
        with pytest.raises(SenderDropped):
            await reducer.accumulate(2, 1, ones, 1.0)

    asyncio.run(main())


def test_a_cancelled_sender_does_not_cancel_the_part_for_the_others():
    async def main():
        reducer = PartReducer([SHAPE, SHAPE], num_senders=3)
        ones = torch.ones(SHAPE)
        tasks = [asyncio.create_task(reducer.accumulate(s, 0, ones * s, 1.0)) for s in (0, 1)]
        await asyncio.sleep(0.01)
        tasks[0].cancel()  # sender 0's stream died while it waited for part 0's result
        await asyncio.sleep(0.01)
        result, included = await asyncio.wait_for(reducer.accumulate(2, 0, ones * 2, 1.0), 1.0)
        assert included == (0, 1, 2) and torch.equal(result, ones)
        assert torch.equal((await tasks[1])[0], ones)
        reducer.sender_failed(0)
        waiting = asyncio.create_task(reducer.accumulate(1, 1, ones, 1.0))
        await asyncio.sleep(0.01)
        reducer.close()
        with pytest.raises(ReducerClosed):
            await waiting

    asyncio.run(main())


# ---------------------------------------------------------------- rounds in one loop
class LocalStub:
    """A member's stub whose streams go straight to another member's round; ``answers`` cuts the stream after that
    many answers (the reducer dies), ``parts`` cuts this sender's requests after that many parts (the sender dies)."""

    def __init__(self, rounds, me, peer, answers=None, parts=None):
        self.rounds, self.me, self.peer, self.answers, self.parts = rounds, me, peer, answers, parts

    async def rpc_aggregate_part(self, requests):
        async def cut_requests():
            sent = 0
            async for message in requests:
                if self.parts is not None and sent >= self.parts:
                    return
                sent += 1
                yield message

        async def answers():
            got = 0
            async for answer in self.rounds[self.peer].serve(cut_requests(), sender_id=self.me):
                if self.answers is not None and got >= self.answers:
                    raise ConnectionResetError("the reducer died")
                got += 1
                yield answer

        return answers()


def run_rounds(inputs, weights, dead_reducer=None, dead_sender=None, cut_after=1, **options):
    peers = [PeerID(f"peer-{i}".encode()) for i in range(len(inputs))]
    rounds = {}

    def stub_for(me):
        def stub(peer):
            answers = cut_after if peers.index(peer) == dead_reducer else None
            parts = cut_after if peers.index(me) == dead_sender else None
            return LocalStub(rounds, me, peer, answers=answers, parts=parts)
        return stub

    async def main():
        for i, peer in enumerate(peers):
            rounds[peer] = AllReduceRound(group_id=b"g", members=peers, me=i, tensors=inputs[i], weight=weights[i],
                                          stub_for=stub_for(peer), fractions=[1.0] * len(peers),
                                          part_size_bytes=4 * 100, sender_timeout=0.5, reducer_timeout=1.0,
                                          **options)
        done = await asyncio.gather(*(rounds[peer].run(time.monotonic() + 5) for peer in peers))
        return {i: done[i] for i in range(len(peers)) if i not in (dead_reducer, dead_sender)}  # (the survivors)

    return asyncio.run(main())


def make_inputs(n):
    torch.manual_seed(2)
    return [[torch.randn(1000), torch.randn(10, 30)] for _ in range(n)]


def test_a_round_gives_every_member_the_same_bits_of_the_weighted_mean():
    inputs, weights = make_inputs(3), [1.0, 2.0, 4.0]
    results = run_rounds(inputs, weights)
    expected = [weighted_mean([inputs[i][k] for i in range(3)], weights) for k in range(2)]
    for outputs, evidence in results.values():
        assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
        assert evidence.complete and evidence.missing == () and evidence.received == 1.0 and not evidence.errors
        assert all(got == expected for got, expected in evidence.results_from.values())


def test_a_round_compresses_each_tensor_as_its_role_says():
    """A parameter round's tensors carry hivemind's roles (collabopt.engine.parameter_rounds.round_infos): with
    ``RoleAdaptiveCompression(parameter=fp16)`` the parameter travels in fp16 and the optimizer statistic whole."""
    inputs, weights = make_inputs(3), [1.0, 2.0, 4.0]
    infos = round_infos(inputs[0], 1, ["exp_avg"], 0)  # (a parameter and its statistic)
    compression = RoleAdaptiveCompression(parameter=Float16Compression(), default=NoCompression())
    results = run_rounds(inputs, weights, compression=compression, tensor_infos=infos)
    exact = [weighted_mean([inputs[i][k] for i in range(3)], weights) for k in range(2)]
    first = results[0][0]
    for outputs, evidence in results.values():
        assert evidence.complete and all(torch.equal(a, b) for a, b in zip(outputs, first, strict=True))
    assert torch.equal(first[0], first[0].half().float()) and not torch.equal(first[0], exact[0])  # (in fp16)
    assert torch.allclose(first[0], exact[0], atol=1e-2)
    assert torch.equal(first[1], exact[1])  # (the statistic: whole)


def test_a_sender_whose_answers_wait_holds_back_no_result_of_the_others():
    """A reducer takes a sender's parts as they come, whatever became of its answers to it: a sender whose answers
    wait (its link is busy; here they are never read) delays no part's result for the other senders."""
    peers = [PeerID(f"peer-{i}".encode()) for i in range(3)]
    inputs = make_inputs(3)

    async def main():
        rounds = [AllReduceRound(group_id=b"g", members=peers, me=i, tensors=inputs[i], weight=1.0, stub_for=None,
                                 fractions=[1.0, 0.0, 0.0], part_size_bytes=4 * 100, sender_timeout=5.0,
                                 reducer_timeout=10.0) for i in range(3)]
        reducer = rounds[0]
        running = asyncio.create_task(reducer.run(time.monotonic() + 10))

        async def answers():
            return [answer async for answer in reducer.serve(rounds[2]._requests(0), sender_id=peers[2])]

        reading = asyncio.create_task(answers())
        waiting = reducer.serve(rounds[1]._requests(0), sender_id=peers[1])
        await asyncio.wait_for(waiting.__anext__(), 2.0)  # its first answer; the others are never read
        got = await asyncio.wait_for(reading, 2.0)  # (within the reducer's patience: sender 1 is not left out)
        await waiting.aclose()
        outputs, evidence = await running
        return got, outputs, evidence, reducer.reducer.num_parts

    got, outputs, evidence, parts = asyncio.run(main())
    assert parts > 2 and len(got) == parts
    assert all(MSGPackSerializer.loads(answer.metadata) == [averaging_pb2.AVERAGED_PART, [0, 1, 2]] for answer in got)
    expected = [weighted_mean([inputs[i][k] for i in range(3)], [1.0] * 3) for k in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True)) and evidence.complete


def test_a_reducer_lost_mid_round_is_named_and_its_slice_marked_missing():
    inputs, weights = make_inputs(4), [1.0] * 4
    results = run_rounds(inputs, weights, dead_reducer=3, cut_after=1)
    evidences = [evidence for _, evidence in results.values()]
    total = sum(t.numel() for t in inputs[0])
    for evidence in evidences:
        got, expected = evidence.results_from[3]
        assert got == 1 < expected and 3 in evidence.errors
        assert evidence.absent() == (evidence.members[3],)
        (start, stop), = evidence.missing
        assert stop == total and 0 < evidence.received == pytest.approx(1 - (stop - start) / total, abs=1e-12)
    assert len({ev.missing for ev in evidences}) == 1
    (start, stop), = evidences[0].missing
    flat = {i: torch.cat([t.flatten() for t in outputs]) for i, (outputs, _) in results.items()}
    for i, values in flat.items():  # every member holds the same bits outside the missing range, its own inside
        assert torch.equal(values[:start], flat[0][:start])
        assert torch.equal(values[start:], torch.cat([t.flatten() for t in inputs[i]])[start:])


def test_a_sender_lost_mid_round_is_left_out_alike_for_every_member():
    inputs, weights = make_inputs(4), [1.0] * 4
    results = run_rounds(inputs, weights, dead_sender=3, cut_after=1)
    outputs = [torch.cat([t.flatten() for t in out]) for out, _ in results.values()]
    assert all(torch.equal(values, outputs[0]) for values in outputs)
    for _, evidence in results.values():
        assert evidence.received == 1.0 and evidence.missing == ()
        assert evidence.contributions[:3] == (1.0, 1.0, 1.0) and 0.0 < evidence.contributions[3] < 1.0
        assert evidence.absent() == (evidence.members[3],) and not evidence.complete


def test_a_sender_that_stalls_is_left_out_after_the_reducers_patience():
    async def main():  # (its handler hangs, e.g. writing to a member that died: it neither sends nor fails)
        reducer = PartReducer([SHAPE, SHAPE], num_senders=2, patience=0.2)
        ones = torch.ones(SHAPE)
        await asyncio.gather(*(reducer.accumulate(s, 0, ones * s, 1.0) for s in range(2)))
        result, included = await asyncio.wait_for(reducer.accumulate(0, 1, ones, 1.0), 5.0)
        assert included == (0,) and torch.equal(result, ones) and reducer.failed(1) and reducer.complete

    asyncio.run(main())
