"""The figures of benchmarks/sparse_scale.py (compressed DiLoCo at 4, 8 and 16 peers), from canned peer records:
seconds, no swarm."""

from __future__ import annotations

import pytest

from benchmarks import sparse_reduce_scatter as rs
from benchmarks import sparse_scale
from collabopt.diloco_options import SparseLoCo


def record(n, group=None, sent=(1_000, 31_000), bodies=(0, 24_000), payload=4_000):
    """A peer's record (benchmarks.peer) with a window of 10 s holding 2 rounds (epochs 2 and 3) of groups of
    ``group`` (default all ``n``)."""
    group = n if group is None else group
    rounds = [dict(time=t, epoch=e, applied=True, reason="averaged", group_size=group, num_peers=n)
              for t, e in ((100.0, 1), (105.0, 2), (110.0, 3), (115.0, 4))]
    exchanges = [dict(time=t - 0.1, payload=payload, sent=12_000, received=12_000, group=group, union=0.06)
                 for t in (100.0, 105.0, 110.0, 115.0)]
    return dict(window=[100.0, 110.0], epochs=[(100.0, 1), (105.0, 2), (110.0, 3), (115.0, 4)], net_bytes=list(sent),
                exchange_bytes=list(bodies), exchanges=exchanges, rounds=rounds, grad_bytes=4 * 1_000_000)


def test_a_row_splits_what_the_interfaces_sent_into_the_exchange_and_control():
    row = sparse_scale.figures(4, [record(4), record(4, sent=(0, 40_000))])
    assert row["rounds"] == 2 and row["round_seconds"] == 5.0
    assert row["exchange_per_round"] == 12_000 and row["exchange_over_payloads"] == 1.0  # (3 payloads of 4,000)
    assert row["sent_per_round"] == (15_000 + 20_000) / 2
    assert row["control_per_round"] == row["sent_per_round"] - 12_000
    assert row["control_per_second"] == ((30_000 - 24_000) / 10 + (40_000 - 24_000) / 10) / 2
    assert row["total_at_b6_round"] == 12_000 + row["control_per_second"] * sparse_scale.B6_ROUND_SECONDS
    assert row["group_sizes"] == {"4": 4} and row["all_members"]  # (rounds at 105 and 110: inside the window)
    assert row["union_median"] == 0.06 and row["numel"] == 1_000_000


def test_at_sixteen_peers_the_payloads_are_counted_for_the_rounds_contributors():
    """SparseLoCo's max_contributors (8): a peer of 16 sends, on average, 8 x 15 / 16 payloads a round."""
    assert SparseLoCo().max_contributors == 8 and rs.contributors(4) == 4
    peers = [record(16, bodies=(0, 2 * 30_000)) for _ in range(2)]
    for e in peers[1]["exchanges"]:
        e["contributed"] = False
    row = sparse_scale.figures(16, peers)
    assert row["max_contributors"] == 8 and row["contributed_share"] == 0.5
    assert row["exchange_over_payloads"] == 30_000 / (8 * 15 / 16 * 4_000)


def test_a_round_of_fewer_members_is_reported():
    row = sparse_scale.figures(4, [record(4), record(4, group=3)])
    assert row["group_sizes"] == {"3": 2, "4": 2} and not row["all_members"]


def test_ratios_compare_rows_of_the_same_round_length_and_the_fit_recovers_a_line():
    rows = []
    for n, scale in ((4, 1.0), (8, 2.0)):
        for steps, seconds in ((40, 20.0), (100, 50.0)):
            control = scale * (100_000 + 2_000 * seconds)  # a = 100 kB a round, c = 2 kB/s (x2 at N = 8)
            rows.append(dict(peers=n, steps_per_round=steps, compute_seconds=0.5, round_seconds=seconds,
                             control_per_round=control,
                             exchange_per_round=scale * 300_000, total_at_b6_round=scale * (1e6 + 1e3 * steps),
                             total_at_b6_round_control_per_round=scale * 2e6))
    rows.append(dict(peers=16, steps_per_round=40, compute_seconds=0.5, error="boom"))
    rows.append(dict(rows[0], steps_per_round=400, compute_seconds=0.05, round_seconds=20.0,
                     control_per_round=900_000))  # (another setting: in no fit)
    sparse_scale.add_ratios(rows)
    eight = [r for r in rows if r["peers"] == 8]
    assert [r["total_at_b6_round_ratio_to_4"] for r in eight] == [pytest.approx(2.0)] * 2  # (own length's)
    fits = {f["peers"]: f for f in sparse_scale.control_fits(rows)}
    assert set(fits) == {4, 8}
    assert fits[4]["per_round"] == pytest.approx(100_000) and fits[4]["per_second"] == pytest.approx(2_000)
    assert fits[4]["total_at_b6_round"] == pytest.approx(300_000 + 100_000 + 2_000 * 116)
    assert fits[8]["ratio_to_4"] == pytest.approx(2.0)


