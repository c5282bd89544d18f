"""collabopt.robust: CenteredClip of one all-reduce part and capped member weights (issue 35), on fixed seeds.

The attack tests assert both sides: the plain mean is far off (the attack hurts) and CenteredClip stays near the
honest members' mean, so each can fail."""

from __future__ import annotations

import pytest
import torch

from collabopt.robust import cap_weights, centered_clip

SIZE = 4096  # one reducer's part (hivemind's parts are larger: distances concentrate even more there)


def honest_parts(count: int = 4, noise: float = 0.05, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A gradient and ``count`` members' noisy copies of it (noise relative to the gradient's coordinates)."""
    generator = torch.Generator().manual_seed(seed)
    gradient = torch.randn(SIZE, generator=generator)
    return gradient, [gradient + noise * torch.randn(SIZE, generator=generator) for _ in range(count)]


def weighted_mean(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return (w @ torch.stack(parts).double() / w.sum()).float()


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()))


def test_is_near_the_weighted_mean_when_every_member_is_honest_and_close():
    _, parts = honest_parts()
    weights = [1.0, 2.0, 3.0, 4.0]
    expected = weighted_mean(parts, weights)
    # the automatic radius clips only the members beyond the majority's distance, and by little: the result lies
    # within a few percent of the members' spread from their mean
    spread = min(distance(part, expected) for part in parts)
    assert distance(centered_clip(parts, weights), expected) < 0.05 * spread
    torch.testing.assert_close(centered_clip(parts, weights, radius=1e3), expected, rtol=0, atol=1e-6)
    # (a start anywhere: nothing clipped, one step reaches the mean)
    torch.testing.assert_close(centered_clip(parts, weights, radius=1e6, start=torch.zeros(SIZE)), expected,
                               rtol=0, atol=1e-5)


def hostile(kind: str, gradient: torch.Tensor, honest: torch.Tensor) -> torch.Tensor:
    if kind == "times -20":
        return -20.0 * honest
    noise = torch.randn(SIZE, generator=torch.Generator().manual_seed(7))
    return honest + 100.0 * float(torch.linalg.vector_norm(gradient)) * noise / torch.linalg.vector_norm(noise)


@pytest.mark.parametrize("kind", ["times -20", "noise at 100x the norm"])
@pytest.mark.parametrize("position", [0, 3])
def test_one_hostile_member_of_four_moves_the_mean_far_but_not_centered_clip(kind, position):
    gradient, parts = honest_parts()
    parts[position] = hostile(kind, gradient, parts[position])
    honest = [part for index, part in enumerate(parts) if index != position]
    honest_mean = weighted_mean(honest, [1.0] * 3)
    norm = float(torch.linalg.vector_norm(gradient))
    assert distance(weighted_mean(parts, [1.0] * 4), honest_mean) > 4.0 * norm  # the attack hurts the mean
    assert distance(centered_clip(parts), honest_mean) < 0.05 * norm
    # the pull is bounded by the radius, not by how far the hostile member is: 100x further, the same result
    farther = list(parts)
    farther[position] = honest[0] + 100.0 * (parts[position] - honest[0])
    assert distance(centered_clip(farther), centered_clip(parts)) < 1e-3 * norm


def test_a_claim_of_1000x_the_samples_buys_at_most_the_cap():
    claims = [32.0, 32.0, 32.0, 32_000.0]
    capped = cap_weights(claims)
    assert capped == [32.0, 32.0, 32.0, 64.0]
    assert capped[3] / sum(capped) <= 2.0 / 5.0
    # honest batch sizes within the factor of the median keep their weights
    assert cap_weights([16.0, 32.0, 48.0, 64.0]) == [16.0, 32.0, 48.0, 64.0]
    assert cap_weights([1.0, 1.0, 1.0, 10.0], factor=3.0) == [1.0, 1.0, 1.0, 3.0]
    # weight 0 takes no part and does not pull the median down
    assert cap_weights([0.0, 0.0, 10.0, 10.0, 100.0]) == [0.0, 0.0, 10.0, 10.0, 20.0]


def test_capped_weights_keep_a_hostile_member_claiming_1000x_from_winning():
    gradient, parts = honest_parts()
    parts[3] = -20.0 * parts[3]
    claims = [32.0, 32.0, 32.0, 32_000.0]
    honest_mean = weighted_mean(parts[:3], claims[:3])
    norm = float(torch.linalg.vector_norm(gradient))
    # uncapped, it outweighs the rest: each iteration drags the estimate a radius toward it
    assert distance(centered_clip(parts, claims), honest_mean) > 0.5 * norm
    assert distance(centered_clip(parts, cap_weights(claims)), honest_mean) < 0.1 * norm


def test_degenerate_groups():
    _, parts = honest_parts(3)
    assert torch.equal(centered_clip(parts[:1]), parts[0])
    # only one member takes part; a member of weight 0 takes none, whatever it sends
    assert torch.equal(centered_clip(parts, [0.0, 5.0, 0.0]), parts[1])
    garbage = [parts[0], parts[1], torch.full((SIZE,), 1e30)]
    torch.testing.assert_close(centered_clip(garbage, [1.0, 1.0, 0.0]), weighted_mean(parts[:2], [1.0, 1.0]),
                               rtol=0, atol=1e-6)
    # all equal: the radius is 0, the common value comes back (no 0 / 0)
    same = [parts[0].clone() for _ in range(4)]
    assert torch.equal(centered_clip(same), parts[0])
    assert torch.equal(centered_clip(same, radius=0.5), parts[0])
    # three alike and one far: the radius is 0, the three's value comes back
    assert torch.equal(centered_clip([*same[:3], parts[1] * 100]), parts[0])
    with pytest.raises(ValueError, match="weight is 0"):
        centered_clip(parts, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least one part"):
        centered_clip([])
    with pytest.raises(ValueError, match="member 1's weight is -1.0"):
        centered_clip(parts, [1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="3 weights for 2 parts"):
        centered_clip(parts[:2], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="member 2's part is"):
        centered_clip([parts[0], parts[1], parts[2][:10]])
    assert cap_weights([0.0, 0.0]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="factor"):
        cap_weights([1.0, 2.0], factor=0.5)
    with pytest.raises(ValueError, match="member 0's weight is nan"):
        cap_weights([float("nan"), 1.0])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_part_is_refused_naming_its_member(value):
    _, parts = honest_parts()
    parts[2] = parts[2].clone()
    parts[2][17] = value
    with pytest.raises(ValueError, match="member 2's part holds non-finite values"):
        centered_clip(parts)


def test_the_result_is_centered_clips_fixed_point():
    gradient, parts = honest_parts()
    parts[1] = -20.0 * parts[1]
    weights = [1.0, 1.0, 2.0, 1.0]
    radius = 3.0
    result = centered_clip(parts, weights, radius=radius, iterations=50).double()
    step = torch.zeros(SIZE, dtype=torch.float64)
    for part, weight in zip(parts, weights, strict=True):
        difference = part.double() - result
        step += weight * difference * min(1.0, radius / float(torch.linalg.vector_norm(difference)))
    assert float(torch.linalg.vector_norm(step)) / sum(weights) < 1e-4 * radius


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_dtype_comes_back_computed_in_float32(dtype):
    _, parts = honest_parts()
    parts[0] = -20.0 * parts[0]
    low = [part.to(dtype) for part in parts]
    result = centered_clip(low)
    assert result.dtype == dtype and result.shape == (SIZE,)
    reference = centered_clip([part.float() for part in low])  # the same values, in float32
    torch.testing.assert_close(result, reference.to(dtype), rtol=0, atol=0)


def test_float64_parts_are_computed_in_float64():
    _, parts = honest_parts()
    weights = [1.0, 2.0, 3.0, 4.0]
    result = centered_clip([part.double() for part in parts], weights, radius=1e3)
    assert result.dtype == torch.float64
    w = torch.tensor(weights, dtype=torch.float64)
    torch.testing.assert_close(result, w @ torch.stack(parts).double() / w.sum(), rtol=0, atol=1e-12)


def test_shapes_are_kept_and_the_result_is_deterministic():
    _, parts = honest_parts()
    shaped = [part.reshape(64, 64) for part in parts]
    shaped[0] = shaped[0] * -20
    first = centered_clip(shaped, [1.0, 2.0, 1.0, 1.0])
    assert first.shape == (64, 64)
    assert torch.equal(first, centered_clip(shaped, [1.0, 2.0, 1.0, 1.0]))
