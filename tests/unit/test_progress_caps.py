"""No single member's progress record ends an epoch or moves the swarm ahead (issue 35, aggregation="centered_clip"):
collabopt.robust.cap_progress_claims, and the tracker that counts records through it. Each test shows hivemind's
count first (the claim works there), so it can fail."""

from __future__ import annotations

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration
from test_progress_fetch import parsing_tracker, record

from collabopt.robust import cap_progress_claims

ME = PeerID(b"me")


def claims(*entries: tuple[int, int, float]) -> dict:
    """Records of peers 0, 1, ...: (epoch, samples, samples/s), fresh."""
    found = {}
    for index, (epoch, samples, rate) in enumerate(entries):
        value = record(age=0.1, samples=samples, rate=rate, epoch=epoch)
        found[bytes([index])] = ValueWithExpiration(dict(value.value, peer_id=bytes([index])), value.expiration_time)
    return found


def tracker(cap: bool):
    parsing = parsing_tracker(epoch=3)
    parsing.dht.peer_id = ME
    parsing.cap_claims = cap
    return parsing


def test_a_claim_of_1000x_the_samples_does_not_end_the_epoch():
    records = claims((3, 40, 100.0), (3, 50, 100.0), (3, 60, 100.0), (3, 50_000, 100_000.0))
    hivemind_view = ProgressTracker._parse_swarm_progress_data(tracker(False), records)
    assert hivemind_view.samples_accumulated >= 512  # (target 512): one claim ends the epoch
    capped = tracker(True)._parse_swarm_progress_data(records)
    assert capped.samples_accumulated == 40 + 50 + 60 + 2 * 55  # the claim counts 2x the median (55)
    assert capped.epoch == 3 and capped.num_peers == 4
    # a claim made before the others report counts nothing (the median of 0, 0, 0, 50,000 is 0)
    early = claims((3, 0, 100.0), (3, 0, 100.0), (3, 0, 100.0), (3, 50_000, 100.0))
    assert tracker(True)._parse_swarm_progress_data(early).samples_accumulated == 0


def test_one_record_alone_does_not_move_the_swarm_ahead():
    records = claims((3, 40, 100.0), (3, 50, 100.0), (3, 60, 100.0), (1000, 10, 100.0))
    assert ProgressTracker._parse_swarm_progress_data(tracker(False), records).epoch == 1000
    capped = tracker(True)._parse_swarm_progress_data(records)
    assert (capped.epoch, capped.samples_accumulated, capped.num_peers) == (3, 150, 3)  # the record left out
    # half of the peers ahead (this peer at 3 counted once): the swarm is ahead, as with hivemind
    records = claims((3, 40, 100.0), (4, 50, 100.0), (4, 60, 100.0))
    assert tracker(True)._parse_swarm_progress_data(records).epoch == 4


def test_honest_alike_records_count_as_hivemind_counts_them():
    records = claims((3, 40, 100.0), (3, 70, 150.0), (3, 60, 120.0), (2, 30, 90.0))
    ours, theirs = (tracker(True)._parse_swarm_progress_data(records),
                    ProgressTracker._parse_swarm_progress_data(tracker(False), records))
    assert (ours.epoch, ours.samples_accumulated, ours.num_peers) == (theirs.epoch, theirs.samples_accumulated, 4)
    assert abs(ours.eta_next_epoch - theirs.eta_next_epoch) < 0.05


def test_cap_progress_claims_keeps_order_clients_and_types():
    records = [dict(peer_id=b"a", epoch=5, samples_accumulated=10, samples_per_second=1.0, client_mode=False),
               dict(peer_id=b"b", epoch=9, samples_accumulated=10, samples_per_second=1.0, client_mode=True),
               dict(peer_id=b"c", epoch=9, samples_accumulated=10, samples_per_second=1.0, client_mode=False),
               dict(peer_id=b"d", epoch=5, samples_accumulated=99, samples_per_second=9.0, client_mode=False),
               dict(peer_id=b"e", epoch=5, samples_accumulated=10, samples_per_second=1.0, client_mode=False)]
    kept = cap_progress_claims(records, local_epoch=5, own_peer_id=b"a")
    assert kept[2] is None  # one training peer of 4 at epoch 9 (this peer counted once, as its local epoch)
    assert kept[1]["epoch"] == 9  # a client's epoch never counts (hivemind's rule too); its record is kept
    assert kept[3]["samples_accumulated"] == 20 and type(kept[3]["samples_accumulated"]) is int
    assert kept[3]["samples_per_second"] == 2.0 and records[3]["samples_accumulated"] == 99  # copies
