"""collabopt's all-gather exchange (collabopt.engine.gather_exchange) among real OS processes on loopback: every
member applies the same ordered set of whole payloads; a member that sends different payloads to different members
is excluded by all the others; a member killed mid-exchange leaves the others with one set, or with none applied."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest
from gather_worker import payload_of
from helpers import Process, child_env, unique_run_id

pytestmark = pytest.mark.swarm
WORKER = Path(__file__).resolve().parent / "gather_worker.py"
SIZE = 100_000


def run_members(tmp_path, bootstrap, roles, dying=()):
    """Start one worker a role (seed = its index), wait for all; those in ``dying`` must die, the others exit 0.
    Returns the records of the members that finished, by name, and each member's seed by peer id."""
    run_id = unique_run_id("gather")
    procs = {}
    for i, role in enumerate(roles):
        cfg = dict(run_id=run_id, group_size=len(roles), seed=i, size=SIZE, weight=float(i + 1), role=role,
                   out=str(tmp_path / f"m{i}"))
        path = tmp_path / f"m{i}.config.json"
        path.write_text(json.dumps(cfg))
        procs[f"m{i}"] = Process([sys.executable, str(WORKER), str(path)], tmp_path / f"m{i}.log",
                                 env=child_env(INITIAL_PEERS=bootstrap))
    try:
        codes = {name: proc.wait(90.0) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill_tree()
    for name, code in codes.items():
        ok = code != 0 if name in dying else code == 0
        assert ok, f"{name} exited with {code}:\n{procs[name].log()[-5000:]}"
    records = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in procs if name not in dying}
    return records


def check_payloads(record, seeds):
    """Every contribution of an applied set holds the exact bytes and weight its sender sent."""
    for peer, encoded, weight in record["applied_set"]:
        seed = seeds[peer]
        assert base64.b64decode(encoded) == payload_of(seed, SIZE), f"payload of seed {seed} differs"
        assert weight == float(seed + 1)


def test_three_members_apply_the_same_ordered_set_of_every_payload(tmp_path, bootstrap):
    records = run_members(tmp_path, bootstrap, ["honest"] * 3)
    seeds = {r["me"]: r["gathered"][r["me"]]["seed"] for r in records.values()}
    group = records["m0"]["group"]
    assert sorted(group) == sorted(seeds)
    for name, record in records.items():
        assert record["applied"], f"{name}: {record['error']}"
        assert record["group"] == group and record["excluded"] == []
        assert [peer for peer, _, _ in record["applied_set"]] == group  # (the group's order)
        assert record["applied_set"] == records["m0"]["applied_set"]
        check_payloads(record, seeds)
    print("bytes sent per member:", [r["sent_bytes"] for r in records.values()],
          "received:", [r["received_bytes"] for r in records.values()],
          "round seconds:", [round(r["round_seconds"], 3) for r in records.values()])


def test_a_member_that_sends_two_payloads_is_excluded_by_all_honest_members(tmp_path, bootstrap):
    records = run_members(tmp_path, bootstrap, ["honest", "honest", "equivocate"])
    cheat = records["m2"]["me"]
    honest = [records["m0"], records["m1"]]
    seeds = {r["me"]: r["gathered"][r["me"]]["seed"] for r in records.values()}
    for record in honest:
        assert record["applied"], record["error"]
        assert record["excluded"] == [cheat]
        assert sorted(peer for peer, _, _ in record["applied_set"]) == sorted(r["me"] for r in honest)
        check_payloads(record, seeds)
    assert honest[0]["applied_set"] == honest[1]["applied_set"]
    assert not records["m2"]["applied"]  # (it sees its own two statements too)


def test_a_member_killed_mid_exchange_leaves_the_others_one_set_or_none(tmp_path, bootstrap):
    records = run_members(tmp_path, bootstrap, ["honest", "honest", "victim"], dying=("m2",))
    survivors = [records["m0"], records["m1"]]
    seeds = {r["me"]: r["gathered"][r["me"]]["seed"] for r in survivors}
    victim = next(peer for peer in survivors[0]["group"] if peer not in seeds)
    seeds[victim] = 2
    applied = [record for record in survivors if record["applied"]]
    for record in applied:
        check_payloads(record, seeds)
    assert len({json.dumps(record["applied_set"]) for record in applied}) <= 1
    # the victim's payload reached one survivor only: the other fetched it, and both applied all three
    assert len(applied) == 2, [record["error"] for record in survivors]
    assert sorted(peer for peer, _, _ in applied[0]["applied_set"]) == sorted(survivors[0]["group"])
