"""The figures of benchmarks/sparse_quality.py (compressed pseudo-gradients against fp16 DiLoCo), from canned runs
and one tiny run on a synthetic text: seconds, no swarm."""

from __future__ import annotations

import pytest
import torch

from benchmarks import sparse_quality
from collabopt.diloco_options import SparseLoCo


def test_variant_names_give_the_compression_and_the_outer_step():
    assert sparse_quality.parse_variant("fp16") == dict(compression=None, outer=sparse_quality.FP16_OUTER)
    assert sparse_quality.parse_variant("fp16-sgd1.5") == dict(compression=None, outer=dict(lr=1.5))
    sgd = sparse_quality.parse_variant("d0.02-b2-e0.95-sgd1.0")
    assert sgd == dict(compression=SparseLoCo(density=0.02, bits=2, error_decay=0.95), outer=dict(lr=1.0))
    nesterov = sparse_quality.parse_variant("d0.05-b4-e1.0-nest0.7")
    assert nesterov["compression"] == SparseLoCo(density=0.05, bits=4, error_decay=1.0)
    assert nesterov["outer"] == dict(lr=0.7, momentum=0.9, nesterov=True)
    assert sparse_quality.parse_variant("d0.02-b2-e0.95-sgd1.0-k4")["compression"].max_contributors == 4
    for bad in ("fp32", "fp16-sgd", "d0.02-b2-sgd1.0", "d0.02-b2-e0.95-sgd1.0-k"):
        with pytest.raises(SystemExit):
            sparse_quality.parse_variant(bad)


def test_the_fp16_mean_rounds_each_contribution_and_the_mean():
    small = 1e-4  # (below fp16's resolution at 1.0: each 1.0 + small rounds to 1.0)
    deltas = [[torch.tensor([1.0 + small, 2.0])], [torch.tensor([1.0 + small, 4.0])]]
    assert sparse_quality.fp16_mean(deltas)[0].tolist() == [1.0, 3.0]


def canned(variant, seed, losses, inner_steps=20, corpus="aaa", workers=4):
    return dict(variant=variant, inner_steps=inner_steps, rounds=len(losses), seed=seed, final_loss=losses[-1],
                losses=losses, bytes_per_param_round=2.0 if variant == "fp16" else 0.037, corpus=corpus,
                workers=workers)


def test_ratios_are_paired_by_corpus_and_seed_and_the_bound_needs_every_seed():
    runs = [canned("fp16", 0, [3.0, 2.0, 1.5, 1.0]), canned("fp16", 1, [3.0, 2.0, 1.5, 2.0]),
            canned("fp16", 2, [3.0, 2.0, 1.5, 1.0]),
            canned("sparse", 0, [3.0, 2.2, 1.5, 1.01]), canned("sparse", 1, [3.0, 1.8, 1.5, 2.06]),
            canned("sparse", 2, [3.0, 2.0, 1.5, 0.99]),
            canned("sparse", 0, [2.0, 1.0], inner_steps=100),  # (no fp16 run of that setting: no ratio)
            canned("fp16", 0, [3.0, 2.0, 1.5, 2.0], corpus="bbb"),
            canned("sparse", 0, [3.0, 2.0, 1.5, 1.0], corpus="bbb"),
            canned("sparse", 0, [3.0, 2.0, 1.5, 4.0], workers=16)]  # (no fp16 run of 16 workers: no ratio)
    summary = sparse_quality.summarize(runs)
    assert [r["ratios"] for r in summary if r["workers"] == 16] == [{}]  # (never paired with 4 workers' fp16)
    rows = {(r["corpus"], r["inner_steps"], r["variant"]): r for r in summary if r["workers"] == 4}
    assert rows[("bbb", 20, "sparse")]["ratios"] == {0: 0.5}  # (paired with fp16 of its own corpus only)
    rows = {(r["inner_steps"], r["variant"]): r for r in rows.values() if r["corpus"] == "aaa"}
    sparse = rows[(20, "sparse")]
    assert sparse["ratios"] == {0: 1.01, 1: 1.03, 2: 0.99}
    assert (sparse["ratio_median"], sparse["ratio_min"], sparse["ratio_max"]) == (1.01, 0.99, 1.03)
    assert sparse["half_ratio_median"] == 1.0  # after round 2: 1.1, 0.9, 1.0
    assert not sparse["meets_bound"]  # (seed 1 is over 1.02 though the median is not)
    assert rows[(20, "fp16")]["ratio_median"] == 1.0 and rows[(20, "fp16")]["meets_bound"]
    assert rows[(100, "sparse")]["ratio_median"] is None and not rows[(100, "sparse")]["meets_bound"]


