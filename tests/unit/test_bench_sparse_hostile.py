"""The figures of benchmarks/sparse_hostile.py (compressed DiLoCo with a hostile member), from canned peer records:
no swarm runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks import sparse_hostile


def test_only_the_hostile_peer_attacks_and_honest_peers_wait_for_the_honest_ones():
    configs = sparse_hostile.peer_configs(sparse_hostile.FULL, Path("/w"), "centered_clip", dict(scale=-20.0))
    assert [c["seed"] for c in configs.values()] == [0, 1, 2, 3]
    assert {name for name, c in configs.items() if "attack" in c} == {"p3"}
    assert configs["p0"]["finish_with"] == ["/w/p1", "/w/p2"]
    assert configs["p3"]["finish_with"] == ["/w/p0", "/w/p1", "/w/p2"]
    assert all(c["sparse"] == {} and c["aggregation"] == "centered_clip" for c in configs.values())
    clean = sparse_hostile.peer_configs(sparse_hostile.FULL, Path("/w"), "mean", None)
    assert clean["p0"]["finish_with"] == ["/w/p1", "/w/p2", "/w/p3"]
    # the same run but for the attack: same seeds, data, model, sizes
    kept = [{k: v for k, v in c.items() if k not in ("run_id", "aggregation", "attack", "finish_with")}
            for c in (*clean.values(), *configs.values())]
    assert kept[:4] == kept[4:]


def record(losses: dict[int, float], rounds: list[tuple[int, bool, int]]) -> dict:
    return dict(held_out_losses={str(e): v for e, v in losses.items()}, start_loss=1.5,
                rounds=[dict(epoch=e, applied=a, group_size=g) for e, a, g in rounds])


def test_measure_takes_the_last_common_epoch_up_to_the_target():
    same = {"w": torch.ones(3)}
    records = {"p0": record({1: 1.0, 2: 0.8, 3: 0.7}, [(1, True, 4), (2, True, 3), (3, True, 4)]),
               "p1": record({1: 1.0, 2: 0.8}, [(1, True, 4), (2, True, 3)]),  # (reached epoch 3 without a record)
               "p2": record({1: 1.0, 2: 0.8, 3: 0.7}, [(1, False, 4), (2, True, 3), (3, True, 4)])}
    params = {"p0": {2: same}, "p1": {2: {"w": torch.tensor([1.0, 1.0, 1.25])}}, "p2": {2: same}}
    figures = sparse_hostile.measure(records, params, target=3)
    assert figures["epoch"] == 2 and figures["loss"] == 0.8
    assert figures["max_param_diff"] == 0.25
    assert figures["rounds_applied"] == {"p0": 2, "p1": 2, "p2": 1}
    assert figures["rounds_of_4"] == {"p0": 1, "p1": 1, "p2": 0}
    records["p0"]["held_out_losses"]["2"] = math.nan  # a diverged peer
    assert sparse_hostile.measure(records, params, target=3)["loss"] == math.inf


def run(name: str, aggregation: str, attack: dict | None, loss: float, diff: float = 0.0) -> dict:
    return dict(name=name, aggregation=aggregation, attack=attack, loss=loss, max_param_diff=diff, epoch=8,
                rounds_applied={p: 8 for p in sparse_hostile.HONEST}, rounds_of_4={p: 8 for p in sparse_hostile.HONEST},
                seconds=40.0, start_loss=1.46)


def test_ratios_to_the_clean_run_and_each_aggregations_bound():
    scale = sparse_hostile.ATTACKS["times_minus_20"]
    runs = [run("clean", "mean", None, 0.5),
            run("times_minus_20_centered_clip", "centered_clip", scale, 0.54),
            run("times_minus_20_mean", "mean", scale, math.inf, diff=math.inf),
            run("noise_100x_centered_clip", "centered_clip", sparse_hostile.ATTACKS["noise_100x"], 0.56),
            run("clean_repeat", "mean", None, 0.51)]
    summary = sparse_hostile.summarize(runs)
    rows = {row["name"]: row for row in summary["rows"]}
    assert rows["times_minus_20_centered_clip"]["ratio"] == 0.54 / 0.5
    assert rows["times_minus_20_centered_clip"]["met"] and rows["times_minus_20_mean"]["met"]
    assert rows["noise_100x_centered_clip"]["attack"] == "noise_100x" and not rows["noise_100x_centered_clip"]["met"]
    assert not summary["all_met"] and summary["clean_repeat_ratio"] == 0.51 / 0.5
    assert summary["max_param_diff"] == math.inf


def test_report_names_host_commit_command_and_every_swarm():
    runs = [run("clean", "mean", None, 0.5),
            run("claim_1000x_mean", "mean", sparse_hostile.ATTACKS["claim_1000x"], 1.2)]
    machine = dict(host="h", cpu="cpu", cpus=2, date_utc="2026-01-01 00:00 UTC", load_avg_1m_at_start=2.5,
                   torch="2", hivemind="1", git_commit="abc1234")
    result = dict(command="python -m benchmarks.sparse_hostile", config=sparse_hostile.FULL, machine=machine,
                  dirty=["collabopt/x.py"], runs=runs, summary=sparse_hostile.summarize(runs))
    text = sparse_hostile.report(result)
    assert "`h`" in text and "load 2.5" in text and "`abc1234` plus uncommitted changes to collabopt/x.py" in text
    assert "| claim_1000x | mean | 8 | 1.2000 | 2.400 | yes |" in text
    assert "Every bound: met." in text


def test_replicas_compare_each_seed_with_its_clean_replica():
    scale = sparse_hostile.ATTACKS["times_minus_20"]
    replicas = [dict(seed=0, aggregation="mean", attack=None, loss=0.4, deviation=0.0, spread=1.5),
                dict(seed=1, aggregation="mean", attack=None, loss=0.5, deviation=0.0, spread=1.5),
                dict(seed=0, aggregation="centered_clip", attack=scale, loss=0.6, deviation=0.4, spread=1.4),
                dict(seed=1, aggregation="centered_clip", attack=scale, loss=0.8, deviation=0.5, spread=1.6)]
    (row,) = sparse_hostile.summarize_replicas(replicas)
    assert (row["attack"], row["aggregation"], row["seeds"]) == ("times_minus_20", "centered_clip", 2)
    assert [row["ratio_min"], row["ratio_median"], row["ratio_max"]] == pytest.approx([1.5, 1.55, 1.6])
    assert [row["deviation"], row["spread"]] == pytest.approx([0.45, 1.5])


def test_a_tiny_replica_runs_and_the_attack_moves_the_mean_away_from_the_honest_members():
    cfg = dict(sparse_hostile.FULL, epochs=1, inner_steps=2, batch=8)
    clean = sparse_hostile.replica(cfg, 0, "mean", None)
    attacked = sparse_hostile.replica(cfg, 0, "mean", sparse_hostile.ATTACKS["times_minus_20"])
    assert clean["deviation"] > 0 and attacked["deviation"] > clean["deviation"]  # (4 members against the 3 honest)
    assert math.isfinite(clean["loss"]) and clean["spread"] >= 1.0
