"""The secret challenge of a verified download (collabopt/engine/download_challenge.py): projections that equal
parameters answer alike (to rounding), that a permutation or a crafted state with the honest three sums does not
pass, the accept rule, and what a peer answers. The swarm test: tests/swarm/test_download_votes.py."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from collabopt.engine.download_challenge import (
    PROJECTION_TOLERANCE,
    ChallengeAnswers,
    agrees,
    challenge_refusal,
    challenge_timeout,
    new_seed,
    projection,
)
from collabopt.lineage import fingerprint, same_fingerprint

GEN = torch.Generator().manual_seed(1)
PARAMS = [torch.randn(300_000, generator=GEN) * 0.02, torch.randn(37, 5, generator=GEN)]


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def like(values, tensors=PARAMS):
    return list(values.split([t.numel() for t in tensors]))


def test_equal_parameters_and_rounding_level_differences_agree():
    seed = new_seed()
    own = projection(PARAMS, seed)
    assert len(own.values) == 4 and agrees(projection([t.clone() for t in PARAMS], seed).values, own)
    for relative in (1e-9, 1e-6):  # elementwise, random signs (1e-6: about 8 float32 ulps each)
        noisy = [t * (1 + relative * torch.randn(t.shape, generator=GEN)) for t in PARAMS]
        assert agrees(projection(noisy, seed).values, own), relative
    assert not agrees(projection(PARAMS, seed ^ 1).values, own)  # another seed: other vectors
    assert projection(PARAMS, seed).values == own.values  # (the same seed: the same vectors, bit for bit)


def test_a_permutation_with_the_same_three_sums_disagrees():
    permuted = like(flat(PARAMS)[torch.randperm(flat(PARAMS).numel(), generator=GEN)])
    assert same_fingerprint(fingerprint(permuted), fingerprint(PARAMS))  # what the fingerprint cannot tell
    for _ in range(20):
        seed = new_seed()
        assert not agrees(projection(permuted, seed).values, projection(PARAMS, seed))
    swapped = flat(PARAMS).clone()  # two parameters swapped: a change far above the tolerance
    top, low = int(swapped.argmax()), int(swapped.argmin())
    swapped[top], swapped[low] = swapped[low].item(), swapped[top].item()
    assert same_fingerprint(fingerprint(like(swapped)), fingerprint(PARAMS))
    seed = new_seed()
    assert not agrees(projection(like(swapped), seed).values, projection(PARAMS, seed))


def test_a_crafted_delta_that_keeps_the_three_sums_disagrees():
    """Honest + delta in the null space of the three sums: within positive parameters, a reflection across a
    direction orthogonal to the ones keeps the sum, the sum of magnitudes (signs kept) and the sum of squares."""
    honest = torch.rand(100_000, generator=GEN, dtype=torch.float64) + 0.5
    deviation = honest - honest.mean()
    for mix in (1.0, 0.05):  # the whole reflection about the mean, and a small part of it
        w = mix * deviation + (1 - mix) * torch.randn(honest.shape, generator=GEN, dtype=torch.float64)
        w = (w - w.mean()) / (w - w.mean()).norm()
        crafted = honest - 2 * w * (w @ deviation)
        assert bool((crafted > 0).all()) and same_fingerprint(fingerprint([crafted]), fingerprint([honest]))
        assert float((crafted - honest).norm()) > 1e-3 * float(honest.norm())
        for _ in range(5):
            seed = new_seed()
            assert not agrees(projection([crafted], seed).values, projection([honest], seed)), mix


def test_the_tolerance_is_relative_to_the_parameters_l2_norm():
    own = projection(PARAMS, 7)
    bound = PROJECTION_TOLERANCE * own.norm
    assert abs(own.norm - float(flat(PARAMS).norm())) < 1e-6 * own.norm
    assert agrees([v + 0.9 * bound for v in own.values], own)
    assert not agrees([own.values[0] + 1.1 * bound, *own.values[1:]], own)
    assert not agrees(own.values[:3], own) and not agrees([float("nan")] * 4, own) and not agrees([1, 2, 3, 4], own)


def test_the_accept_rule():
    own = projection(PARAMS, 3)
    yes, no = dict(epoch=5, projection=own.values), dict(epoch=5, projection=[v + 1.0 for v in own.values])
    later, refused = dict(epoch=6, projection=own.values), dict(refused="no member")

    def verdict(*answers):
        return challenge_refusal({f"p{i}": a for i, a in enumerate(answers)}, 5, own)

    assert verdict(yes) == (None, False)
    assert verdict(yes, yes, no) == (None, False)  # one liar among the answerers is outvoted
    assert verdict(yes, no) == (None, False)  # one against one: a hostile source gets no agreeing answer at all
    assert verdict(yes, None, later, refused) == (None, False)  # (answers at another epoch are no answers)
    assert "0 answer(s) agree, 2 disagree" in verdict(no, no)[0]
    assert verdict(no, no)[1] is False and verdict(yes, no, no)[0] is not None
    assert verdict(yes, yes, no, no)[0] is not None  # a tie of two: refused
    assert verdict(no)[0] is not None
    for answers in ((), (None,), (later, later), (refused,), (dict(busy=True),)):
        reason, unanswered = verdict(*answers)
        assert "answered its challenge" in reason and unanswered, answers


def server(epoch, tensors, refusal=None, sharing=True):
    """What the state service answers: the state it serves (its epoch and parameters), as a download gets it."""
    return ChallengeAnswers(state=lambda: None if epoch is None else (epoch, list(tensors)), sharing=lambda: sharing,
                            refusal=lambda caller: _value(refusal))


async def _value(value):
    return value


@pytest.mark.parametrize("key", [None, "a swarm key"])
def test_a_peer_answers_for_the_parameters_it_serves_at_the_epoch_it_serves(key):
    request = dict(seed=11, epoch=5, vectors=4)
    answer = asyncio.run(server(5, PARAMS).answer(request, b"caller"))
    assert answer == dict(epoch=5, projection=projection(PARAMS, 11).values)
    assert asyncio.run(server(6, PARAMS).answer(request, b"caller")) == dict(epoch=6)  # moved on: no projection
    assert "refused" in asyncio.run(server(5, PARAMS).answer(dict(request, vectors=99), b"caller"))
    assert "refused" in asyncio.run(server(5, PARAMS).answer(dict(request, seed=-1), b"caller"))
    outsider = asyncio.run(server(5, PARAMS, refusal="it stored no member token" if key else None)
                         .answer(request, b"caller"))
    assert outsider == (dict(refused="it stored no member token") if key else answer)


def test_a_peer_that_does_not_share_its_state_or_is_mid_boundary_answers_none_at_once():
    """A DiLoCo round in flight pauses sharing: no projection; mid-boundary the host gives no copy (None) rather than
    wait for the boundary: the answer names no epoch."""
    request = dict(seed=11, epoch=5, vectors=4)
    paused = server(5, PARAMS, sharing=False)
    assert "projection" not in asyncio.run(paused.answer(request, b"caller"))
    assert asyncio.run(server(None, PARAMS).answer(request, b"caller")) == dict(epoch=None)


def test_one_challenge_at_a_time_per_caller():
    """A caller that keeps a challenge open holds no second one (others are answered): one hostile member cannot
    fill an honest peer's slots."""
    release = threading.Event()

    def slow_copy():  # (the state's copy, blocking, in the service's executor)
        release.wait(5.0)
        return 5, list(PARAMS)

    avg = ChallengeAnswers(state=slow_copy, sharing=lambda: True, refusal=lambda caller: _value(None))
    request = dict(seed=11, epoch=5, vectors=4)

    async def run():
        first = asyncio.create_task(avg.answer(request, b"hostile"))
        await asyncio.sleep(0.01)
        second = await asyncio.wait_for(avg.answer(request, b"hostile"), 2.0)  # (at once)
        other = asyncio.create_task(avg.answer(request, b"honest"))
        await asyncio.sleep(0.01)
        release.set()
        return await first, second, await other

    first, second, other = asyncio.run(run())
    assert second == dict(busy=True) and "projection" in first and "projection" in other
    assert avg._challengers == set()


def test_the_host_copies_only_the_served_parameters_and_never_waits_for_a_boundary():
    import time

    from collabopt.engine.state import ConsistentStateAverager

    avg = ConsistentStateAverager.__new__(ConsistentStateAverager)
    boundary = threading.Event()
    vars(avg).update(_parent_pid=-1, _no_boundary=boundary, lock_optimizer=threading.Lock(),
                     lock_averaged_tensors=threading.Lock(),
                     _label_lock=threading.Lock(), _epoch=6, _steps_owed=1,
                     optimizer=SimpleNamespace(param_groups=[dict(params=PARAMS)]))
    started = time.monotonic()
    assert avg.challenge_state() is None and time.monotonic() - started < 0.5  # mid-boundary: at once
    boundary.set()
    epoch, tensors = avg.challenge_state()
    assert epoch == 5 and all(torch.equal(a, b) for a, b in zip(tensors, PARAMS, strict=True))
    assert tensors[0].data_ptr() != PARAMS[0].data_ptr()  # (a copy)


def test_the_downloaders_wait_grows_with_the_parameters():
    assert challenge_timeout(0) == 15.0 and challenge_timeout(100_000_000) == pytest.approx(20.0)
