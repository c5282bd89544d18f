"""collabopt.engine.robust_averaging.ClippingTensorPartReducer, a real reducer in one event loop, against hivemind's
TensorPartReducer on the same parts: the same result where members are honest, a bounded pull where one is not
(where hivemind's mean is far off, so each attack test can fail), capped weights, weight 0, a sender that fails."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch
from hivemind.averaging.partition import BannedException, TensorPartReducer

from collabopt.engine.robust_averaging import WEIGHT_CAP, ClippingTensorPartReducer
from collabopt.robust import cap_weights, centered_clip

SHAPES = [torch.Size([2048]), torch.Size([1024])]  # two parts, as two consecutive parts of one reducer


def honest(count: int, seed: int = 0, noise: float = 0.05) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Each part's gradient, and ``count`` members' noisy copies of every part (``[member][part]``)."""
    generator = torch.Generator().manual_seed(seed)
    gradients = [torch.randn(shape, generator=generator) for shape in SHAPES]
    return gradients, [[g + noise * torch.randn(g.shape, generator=generator) for g in gradients]
                       for _ in range(count)]


def run(reducer_type: type, parts: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[list]:
    """Every sender gives all its parts with its weight, concurrently; what each got back for each part."""
    async def main() -> list[list]:
        reducer = reducer_type(SHAPES, num_senders=len(parts))

        async def sender(index: int) -> list:
            return [await asyncio.wait_for(reducer.accumulate_part(index, p, part, weight=weights[index]), 5)
                    for p, part in enumerate(parts[index])]

        try:
            return list(await asyncio.gather(*(sender(i) for i in range(len(parts)))))
        finally:
            reducer.finalize()  # (ends every wait, should a sender fail)

    return asyncio.run(main())


def mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return (w @ torch.stack(list(parts)).double() / w.sum()).float()


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()))


def same_for_every_sender(results: list[list]) -> list[torch.Tensor]:
    for got in results[1:]:
        for part, first in zip(got, results[0], strict=True):
            assert torch.equal(part, first)
    return results[0]


def test_honest_senders_get_nearly_hiveminds_weighted_mean():
    _, parts = honest(4)
    weights = [1.0, 2.0, 2.0, 2.0]  # (none above WEIGHT_CAP x the median: none capped)
    clipped = same_for_every_sender(run(ClippingTensorPartReducer, parts, weights))
    hiveminds = same_for_every_sender(run(TensorPartReducer, parts, weights))
    for p in range(len(SHAPES)):
        expected = mean([member[p] for member in parts], weights)
        torch.testing.assert_close(hiveminds[p], expected, rtol=0, atol=1e-6)
        # (the automatic radius clips the members beyond the majority's distance a little: collabopt.robust._radius)
        assert distance(clipped[p], expected) < 0.05 * min(distance(member[p], expected) for member in parts)


