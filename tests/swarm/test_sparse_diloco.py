"""Compressed DiLoCo (``pseudo_gradient_compression=SparseLoCo(...)``) on real swarms: peers are OS processes
(diloco_worker.py) on loopback, each compressing its pseudo-gradient with error feedback, all-gathering the payloads
(collabopt.engine.gather_exchange) and aggregating them itself.

What is checked: every member of every round applies the bit-identical aggregate (the parameters after each round
are equal exactly, not within a tolerance; apart between rounds), also the member that was not one of the round's
contributors (``max_contributors``); a peer restarted from its checkpoint gets its
error-feedback buffer back exactly, and a late joiner starts from the swarm's anchor with a zero error-feedback buffer,
both in one swarm: each applies the same rounds as the others, equal to them exactly; a member
SIGKILLed after its offer reached one member leaves the others one aggregate (both apply it, the same bits)."""

from __future__ import annotations

import itertools
import json
import signal
import time

import pytest
import torch
from helpers import finish, finish_line, read_params, read_result, unique_run_id
from test_diloco import diff, log_tail, peers, rounds_by_epoch, run_swarm, start

pytestmark = pytest.mark.swarm
SPARSE = dict(density=0.05, chunk_size=256, bits=2, error_decay=0.95)
OUTER = dict(lr=1.0)  # SparseLoCo's outer step: SGD without momentum (SparseLoCo.outer_optimizer())


def test_three_peers_apply_bit_identical_aggregates_in_every_round(tmp_path, bootstrap):
    """max_contributors=2: in each round two members, chosen by the round, send their payloads and the third keeps
    its pseudo-gradient in its error feedback; all three apply the same aggregate."""
    names = {"a": [8], "b": [16], "c": [24]}
    configs = peers(unique_run_id("sparse3"), names, epochs=3, sparse=dict(SPARSE, max_contributors=2), outer=OUTER)
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in names if n != name))
    results, params = run_swarm(tmp_path, bootstrap, configs)

    why = ({n: results[n]["rounds"] for n in names}, {n: log_tail(tmp_path, n) for n in names})
    for epoch in range(1, 4):
        rounds = {name: rounds_by_epoch(results[name]).get(epoch, {}) for name in names}
        assert all(rounds[n].get("applied") and rounds[n]["group_size"] == 3 for n in names), (epoch, why)
        waiting = [n for n in names if "not one of this round's contributors" in rounds[n]["detail"]]
        assert len(waiting) == 1 and rounds[waiting[0]]["weight"] > 0, (epoch, why)  # (its samples count)
        after = {name: params[name]["after"][epoch] for name in names}
        before = {name: params[name]["before"][epoch] for name in names}
        for x, y in itertools.combinations(names, 2):
            assert diff(after[x], after[y]) == 0.0, (epoch, x, y)  # the same bits: each aggregated alone
            assert diff(before[x], before[y]) > 1e-3, (epoch, x, y)  # local steps between rounds
        previous = params["a"]["after"].get(epoch - 1, params["a"]["start"])
        assert diff(after["a"], previous) > 1e-3  # the round moved the parameters
    for name in names:
        assert results[name]["resyncs"] == 0, (name, why)
        assert results[name]["final_loss"] < results[name]["start_loss"]
        sent, received = results[name]["exchange_bytes"]
        assert sent > 0 and received > 0
    print("exchange bytes (sent, received) per peer:", {n: results[n]["exchange_bytes"] for n in names},
          "samples fed:", {n: results[n]["samples_fed"] for n in names})


def progress(tmp_path, name: str) -> int:
    try:
        return json.loads((tmp_path / f"{name}.progress").read_text())["epoch"]
    except (OSError, ValueError):
        return -1


def wait_until(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)


def test_overlapped_rounds_land_on_bit_identical_anchors(tmp_path, bootstrap):
    """overlap_rounds=True: each round's exchange runs while inner steps go on; the anchors the peers land on are the
    same bits, and the parameters after a landing are that anchor plus the progress made meanwhile."""
    names = {"a": [8, 40], "b": [16]}
    configs = peers(unique_run_id("sparse_overlap"), names, epochs=3, sparse=SPARSE, outer=OUTER, overlap=True)
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in names if n != name))
    results, params = run_swarm(tmp_path, bootstrap, configs)

    why = ({n: results[n]["rounds"] for n in names}, {n: log_tail(tmp_path, n) for n in names})
    for k in (1, 2):  # the k-th round landed (it started at epoch k)
        assert all(k in params[n]["landed"] for n in names), why
        assert diff(params["a"]["landed"][k]["anchor"], params["b"]["landed"][k]["anchor"]) == 0.0, k
        for name in names:
            land = params[name]["landed"][k]
            kept = {key: land["anchor"][key] + land["before"][key] - params[name]["base"][k][key]
                    for key in land["anchor"]}
            assert diff(land["after"], kept) <= 1e-6, (k, name)
    assert all(results[n]["rounds_failed"] == 0 for n in names), why