def test_report_names_each_batchs_host_commit_command_corpus_and_every_row():
    runs = [canned("fp16", 0, [2.0, 1.0]), canned("d0.02-b2-e0.95-sgd1.0", 0, [2.0, 1.05])]
    machine = dict(host="h", cpu="cpu", cpus=2, date_utc="2026-01-01 00:00 UTC", load_avg_1m_at_start=2.5,
                   torch="2", git_commit="abc1234")
    batch = dict(machine=machine, dirty=["collabopt/x.py"], command="python -m benchmarks.sparse_quality --seeds 0",
                 corpus=dict(commit="def5678", chars=1000, sha256="aaa" + "0" * 61))
    text = sparse_quality.report(dict(batches=[batch], summary=sparse_quality.summarize(runs)))
    assert "`h`" in text and "load 2.5" in text and "`abc1234` plus uncommitted changes to collabopt/x.py" in text
    assert "`python -m benchmarks.sparse_quality --seeds 0`" in text
    assert "corpus `aaa000000000`: the Markdown of commit `def5678`, 1000 characters" in text
    assert "| aaa | 4 | 20 | 2 | d0.02-b2-e0.95-sgd1.0 | 0.037 | 1.0500 | 1.05 | 1.05..1.05 | 1.0 | no |" in text
    assert "| aaa | 4 | 20 | 2 | fp16 | 2.0 | 1.0000 | 1.0 | 1.0..1.0 | 1.0 | - |" in text


def test_a_tiny_run_pairs_the_initial_model_and_the_batches():
    ids = torch.randint(0, 8, (2000,), generator=torch.Generator().manual_seed(0))
    eval_x, eval_y = sparse_quality.windows(ids, 64, torch.Generator().manual_seed(1))
    data = dict(train=ids, eval_x=eval_x, eval_y=eval_y, vocab=8, corpus=dict(sha256="c" * 64))
    fp16 = sparse_quality.run("fp16", inner_steps=2, rounds=2, seed=0, data=data)
    again = sparse_quality.run("fp16", inner_steps=2, rounds=2, seed=0, data=data)
    other_seed = sparse_quality.run("fp16", inner_steps=2, rounds=2, seed=1, data=data)
    sparse = sparse_quality.run("d0.02-b2-e0.95-sgd1.0", inner_steps=2, rounds=2, seed=0, data=data)
    assert again["losses"] == fp16["losses"] and other_seed["losses"] != fp16["losses"]
    assert len(sparse["losses"]) == 2 and sparse["losses"] != fp16["losses"]
    assert fp16["union"] == [] and len(sparse["union"]) == 2 and all(0 < u <= 1 for u in sparse["union"])
    pair = sparse_quality.run("d0.02-b2-e0.95-sgd1.0", inner_steps=2, rounds=1, seed=0, data=data, workers=2)
    assert pair["workers"] == 2 and len(pair["union"]) == 1  # (the share of the aggregate's entries not zero)
    assert fp16["bytes_per_param_round"] == 2.0
    assert sparse["bytes_per_param_round"] < 0.2  # (a short last chunk: more than 0.025)
    # 4 workers, 2 contributors a round: half the payloads; the others keep their pseudo-gradient in their buffer
    bounded = sparse_quality.run("d0.02-b2-e0.95-sgd1.0-k2", inner_steps=2, rounds=2, seed=0, data=data)
    assert bounded["bytes_per_param_round"] == pytest.approx(sparse["bytes_per_param_round"] / 2, rel=0.05)
    assert bounded["losses"] != sparse["losses"]
