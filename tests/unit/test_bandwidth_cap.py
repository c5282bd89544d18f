"""collabopt.engine.robust_averaging.cap_bandwidths before hivemind's real load_balance_peers: a member's bandwidth
claim no longer makes it the reducer of the whole vector, and every member computes the same shares."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine.robust_averaging import cap_bandwidths, cap_gathered_bandwidths

SIZE = 10**6


def test_a_claim_of_1e9_gets_the_share_of_a_member_at_the_median():
    assert load_balance_peers(SIZE, [100, 100, 100, 1e9]) == (0, 0, 0, SIZE)  # (why: hivemind alone)
    assert cap_bandwidths([100, 100, 100, 1e9]) == [100, 100, 100, 100]
    shares = load_balance_peers(SIZE, cap_bandwidths([100, 100, 100, 1e9]))
    assert max(shares) - min(shares) <= 1 and sum(shares) == SIZE
    # honest members of different bandwidths: the claim gets what the median-or-faster members get, at most 2/n
    for honest in ([50, 100, 200], [10, 100, 1000, 1000, 30, 70, 500]):
        shares = load_balance_peers(SIZE, cap_bandwidths([*honest, 1e9]))
        assert shares[-1] <= max(shares[:-1]) + 1
        assert shares[-1] <= 2 * SIZE / (len(honest) + 1)
    # hivemind alone gave it 61% of the vector in a group of 4
    assert load_balance_peers(SIZE, [50, 100, 200, 1e9])[-1] > 0.6 * SIZE


def test_every_member_computes_the_same_shares_from_the_same_gathered_claims():
    """Each member reads the group's claims from the same gathered bytes (msgpack, as hivemind's matchmaking sends
    them) and applies the cap on its own: same list in, same shares out, whichever member computes them."""
    claims = [120.5, None, 0.0, 1e9, 80.0, 95.0]
    gathered = [MSGPackSerializer.dumps([claim, 0, b""]) for claim in claims]
    views = [[MSGPackSerializer.loads(item)[0] for item in gathered] for _member in range(len(claims))]
    shares = {load_balance_peers(SIZE, cap_bandwidths(view)) for view in views}
    assert len(shares) == 1
    (only,) = shares
    assert only[2] == 0  # (a client: no share)
    assert only[3] <= 2 * SIZE / len(claims)


def test_zeros_and_none_stay_and_malformed_claims_get_no_share():
    assert cap_bandwidths([0.0, None, 100.0, 300.0, 200.0]) == [0.0, None, 100.0, 200.0, 200.0]
    capped = cap_bandwidths([-5.0, math.nan, "fast", True, 100.0, 100.0, math.inf])
    assert capped == [0.0, 0.0, 0.0, 0.0, 100.0, 100.0, 100.0]
    assert load_balance_peers(SIZE, capped)[:4] == (0, 0, 0, 0)  # (hivemind's would fail on -5 or NaN)
    assert cap_bandwidths([math.inf, math.inf, 10.0]) == [10.0, 10.0, 10.0]  # (a majority of infinite claims)
    assert cap_bandwidths([0.0, None]) == [0.0, None]
    assert cap_bandwidths([100.0, 100.0, 300.0], factor=2.0) == [100.0, 100.0, 200.0]
    with pytest.raises(ValueError, match="factor"):
        cap_bandwidths([1.0], factor=0.5)


class _Averager:
    """What hivemind's DecentralizedAverager._aggregate_with_group reads of its averager: it is run as is, on this,
    and the shares it computes are kept instead of running an all-reduce."""

    serializer = MSGPackSerializer
    total_size = SIZE

    def __init__(self):
        self.shares = None

    @contextlib.contextmanager
    def get_tensors(self):
        yield []

    async def _run_allreduce_inplace_(self, tensors, group_info, *, peer_fractions, **kwargs):
        self.shares = peer_fractions


def hiveminds_shares(gathered: tuple[bytes, ...]) -> tuple[tuple[int, ...], dict]:
    """The shares hivemind 1.1.12's own ``_aggregate_with_group`` gives the group, and the metadata it returns."""
    averager = _Averager()
    group = GroupInfo(b"group", tuple(PeerID(f"peer{i}".encode()) for i in range(len(gathered))), gathered)
    metadata = asyncio.run(DecentralizedAverager._aggregate_with_group(averager, group, min_vector_size=0))
    return averager.shares, metadata


def test_capped_gathered_data_gives_hiveminds_own_load_balancing_bounded_shares():
    """A node claims 1e9, a client claims 1e9 (hivemind gives clients no share, but its claim must not move the
    median either); every member's metadata comes through as it was."""
    claims = [(100.0, AveragingMode.NODE), (1e9, AveragingMode.CLIENT), (80.0, AveragingMode.NODE),
              (1e9, AveragingMode.NODE), (None, AveragingMode.NODE), (120, AveragingMode.NODE)]
    gathered = tuple(MSGPackSerializer.dumps([bandwidth, mode.value, MSGPackSerializer.dumps({"member": i})])
                     for i, (bandwidth, mode) in enumerate(claims))
    before, _ = hiveminds_shares(gathered)
    # (why: hivemind gives the claim 45%, and as much to the member that set no bandwidth, which it gives the mean)
    assert before[3] > 0.4 * SIZE and before[4] > 0.4 * SIZE
    capped = cap_gathered_bandwidths(gathered)
    # (the median of 100, 80, 1e9, 120: the client's claim left out, or it would be 120)
    assert [MSGPackSerializer.loads(data)[0] for data in capped] == [100.0, 0.0, 80.0, 110.0, None, 110.0]
    assert [data is old for data, old in zip(capped, gathered, strict=True)] == [True, False, True, False, True, False]
    shares, metadata = hiveminds_shares(capped)
    assert shares[1] == 0 and sum(shares) == SIZE
    assert shares[3] <= max(shares[i] for i in (0, 2, 4, 5)) + 1 and shares[3] <= 2 * SIZE / len(claims)
    assert shares[4] <= 2 * SIZE / len(claims)
    assert [metadata[PeerID(f"peer{i}".encode())] for i in range(len(claims))] == [
        {"member": i} for i in range(len(claims))]
    # the same gathered bytes give the same shares wherever they are computed
    assert cap_gathered_bandwidths(gathered) == capped and hiveminds_shares(capped)[0] == shares
    # data it cannot read stays as it was
    for junk in ((b"\xc1",), (MSGPackSerializer.dumps([1.0, 0]),), (MSGPackSerializer.dumps([1.0, 7, b""]),)):
        assert cap_gathered_bandwidths(junk) == junk