def test_a_restarted_peer_gets_its_error_feedback_back_and_a_late_joiner_starts_from_the_anchor_both_in_sync(
        tmp_path, bootstrap):
    """A saves a checkpoint (optimizer state with its error-feedback buffer, and its parameters) after its first
    round and leaves; while B and C train on, a new process A2 starts from that checkpoint and a late joiner D (a
    zero error-feedback buffer) joins. A2's buffer right after loading is the saved one, bit for bit; D starts from
    the swarm's anchor; each then applies rounds with B and C, equal to them exactly. (One swarm for both: the late
    joiner's swarm of its own cost the suite 12 s.)"""
    names = {"a": [8], "b": [16], "c": [24]}
    configs = peers(unique_run_id("sparse_resume"), names, epochs=0, epochs_file=str(tmp_path / "epochs"),
                    sparse=SPARSE, outer=OUTER)
    configs["a"]["checkpoint_epoch"] = 1
    for name in "bc":
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in ("a2", "b", "c", "d") if n != name))
    procs = {name: start(tmp_path, name, config, bootstrap) for name, config in configs.items()}
    assert procs["a"].wait(90) == 0, procs["a"].log()[-4000:]
    procs["a2"] = start(tmp_path, "a2", dict(configs["a"], checkpoint_epoch=None, wait_peers=None,
                                             resume_from=str(tmp_path / "a.ckpt"),
                                             finish_with=finish_line(tmp_path, "b", "c", "d")), bootstrap)
    procs["d"] = start(tmp_path, "d", dict(configs["b"], batch_sizes=[12], seed=3, wait_peers=None,
                                           finish_with=finish_line(tmp_path, "a2", "b", "c")), bootstrap)
    # (after a download: one that lands as B and C start the next round leaves its peer out of it, at weight 0; or
    # it brings an epoch the swarm has left, epochs lasting ~0.4 s: the peer downloads again before it joins one)
    wait_until(lambda: progress(tmp_path, "a2") >= 2 and progress(tmp_path, "d") >= 2)
    (tmp_path / "epochs").write_text(str(max(progress(tmp_path, n) for n in ("a2", "b", "c", "d")) + 4))
    finish(procs, timeout=120)
    results = {name: read_result(tmp_path, name) for name in procs}
    params = {name: read_params(tmp_path, name) for name in procs}

    saved = torch.load(tmp_path / "a.ckpt")["error_feedback"]
    assert sum(float(b.abs().sum()) for b in saved) > 0  # a round left something in it
    loaded = params["a2"]["loaded_error_feedback"]
    assert all(torch.equal(s, x) for s, x in zip(saved, loaded, strict=True))
    why = ({n: results[n]["rounds"] for n in procs}, {n: log_tail(tmp_path, n) for n in procs})
    assert results["a2"]["start_epoch"] == 1, why  # the checkpoint's epoch
    late = results["d"]
    assert late["start_epoch"] >= 1, why  # downloaded the swarm's state before its first step
    assert diff(params["d"]["start"], params["b"]["after"][late["start_epoch"]]) == 0.0
    for joiner in ("a2", "d"):  # rounds of 3 or 4 members that one or both joiners applied
        applied = [r for r in results[joiner]["rounds"] if r["applied"] and r["group_size"] >= 3]
        with_both = 0
        for r in applied:  # every server that applied a round of that size at that epoch holds the same bits
            # (among 4 peers, two groups of 3 or more cannot both form in one epoch: it is this round)
            same = [name for name in "bc" if (rounds_by_epoch(results[name]).get(r["epoch"]) or {}).get("applied")
                    and rounds_by_epoch(results[name])[r["epoch"]]["group_size"] == r["group_size"]]
            for name in same:
                assert diff(params[joiner]["after"][r["epoch"]], params[name]["after"][r["epoch"]]) == 0.0, \
                    (joiner, r["epoch"], name)
            with_both += same == ["b", "c"]
        assert with_both, (joiner, why)  # at least one round with B and C both


def test_a_member_killed_mid_exchange_leaves_the_others_one_aggregate(tmp_path, bootstrap):
    """X sends its offer of its second exchange to one member only and is SIGKILLed: A and B, the others, both apply
    that round (X's payload fetched from the member that holds it) with the same bits, then go on as two."""
    names = {"a": [8], "b": [16], "x": [24]}
    configs = peers(unique_run_id("sparse_kill"), names, epochs=4, sparse=SPARSE, outer=OUTER)
    configs["x"]["kill_in_exchange"] = 2
    for name in "ab":
        configs[name]["finish_with"] = finish_line(tmp_path, "b" if name == "a" else "a")
    procs = {name: start(tmp_path, name, config, bootstrap) for name, config in configs.items()}
    killed = procs.pop("x")
    try:
        code = killed.wait(90)
    finally:
        killed.kill_tree()
    assert code == -signal.SIGKILL and "fault injection" in killed.log(), (code, killed.log()[-3000:])
    finish(procs, timeout=120)
    results = {name: read_result(tmp_path, name) for name in procs}
    params = {name: read_params(tmp_path, name) for name in procs}

    why = ({n: results[n]["rounds"] for n in procs}, {n: log_tail(tmp_path, n) for n in procs})
    rounds = {name: rounds_by_epoch(results[name]) for name in procs}
    for epoch in (1, 2):  # the second: X killed in it
        assert all(rounds[n][epoch]["applied"] and rounds[n][epoch]["group_size"] == 3 for n in "ab"), (epoch, why)
        assert diff(params["a"]["after"][epoch], params["b"]["after"][epoch]) == 0.0, epoch
    later = [e for e in rounds["a"] if e > 2 and rounds["a"][e]["applied"] and rounds["b"].get(e, {}).get("applied")]
    assert later, why
    for epoch in later:
        assert diff(params["a"]["after"][epoch], params["b"]["after"][epoch]) == 0.0, epoch