def test_the_reduce_scatter_sends_its_slices_and_the_reduced_whole():
    numel, codec = 1_000_000, SparseLoCo().codec
    p = codec.payload_bytes(numel)
    same = rs.reduce_scatter_bytes(8, numel, union=0.02, bits=2)  # (a union no denser than a payload)
    assert same["all_gather"] == 7 * p and same["reduced_over_payload"] == 1.0
    assert same["reduce_scatter"] == pytest.approx(7 / 8 * 2 * p)
    denser = rs.reduce_scatter_bytes(8, numel, union=0.15, bits=8)
    assert denser["reduced_over_payload"] > 0.15 / 0.02  # (more entries, and 8 bits each instead of 2)
    assert rs.independent_union(1, 0.02) == pytest.approx(0.02)
    # 8 of 16 contributing: a contributor's slices and the reduced whole of their union, against 8 x 15 / 16 payloads
    bounded = rs.reduce_scatter_bytes(16, numel, union=0.02, bits=2, k=8)
    assert bounded["all_gather"] == pytest.approx(8 * 15 / 16 * p)
    assert bounded["reduce_scatter"] == pytest.approx(15 / 16 * (8 / 16 * p + p))
    n = rs.break_even(numel, 2, 0.02)
    assert n is not None
    for size in (n - 1, n):
        k = rs.contributors(size)
        b = rs.reduce_scatter_bytes(size, numel, rs.independent_union(k, 0.02), 2, k)
        assert (b["reduce_scatter"] < b["all_gather"]) == (size == n)
    assert rs.break_even(numel, 8, 0.02) is None  # (8 contributors at most: at 8 bits the all-gather stays cheaper)


def test_the_report_has_every_row_and_the_estimates():
    row = dict(sparse_scale.figures(4, [record(4), record(4)]), steps_per_round=40, compute_seconds=0.5,
               load_avg_at_start=1.5)
    result = dict(machine=dict(host="h", cpu="c", cpus=2, date_utc="d", torch="t", hivemind="hm", git_commit="abc"),
                  config=dict(sparse_scale.CONFIG, steps=[40]),
                  rows=[row, dict(peers=8, steps_per_round=40, compute_seconds=0.5, load_avg_at_start=2.0,
                             error="RuntimeError: x"),
                        dict(sparse_scale.figures(16, [record(16), record(16)]), steps_per_round=40,
                             compute_seconds=0.5, load_avg_at_start=3.0)],
                  unions=dict(settings=sparse_scale.CONFIG["union"], numel=1000, union={"4": [0.05, 0.07]}))
    sparse_scale.add_ratios(result["rows"])
    text = sparse_scale.markdown(result)
    assert "\n| 4 | 4 | 40 x 0.5 | 1.5 | 5.0 | 4.0 | 12 | 1.000 |" in text and "error: RuntimeError: x" in text
    assert "\n| 16 | 8 | 40 x 0.5 | 3.0 |" in text  # (K: 8 of 16 contribute)
    assert "\n| 4 | 4 | quality bed | 0.0700 | 2 |" in text and "\n| 4 | 4 | swarm | 0.0600 | 8 |" in text
    assert "Break-even group size" in text


def test_the_dht_split_is_per_peer_and_round_by_key():
    from benchmarks import dht_traffic

    def counts(progress):
        zero = {field: 0.0 for field in dht_traffic.FIELDS}
        return {cat: dict(zero, requests_sent=progress if cat == "progress" else 0.0,
                          responses_sent=progress / 2 if cat == "progress" else 0.0)
                for cat in dht_traffic.CATEGORIES}

    records = [dict(record(2), dht=[counts(0.0), counts(4_000.0)],
                    dht_calls=[{"get progress": 1}, {"get progress": 9}]) for _ in range(2)]
    split = sparse_scale.figures(2, records)
    assert split["dht_sent_per_round"]["progress"] == 3_000  # (6,000 bytes over 2 rounds, each peer)
    assert split["dht_sent_per_round"]["matchmaking"] == 0 and split["dht_calls_per_round"] == {"get progress": 4}
    assert "dht_sent_per_round" not in sparse_scale.figures(2, [record(2), record(2)])
