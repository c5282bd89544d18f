"""collabopt's own averaging service (collabopt.engine.averager) among real OS processes on loopback: every member
gets the same bits, equal to the exact weighted mean; centered_clip bounds a hostile member; a member killed
mid-round leaves the others with the same result, and their evidence names it; a member behind does not lead the
current round's members away from each other; two members find each other while a frozen one holds the DHT up."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from allreduce_worker import honest_inputs, inputs_of
from helpers import Process, child_env, unique_run_id

from collabopt.engine.part_reducer import weighted_mean

pytestmark = pytest.mark.swarm
WORKER = Path(__file__).resolve().parent / "allreduce_worker.py"


def start_members(tmp_path, bootstrap, configs):
    run_id = unique_run_id("allreduce")
    procs = {}
    for name, cfg in configs.items():
        path = tmp_path / f"{name}.config.json"
        path.write_text(json.dumps(dict(cfg, run_id=run_id, out=str(tmp_path / name))))
        procs[name] = Process([sys.executable, str(WORKER), str(path)], tmp_path / f"{name}.log",
                              env=child_env(INITIAL_PEERS=bootstrap))
    return procs


def go_when_ready(tmp_path, procs, timeout=90.0):
    """Once every member is ready (its DHT joined), give them a common t0 a moment ahead."""
    wait_for_every(tmp_path, procs, "ready", timeout)
    write_time(tmp_path / "go", time.time() + 0.5)


def wait_for_every(tmp_path, procs, suffix, timeout):
    """Wait until every member wrote ``<name>.<suffix>``; kill them all and fail with their logs if one exited first
    or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while not all((tmp_path / f"{name}.{suffix}").exists() for name in procs):
        if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs.values()):
            for proc in procs.values():
                proc.kill_tree()
            raise AssertionError({name: proc.log()[-2000:] for name, proc in procs.items()})
        time.sleep(0.1)


def write_time(path, wall_time):
    """Write ``wall_time`` into ``path`` whole (renamed into place: a member polling it never reads it half
    written)."""
    (path.parent / f"{path.name}.tmp").write_text(repr(wall_time))
    (path.parent / f"{path.name}.tmp").rename(path)