def attacked(kind: str, gradient: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    if kind == "times -20":
        return -20.0 * part
    noise = torch.randn(part.shape, generator=torch.Generator().manual_seed(7))
    return part + 100.0 * float(torch.linalg.vector_norm(gradient)) * noise / torch.linalg.vector_norm(noise)


@pytest.mark.parametrize("kind", ["times -20", "noise at 100x the norm"])
def test_one_hostile_sender_of_four_moves_hiveminds_mean_far_and_the_clip_little(kind):
    gradients, parts = honest(4)
    parts[2] = [attacked(kind, g, part) for g, part in zip(gradients, parts[2], strict=True)]
    weights = [1.0] * 4
    clipped = same_for_every_sender(run(ClippingTensorPartReducer, parts, weights))
    hiveminds = same_for_every_sender(run(TensorPartReducer, parts, weights))
    for p, gradient in enumerate(gradients):
        honest_mean = mean([parts[i][p] for i in (0, 1, 3)], [1.0] * 3)
        norm = float(torch.linalg.vector_norm(gradient))
        assert distance(hiveminds[p], honest_mean) > 4.0 * norm  # the attack hurts the mean
        assert distance(clipped[p], honest_mean) < 0.05 * norm
        # and it is collabopt.robust's CenteredClip of the four parts
        torch.testing.assert_close(clipped[p], centered_clip([member[p] for member in parts]), rtol=0, atol=1e-6)


def test_a_claim_of_1000x_the_weight_buys_the_capped_share_only():
    """Sender 3 sends a plausible part (the gradient shifted, within the clip radius) with 1,000x the weight: its
    weight is capped at the median (WEIGHT_CAP 1), a share of 1/4, where hivemind's mean gives it 1000/1003."""
    gradients, parts = honest(4)
    generator = torch.Generator().manual_seed(3)
    for p, gradient in enumerate(gradients):
        shift = torch.randn(gradient.shape, generator=generator)
        parts[3][p] = parts[3][p] + 0.05 * shift  # (as far from the others as an honest member's noise)
    weights = [1.0, 1.0, 1.0, 1000.0]
    clipped = same_for_every_sender(run(ClippingTensorPartReducer, parts, weights))
    hiveminds = same_for_every_sender(run(TensorPartReducer, parts, weights))
    for p in range(len(SHAPES)):
        members = [member[p] for member in parts]
        assert cap_weights(weights, WEIGHT_CAP) == [1.0, 1.0, 1.0, 1.0]
        equal = mean(members, [1.0, 1.0, 1.0, 1.0])  # (sender 3, the farthest, is clipped a little besides)
        assert distance(clipped[p], equal) < 0.15 * min(distance(member, equal) for member in members)
        torch.testing.assert_close(hiveminds[p], mean(members, weights), rtol=0, atol=1e-5)
        # hivemind's result is sender 3's part, give or take; the clipped one is not
        assert distance(hiveminds[p], members[3]) < 0.1 * distance(clipped[p], members[3])


def test_a_sender_of_weight_0_takes_no_part_but_gets_the_result():
    _, parts = honest(4)
    parts[0] = [1000.0 * part for part in parts[0]]
    weights = [0.0, 1.0, 1.0, 1.0]
    clipped = same_for_every_sender(run(ClippingTensorPartReducer, parts, weights))
    for p in range(len(SHAPES)):
        torch.testing.assert_close(clipped[p], mean([parts[i][p] for i in (1, 2, 3)], [1.0] * 3),
                                   rtol=0, atol=1e-6)
    # no sender of a positive weight: NaN, as hivemind's mean (0/0)
    nothing = run(ClippingTensorPartReducer, parts, [0.0] * 4)
    assert all(bool(torch.isnan(part).all()) for got in nothing for part in got)


@pytest.mark.parametrize("bad", ["NaN", "shape", "negative weight"])
def test_a_malformed_part_takes_no_part_and_stalls_nothing(bad):
    """hivemind's mean turns NaN for a NaN part; a part of another shape, or a negative weight, would fail it."""
    _, parts = honest(4)
    weights = [1.0] * 4
    if bad == "NaN":
        parts[1][0] = parts[1][0].clone()
        parts[1][0][5] = float("nan")
    elif bad == "shape":
        parts[1][0] = parts[1][0][:-1]
    else:
        weights[1] = -1.0
    clipped = same_for_every_sender(run(ClippingTensorPartReducer, parts, weights))
    torch.testing.assert_close(clipped[0], mean([parts[i][0] for i in (0, 2, 3)], [1.0] * 3), rtol=0, atol=1e-6)
    # (sender 1's second part is well-formed, unless its weight is not)
    second = [0, 1, 2, 3] if bad != "negative weight" else [0, 2, 3]
    torch.testing.assert_close(clipped[1], mean([parts[i][1] for i in second], [1.0] * len(second)),
                               rtol=0, atol=1e-6)


def test_a_sender_that_fails_mid_round_leaves_the_part_to_the_others():
    """Sender 2 gives part 0 and its task is cancelled while it waits, then the all-reduce fails it (as hivemind's
    runner does when its stream ends): the others get part 0 with its share and part 1 without it, and a part it
    sends after it failed is refused, as hivemind refuses it."""
    _, parts = honest(3)

    async def main() -> list:
        reducer = ClippingTensorPartReducer(SHAPES, num_senders=3)
        dead = asyncio.create_task(reducer.accumulate_part(2, 0, parts[2][0]))
        await asyncio.sleep(0)
        dead.cancel()
        await asyncio.sleep(0)
        reducer.on_sender_failed(2)

        async def sender(index: int) -> list[torch.Tensor]:
            return [await asyncio.wait_for(reducer.accumulate_part(index, p, part), 5)
                    for p, part in enumerate(parts[index])]

        try:
            got = await asyncio.gather(sender(0), sender(1))
            with pytest.raises(asyncio.CancelledError):
                await dead
            with pytest.raises(BannedException):
                await reducer.accumulate_part(2, 1, parts[2][1])
            return list(got)
        finally:
            reducer.finalize()

    result = same_for_every_sender(asyncio.run(main()))
    torch.testing.assert_close(result[0], mean([member[0] for member in parts], [1.0] * 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(result[1], mean([parts[i][1] for i in (0, 1)], [1.0] * 2), rtol=0, atol=1e-6)
