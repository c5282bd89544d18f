"""The aggregate every member computes from a round's compressed contributions (collabopt/sparse_aggregation.py):
the same bits from the same set in any order, a weighted mean or CenteredClip, hostile contributions bounded."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from collabopt.sparse_aggregation import AGREEMENT_FLOOR, aggregate, aggregate_set, exact_sum, trim_disagreeing
from collabopt.sparse_codec import PayloadError, SparseCodec

CODEC = SparseCodec(density=0.05, chunk_size=1024, bits=2)
SHAPES = [(64, 100), (1200,)]  # 7,600 values
NUMEL = 7600


class FakePeerID:
    """Like hivemind's PeerID: compared by its bytes."""

    def __init__(self, raw: bytes):
        self.raw = raw

    def to_bytes(self) -> bytes:
        return self.raw

    def __hash__(self) -> int:
        return hash(self.raw)


def pseudo_gradients(count: int, seed: int = 0, noise: float = 0.3):
    """``count`` honest members' pseudo-gradients: a common direction plus each member's noise."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=generator)
    return common, [common + noise * torch.randn(NUMEL, generator=generator) for _ in range(count)]


def payload(vector: torch.Tensor) -> bytes:
    return CODEC.encode([vector])


def flat(parts) -> torch.Tensor:
    return torch.cat([part.reshape(-1) for part in parts])


def contributions(seed: int = 0, count: int = 5, ids=None):
    _, members = pseudo_gradients(count, seed)
    ids = ids or [f"peer-{i}" for i in range(count)]
    pairs = enumerate(zip(ids, members, strict=True))
    return {peer: (float(10 + 7 * i), payload(member)) for i, (peer, member) in pairs}


@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_the_same_set_in_any_order_gives_the_same_bits(aggregation):
    base = contributions(ids=[FakePeerID(bytes([7 - i, i])) for i in range(5)])
    expected = flat(aggregate(base, SHAPES, CODEC, aggregation))
    for order in itertools.islice(itertools.permutations(base), 0, 120, 17):
        reordered = {peer: base[peer] for peer in order}
        assert torch.equal(flat(aggregate(reordered, SHAPES, CODEC, aggregation)), expected)
    threads = torch.get_num_threads()
    try:  # (another split of the work between threads: the same bits)
        torch.set_num_threads(1)
        assert torch.equal(flat(aggregate(base, SHAPES, CODEC, aggregation)), expected)
    finally:
        torch.set_num_threads(threads)


def test_the_mean_is_the_weighted_mean_of_the_decoded_contributions():
    given = contributions()
    total = sum(weight for weight, _ in given.values())
    expected = sum(weight / total * CODEC.decode_flat(data, NUMEL).double() for weight, data in given.values())
    result = aggregate(given, SHAPES, CODEC)
    assert [tuple(part.shape) for part in result] == SHAPES and result[0].dtype == torch.float32
    assert torch.allclose(flat(result).double(), expected, atol=1e-6)
    single = {"only": (3.0, payload(torch.arange(NUMEL, dtype=torch.float32)))}
    for aggregation in ("mean", "centered_clip"):
        assert torch.equal(flat(aggregate(single, SHAPES, CODEC, aggregation)), CODEC.decode_flat(
            single["only"][1], NUMEL))


def test_honest_members_get_about_their_mean_from_centered_clip():
    given = contributions(count=4)
    mean = flat(aggregate(given, SHAPES, CODEC, "mean"))
    clipped = flat(aggregate(given, SHAPES, CODEC, "centered_clip"))
    assert float((clipped - mean).norm() / mean.norm()) < 0.15


ATTACKS = {
    "times -20": lambda own, norm, generator: (1.0, -20 * own),
    "noise at 100x the norm": lambda own, norm, generator: (1.0, 100 * norm / math.sqrt(NUMEL) * torch.randn(
        NUMEL, generator=generator)),
    "1,000x the samples, flipped": lambda own, norm, generator: (1000.0, -own),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_centered_clip_bounds_one_hostile_member_of_four_where_the_mean_follows_it(attack):
    _, members = pseudo_gradients(4, seed=3)
    honest = {f"honest-{i}": (1.0, payload(member)) for i, member in enumerate(members[:3])}
    honest_mean = flat(aggregate(honest, SHAPES, CODEC, "mean"))
    weight, hostile = ATTACKS[attack](members[3], float(members[3].norm()), torch.Generator().manual_seed(9))
    attacked = dict(honest, hostile=(weight, payload(hostile)))
    scale = float(honest_mean.norm())
    mean_error = float((flat(aggregate(attacked, SHAPES, CODEC, "mean")) - honest_mean).norm()) / scale
    clipped_error = float((flat(aggregate(attacked, SHAPES, CODEC, "centered_clip")) - honest_mean).norm()) / scale
    print(f"{attack}: mean off by {mean_error:.2f}, centered_clip by {clipped_error:.3f} of the honest mean's norm")
    assert mean_error > 1.5, mean_error  # the mean follows the hostile member
    assert clipped_error < 0.5, clipped_error  # CenteredClip keeps near the honest members' mean


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_centered_clip_leaves_out_a_contribution_that_points_away_from_the_others(attack):
    """Honest sparse payloads keep different coordinates (each its own top-k); what sets a hostile one apart is its
    direction. Left out, it moves the aggregate not at all: the aggregate is that of the honest members alone."""
    _, members = pseudo_gradients(4, seed=3, noise=1.5)  # (payloads that agree less than these members do)
    honest = {f"honest-{i}": (1.0, payload(member)) for i, member in enumerate(members[:3])}
    weight, hostile = ATTACKS[attack](members[3], float(members[3].norm()), torch.Generator().manual_seed(9))
    result = aggregate_set(dict(honest, hostile=(weight, payload(hostile))), SHAPES, CODEC, "centered_clip")
    assert result.left_out == ("hostile",) and result.agreement[0] < AGREEMENT_FLOOR
    assert torch.equal(flat(result.tensors), flat(aggregate(honest, SHAPES, CODEC, "centered_clip")))
    # with 3 members waiting: the 3 kept count against them, the one left out on neither side (3 / (3 + 3))
    waited = aggregate_set(dict(honest, hostile=(weight, payload(hostile))), SHAPES, CODEC, "centered_clip", waiting=3)
    assert waited.left_out == ("hostile",)
    assert torch.equal(flat(waited.tensors), (flat(result.tensors).double() * 0.5).float())
    clean = aggregate_set(dict(honest, other=(1.0, payload(members[3]))), SHAPES, CODEC, "centered_clip")
    assert clean.left_out == ()  # an honest member agrees with the others
    assert aggregate_set(dict(honest, hostile=(weight, payload(hostile))), SHAPES, CODEC).left_out == ()  # (mean)


@pytest.mark.parametrize("count, hostile, left_out", [
    (4, 0, []),
    (4, 1, [3]),
    (4, 2, []),  # taking out one of 2 leaves disagreement behind: nobody (at most a minority, and only to agreement)
    (5, 2, [3, 4]),
    (3, 1, [2]),
])
def test_the_trim_leaves_out_the_least_agreeing_members_but_never_a_majority(count, hostile, left_out):
    _, members = pseudo_gradients(count, seed=5, noise=1.0)
    for index in range(count - hostile, count):
        members[index] = -3.0 * members[index]
    trimmed = trim_disagreeing([CODEC.decode_flat(payload(member), NUMEL) for member in members])
    assert sorted(trimmed) == left_out


@pytest.mark.parametrize("honest, hostile, bound", [(3, 2, 1.2), (4, 3, 1.7)])
def test_a_coordinated_minority_gets_no_honest_member_left_out_and_its_pull_stays_bounded(honest, hostile, bound):
    """Identical hostile payloads outvote honest ones that agree little among themselves in the others' sum: the
    trim must then leave no one out (not the honest members), and CenteredClip over everyone bounds the pull (1.06-1.10x
    and 1.54-1.58x the honest mean's norm here, as without the trim); the result is never longer than the median."""
    for seed in range(3):
        _, members = pseudo_gradients(honest + 1, seed=seed, noise=1.5)
        given = {f"honest-{i}": (1.0, payload(member)) for i, member in enumerate(members[:honest])}
        honest_mean = flat(aggregate(given, SHAPES, CODEC, "mean"))
        given.update({f"hostile-{j}": (1.0, payload(-100 * members[honest])) for j in range(hostile)})
        result = aggregate_set(given, SHAPES, CODEC, "centered_clip")
        assert result.left_out == ()
        assert float((flat(result.tensors) - honest_mean).norm() / honest_mean.norm()) < bound
        norms = sorted(float(CODEC.decode_flat(data, NUMEL).norm()) for _, data in given.values())
        assert float(flat(result.tensors).norm()) <= norms[(len(norms) - 1) // 2] * (1 + 1e-6)


def test_the_aggregate_is_never_longer_than_the_median_contribution():
    """Outside the guarantee (a hostile majority: two identical payloads of three give CenteredClip a radius of 0),
    the aggregate is still no longer than the median contribution."""
    _, members = pseudo_gradients(2, seed=4)
    given = {"honest": (1.0, payload(members[0])), "hostile-0": (1.0, payload(-100 * members[1])),
             "hostile-1": (1.0, payload(-100 * members[1]))}
    norms = sorted(float(CODEC.decode_flat(data, NUMEL).norm()) for _, data in given.values())
    assert float(flat(aggregate(given, SHAPES, CODEC, "centered_clip")).norm()) <= norms[1] * (1 + 1e-6)


def test_a_member_left_out_keeps_its_whole_update_in_its_error_feedback():
    """Applied without its payload, the peer moves to the new anchor like the others: nothing of its round is sent,
    so its buffer keeps all of it (decay * buffer + pseudo-gradient), where a member whose payload was applied keeps
    only what the payload left out."""
    from collabopt.error_feedback import ErrorFeedback

    generator = torch.Generator().manual_seed(2)
    before, delta = torch.randn(NUMEL, generator=generator), torch.randn(NUMEL, generator=generator)
    kept, applied = ErrorFeedback(CODEC, [(NUMEL,)], decay=0.9), ErrorFeedback(CODEC, [(NUMEL,)], decay=0.9)
    for feedback in (kept, applied):
        feedback.buffers = [before.clone()]
        sent = CODEC.decode_flat(feedback.compress([delta]), NUMEL)
    kept.commit_unsent()
    applied.commit()
    assert torch.allclose(kept.buffers[0], 0.9 * before + delta, atol=1e-6)
    assert torch.allclose(applied.buffers[0], 0.9 * before + delta - sent, atol=1e-6)
    assert not kept.staged


def test_a_member_that_waited_keeps_its_whole_pseudo_gradient_undecayed():
    """Not one of its round's contributors (max_contributors): the round did not take place for its buffer, which
    keeps buffer + pseudo-gradient, not decay * buffer + pseudo-gradient."""
    from collabopt.error_feedback import ErrorFeedback

    generator = torch.Generator().manual_seed(3)
    before, delta = torch.randn(NUMEL, generator=generator), torch.randn(NUMEL, generator=generator)
    feedback = ErrorFeedback(CODEC, [(NUMEL,)], decay=0.9)
    feedback.buffers = [before.clone()]
    feedback.compress([delta])
    feedback.defer()
    assert torch.allclose(feedback.buffers[0], before + delta, atol=1e-6) and not feedback.staged
    with pytest.raises(RuntimeError, match="compress"):
        feedback.defer()


@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_waiting_members_count_as_zeros(aggregation):
    given = contributions(count=4)
    alone = flat(aggregate(given, SHAPES, CODEC, aggregation))
    assert torch.equal(flat(aggregate(given, SHAPES, CODEC, aggregation, waiting=4)),
                       (alone.to(torch.float64) * 0.5).to(torch.float32))
    assert torch.equal(flat(aggregate(given, SHAPES, CODEC, aggregation, waiting=0)), alone)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="waiting"):
            aggregate(given, SHAPES, CODEC, aggregation, waiting=bad)


def test_weights_and_payloads_are_checked_and_a_bad_payload_names_its_sender():
    given = contributions(count=3)
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="weight"):
            aggregate(dict(given, hostile=(bad, given["peer-0"][1])), SHAPES, CODEC)
    with pytest.raises(PayloadError, match="'hostile'") as info:
        aggregate(dict(given, hostile=(1.0, given["peer-0"][1][:-1])), SHAPES, CODEC)
    assert info.value.peer == "hostile"
    # weight 0: takes no part (its payload is not even read)
    assert torch.equal(flat(aggregate(dict(given, idle=(0.0, b"")), SHAPES, CODEC)),
                       flat(aggregate(given, SHAPES, CODEC)))
    with pytest.raises(ValueError, match="positive weight"):
        aggregate({"a": (0.0, b"")}, SHAPES, CODEC)
    with pytest.raises(ValueError, match="positive weight"):
        aggregate({}, SHAPES, CODEC)
    with pytest.raises(ValueError, match="same bytes"):
        aggregate({"a": given["peer-0"], b"a": given["peer-1"]}, SHAPES, CODEC)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(given, SHAPES, CODEC, "median")