def finish(procs, timeout=120.0, dying=()):
    """Wait for every member; those in ``dying`` must have been killed, the others must have exited 0."""
    try:
        codes = {name: proc.wait(timeout) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill_tree()
    for name, code in codes.items():
        expected_ok = code != 0 if name in dying else code == 0
        assert expected_ok, f"{name} exited with {code}:\n{procs[name].log()[-5000:]}"


def read(tmp_path, name):
    record = json.loads((tmp_path / f"{name}.json").read_text())
    return record, torch.load(tmp_path / f"{name}.pt")


def flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


def test_every_member_gets_the_same_bits_of_the_exact_weighted_mean(tmp_path, bootstrap):
    configs = {f"m{i}": dict(group_size=3, seed=i, numel=200_000, weight=float(i + 1)) for i in range(3)}
    finish(start_members(tmp_path, bootstrap, configs))
    results = {name: read(tmp_path, name) for name in configs}
    ids = {results[name][0]["me"]: name for name in configs}
    group = results["m0"][0]["group"]
    assert sorted(group) == sorted(ids)
    order = [ids[peer] for peer in group]  # (the reducers add the senders' parts in the group's order)
    expected = [weighted_mean([results[name][1]["inputs"][k] for name in order],
                              [configs[name]["weight"] for name in order]) for k in range(2)]
    for name, (record, saved) in results.items():
        assert record["error"] is None and record["complete"] and record["received"] == 1.0, record
        assert record["group"] == group and record["missing"] == [] and record["absent"] == []
        for got, want in zip(saved["tensors"], expected, strict=True):
            assert torch.equal(got, want), f"{name}: {float((got - want).abs().max())} from the exact mean"


def test_centered_clip_bounds_a_hostile_member(tmp_path, bootstrap):
    roles = ["honest", "honest", "honest", "hostile"]
    configs = {f"m{i}": dict(group_size=4, seed=i, numel=100_000, aggregation="centered_clip", role=role)
               for i, role in enumerate(roles)}
    finish(start_members(tmp_path, bootstrap, configs))
    results = {name: read(tmp_path, name) for name in configs}
    honest_mean = weighted_mean([flat(honest_inputs(i, 100_000)) for i in range(3)], [1.0] * 3)
    plain_mean = weighted_mean([flat(inputs_of(cfg)) for cfg in configs.values()], [1.0] * 4)
    outputs = {name: flat(saved["tensors"]) for name, (_, saved) in results.items()}
    for name, (record, _) in results.items():
        assert record["complete"], record
        assert torch.equal(outputs[name], outputs["m0"]), f"{name} holds other bits than m0"
    moved, plain = float((outputs["m0"] - honest_mean).norm()), float((plain_mean - honest_mean).norm())
    assert moved < 0.05 * plain, f"the hostile member moved the result {moved:.3f} (a plain mean: {plain:.3f})"


def test_a_member_killed_mid_round_leaves_the_others_with_the_same_result(tmp_path, bootstrap):
    configs = {f"m{i}": dict(group_size=4, seed=i, numel=8_000_000, role="victim" if i == 3 else "honest",
                             kill_after=0.1, sender_timeout=5.0, reducer_timeout=10.0) for i in range(4)}
    finish(start_members(tmp_path, bootstrap, configs), dying=("m3",))
    survivors = {name: read(tmp_path, name) for name in ("m0", "m1", "m2")}
    records = [record for record, _ in survivors.values()]
    members = set(records[0]["group"])
    victim = (members - {record["me"] for record in records}).pop()
    missing = set()
    for record in records:
        assert record["error"] is None and record["group"] == records[0]["group"], record
        assert record["absent"] == [victim], record  # (named, as data: its results short or its values left out)
        assert not record["complete"]
        missing |= {tuple(r) for r in record["missing"]}
    outputs = [flat(saved["tensors"]) for _, saved in survivors.values()]
    keep = torch.ones_like(outputs[0], dtype=torch.bool)
    for start, stop in missing:
        keep[start:stop] = False
    assert keep.any()
    for values in outputs[1:]:  # the same bits wherever a result came (each part has one value in the group)
        assert torch.equal(values[keep], outputs[0][keep])
    for record, saved in survivors.values():  # and its own values where one did not
        for start, stop in record["missing"]:
            assert torch.equal(flat(saved["tensors"])[start:stop], flat(saved["inputs"])[start:stop])


def test_a_scheduled_round_averages_the_current_epochs_tensors_only(tmp_path, bootstrap):
    """Matchmaking runs ahead of the tensors; the tensors come at different times; a member at an older epoch (a
    stale joiner) and one that tags along add nothing to the average, yet all four get the same bits."""
    roles = {"m0": ("honest", 5, 0.0), "m1": ("honest", 5, 2.0), "m2": ("honest", 4, 0.5), "m3": ("tag_along", 5, 1.0)}
    configs = {name: dict(group_size=4, seed=i, numel=50_000, weight=float(i + 1), role=role, epoch=epoch,
                          trigger_after=after) for i, (name, (role, epoch, after)) in enumerate(roles.items())}
    finish(start_members(tmp_path, bootstrap, configs))
    results = {name: read(tmp_path, name) for name in configs}
    ids = {results[name][0]["me"]: name for name in configs}
    group = results["m0"][0]["group"]
    assert sorted(group) == sorted(ids)
    order = [ids[peer] for peer in group if ids[peer] in ("m0", "m1")]
    expected = [weighted_mean([results[name][1]["inputs"][k] for name in order],
                              [configs[name]["weight"] for name in order]) for k in range(2)]
    for name, (record, saved) in results.items():
        assert record["error"] is None and record["complete"] and record["received"] == 1.0, record
        assert record["gathered"][record["me"]] == {"epoch": configs[name]["epoch"]}
        for got, want in zip(saved["tensors"], expected, strict=True):
            assert torch.allclose(got, want, atol=1e-6), f"{name}: {float((got - want).abs().max())} from the mean"
        assert torch.equal(flat(saved["tensors"]), flat(results["m0"][1]["tensors"])), f"{name} holds other bits"


def test_a_member_behind_does_not_lead_the_current_rounds_members_apart(tmp_path, bootstrap):
    """c's round is of epoch 3 and was scheduled before the others' (e.g. while its link was down): it declares the
    earliest end of search (2 s), so a and b, at epoch 7, would each ask it first. a asks at once, b (whose round
    ends when a's does, at 4.5 s) 2.5 s in: c, were it to take a, would end its search with a alone before b came,
    and b would wait out its timeout. A leader takes no member of a later epoch (protocol.sync_admits): a and b
    average together (c, behind, may join them and adds nothing)."""
    go = str(tmp_path / "go")
    members = {"c": dict(epoch=3, start_after=0.0, timeout=8.0),
               "a": dict(epoch=7, start_after=0.5, scheduled_after=4.5),
               "b": dict(epoch=7, start_after=2.5, scheduled_after=4.5)}
    configs = {name: dict(cfg, group_size=None, min_group_size=2, matchmaking_time=2.0, seed=i, numel=1000, go=go,
                          timeout=cfg.get("timeout", 12.0)) for i, (name, cfg) in enumerate(members.items())}
    procs = start_members(tmp_path, bootstrap, configs)
    go_when_ready(tmp_path, procs)
    finish(procs)
    results = {name: read(tmp_path, name) for name in configs}
    ids = {results[name][0]["me"]: name for name in configs}
    a, b = results["a"][0], results["b"][0]
    assert a["error"] is None and b["error"] is None, (a, b, results["c"][0])
    assert a["group"] == b["group"] and {ids[peer] for peer in a["group"]} >= {"a", "b"}, (a, b)
    expected = weighted_mean([results[name][1]["inputs"][0] for name in ("a", "b")], [1.0, 1.0])
    for name in (ids[peer] for peer in a["group"]):
        assert torch.allclose(results[name][1]["tensors"][0], expected, atol=1e-6), name


SEARCH_WORKER = Path(__file__).resolve().parent / "search_worker.py"


def test_two_members_find_each_other_while_a_frozen_member_holds_the_dhts_lookups_up(tmp_path, bootstrap):
    """A, B and C meet in a round; then C freezes (SIGSTOP: its DHT node and daemon answer nothing, as behind a
    cut link, and every lookup of the round's key waits for it) and A and B begin their next round's search 3 s
    apart, as the product's gradient rounds do when one peer's progress fetch waited for C. They find each other
    as soon as B's search begins: B's round takes a ``matchmaking_time`` (2 s) plus at most a search's wait and a
    request (1 s each), and both get the same bits of their mean. (A search that waited out the held-up lookup
    before handing on the answers it got returned each a second late: A and B, re-declaring every 2 s an odd
    number of seconds apart, learned each other's declaration just as it ended, every time, and both rounds failed
    after 10 s.)"""
    run_id = unique_run_id("search")
    procs = {}
    for name, seed, start_after in (("a", 0, 0.0), ("b", 1, 3.0), ("c", 2, 0.0)):
        path = tmp_path / f"{name}.config.json"
        path.write_text(json.dumps(dict(run_id=run_id, seed=seed, start_after=start_after, out=str(tmp_path / name))))
        procs[name] = Process([sys.executable, str(SEARCH_WORKER), str(path)], tmp_path / f"{name}.log",
                              env=child_env(INITIAL_PEERS=bootstrap))
    try:
        meet(tmp_path, procs)
        os.killpg(procs["c"].pid, signal.SIGSTOP)  # (the process group: the worker and its p2p daemon)
        write_time(tmp_path / "go2", time.time() + 0.2)
        finish({name: procs[name] for name in ("a", "b")}, timeout=60)
    finally:
        for proc in procs.values():
            proc.kill_tree()
    (a, a_saved), (b, b_saved) = read(tmp_path, "a"), read(tmp_path, "b")
    assert a["error"] is None and b["error"] is None, (a, b)
    assert sorted(a["group"]) == sorted(b["group"]) == sorted([a["me"], b["me"]])
    assert b["seconds"] <= 2.0 + 1.0 + 1.0, b  # (matchmaking_time, a search's LOOKUP_WAIT and request_timeout)
    order = {a["me"]: a_saved, b["me"]: b_saved}
    expected = [weighted_mean([order[peer]["inputs"][k] for peer in a["group"]], [1.0, 1.0]) for k in range(2)]
    for saved in (a_saved, b_saved):
        for got, want in zip(saved["tensors"], expected, strict=True):
            assert torch.equal(got, want)


def meet(tmp_path, procs, attempts=5):
    """Once every search worker is ready, have them average until one meeting had all of them (a group of fewer
    leaves a member that never met the others)."""
    wait_for_every(tmp_path, procs, "ready", 90.0)
    for meeting in range(1, attempts + 1):
        write_time(tmp_path / f"go.{meeting}", time.time() + 0.5)
        wait_for_every(tmp_path, procs, f"met.{meeting}", 30.0)
        if all((tmp_path / f"{name}.met.{meeting}").read_text() == str(len(procs)) for name in procs):
            return
    raise AssertionError(f"the members never met all at once in {attempts} meetings")