def test_exact_sum_is_the_same_in_any_order_and_close_to_the_true_sum():
    generator = torch.Generator().manual_seed(4)
    values = (torch.randn(100_000, generator=generator, dtype=torch.float64) * 10.0 ** torch.randint(
        -6, 6, (100_000,), generator=generator)).double()
    shuffled = values[torch.randperm(values.numel(), generator=generator)]
    assert exact_sum(values) == exact_sum(shuffled)
    true = math.fsum(values.tolist())
    assert abs(exact_sum(values) - true) <= 1e-10 * float(values.abs().max())
    assert exact_sum(torch.zeros(3, dtype=torch.float64)) == 0.0
    assert exact_sum(torch.tensor([1e-300, 3e-300], dtype=torch.float64)) == pytest.approx(4e-300)
    assert exact_sum(torch.tensor([1e300, 3e300], dtype=torch.float64)) == pytest.approx(4e300)
    random.seed(0)  # the float sum does depend on the order (what exact_sum avoids)
    parts = [random.uniform(-1, 1) * 10 ** random.randint(-8, 8) for _ in range(1000)]
    assert len({sum(random.sample(parts, len(parts))) for _ in range(20)}) > 1


@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_weights_whose_sum_passes_the_float_range_give_finite_shares(aggregation):
    """Weights of 1.68e308 or 1e308 are each finite (accepted) and sum past float64's range: the aggregate is the one of
    their ratios, never an OverflowError."""
    given = contributions(count=3)
    huge = {peer: (weight * 7e306, data) for peer, (weight, data) in given.items()}  # 7e307, 1.19e308 and 1.68e308
    result = flat(aggregate(huge, SHAPES, CODEC, aggregation))
    assert bool(torch.isfinite(result).all())
    assert torch.allclose(result, flat(aggregate(given, SHAPES, CODEC, aggregation)), atol=1e-6)
    equal = {"a": (1e308, given["peer-0"][1]), "b": (1e308, given["peer-1"][1])}
    ones = {"a": (1.0, given["peer-0"][1]), "b": (1.0, given["peer-1"][1])}
    assert torch.equal(flat(aggregate(equal, SHAPES, CODEC, aggregation)), flat(aggregate(ones, SHAPES, CODEC,
                                                                                          aggregation)))
