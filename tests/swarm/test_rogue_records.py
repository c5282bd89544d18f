"""Rogue records: a process that writes garbage, oversized, unsigned, other-peer-signed or RSA-signed values under a
run's DHT keys while a 2-peer swarm trains and ``collabopt monitor --serve`` reads the run.

The rogue (``rogue_worker.py``) is a plain hivemind DHT node without validators, with keys of its own; it writes
straight through hivemind's DHT protocol to every node near the keys. Checked: the peers' DHT nodes refuse every
rogue record (each store answered False by their validators; an error or no answer fails the test); the peers keep
training together (two more global epochs after the rogue wrote, parameters equal) and never take the rogue's claims
for the swarm's (epoch 1,000,000, a third peer); the monitor shows exactly the two peers with their own epochs, and
counts each rogue record once, by reason, in ``/api/state`` and ``/metrics``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

from helpers import (
    HERE,
    SWARM_ROUNDING,
    Process,
    child_env,
    progress_epoch,
    start_bootstrap,
    unique_run_id,
    worst,
)
from monitor_helpers import prometheus, start_monitor, start_worker, trace, wait_files, wait_state

PEERS = ("a", "b")


def test_rogue_records_are_ignored_and_counted(tmp_path):
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    run_id = unique_run_id("rogue")
    procs: dict[str, Process] = {"bootstrap": bootstrap}
    try:
        procs["monitor"], url = start_monitor(tmp_path, run_id, initial_peers)
        for name in PEERS:
            procs[name] = start_worker(tmp_path, name, dict(
                run_id=run_id, target_batch_size=400, epochs=3, wait_peers=2, max_seconds=150,
                finish_with=[str(tmp_path / other) for other in PEERS if other != name],
                target_file=str(tmp_path / "target_epoch")), initial_peers)
        rogue_config = tmp_path / "rogue.config.json"
        rogue_config.write_text(json.dumps(dict(run_id=run_id, out=str(tmp_path / "rogue"), max_seconds=150)))
        procs["rogue"] = Process([sys.executable, str(HERE / "rogue_worker.py"), str(rogue_config)],
                                 tmp_path / "rogue.log", env=child_env(INITIAL_PEERS=initial_peers))

        # phase 1: the rogue's records under both keys, once the peers' own records are there
        wait_files([tmp_path / "rogue.json"], 90, procs)
        rogue = json.loads((tmp_path / "rogue.json").read_text())
        expected = Counter(f"{w['kind']}/{w['reason']}" for w in rogue["written"])
        assert sum(expected.values()) == 18
        wait_state(url, lambda s: s["rejected"]["by_kind"] == expected, 30, f"the monitor counting {expected}")
        # phase 2: a plain value where every peer keeps its own record
        (tmp_path / "rogue.phase2").touch()
        expected["progress/malformed"] += 1
        wait_state(url, lambda s: s["rejected"]["by_kind"] == expected, 30, "the plain value counted")
        # the peers train on, two more epochs with every rogue record in place
        (tmp_path / "target_epoch").write_text(str(max(progress_epoch(tmp_path, n) for n in PEERS) + 2))
        wait_files([tmp_path / f"{name}.done" for name in PEERS], 90, procs)
        rogue = json.loads((tmp_path / "rogue.json").read_text())  # now with what phase 2 wrote

        traces = {name: trace(tmp_path, name) for name in PEERS}
        finals = {name: traces[name][-1] for name in PEERS}
        state = wait_state(url, lambda s: sorted((p["id"], p["epoch"]) for p in s["peers"]) == sorted(
            (f["peer_id"], f["epoch"]) for f in finals.values()), 20, "the monitor showing the peers' own epochs")
        metrics = prometheus(url)
        for name in PEERS:
            (tmp_path / f"{name}.stop").touch()
        (tmp_path / "rogue.stop").touch()
        for name in PEERS:
            assert procs[name].wait(60) == 0, procs[name].log()[-4000:]
    finally:
        for proc in procs.values():
            proc.kill_tree()

    # the monitor: the two peers (no rogue row, no epoch 1,000,000), the rogue's records counted once each
    assert state["num_peers"] == 2 and state["peers_known"] == 2, state["peers"]
    assert state["global_epoch"] == max(f["epoch"] for f in finals.values())
    assert all(p["sync"] == "in sync" and p["reachability"] == "reachable" for p in state["peers"])
    assert state["rejected"]["by_kind"] == expected and state["rejected"]["total"] == 19
    counted = {dict(labels)["record"] + "/" + dict(labels)["reason"]: value
               for (name, labels), value in metrics.items() if name == "collabopt_rejected_records_total"}
    assert counted == expected
    assert metrics["collabopt_global_epoch", frozenset({("run_id", run_id)})] == state["global_epoch"]
    assert metrics["collabopt_peers", frozenset({("run_id", run_id)})] == 2

    # the peers' DHT nodes refused every rogue record, each with an answer (False: their validators rejected it), none
    # by an error or silence (only the bootstrap, which has no validators, kept them)
    peer_ids = {f["peer_id"] for f in finals.values()}
    assert peer_ids <= set(rogue["stores"]) and peer_ids <= set(rogue["phase2"]), "the rogue wrote to the peers' nodes"
    for phase, written in (("stores", 18), ("phase2", 1)):
        for node in peer_ids:
            counts = rogue[phase][node]
            assert counts == dict(accepted=0, refused=written, failed=[]), (phase, node, counts)

    # the peers: never misled (epoch, peer count), trained after the rogue wrote, in sync
    for name in PEERS:
        assert max(t["global_epoch"] for t in traces[name]) <= finals[name]["epoch"] + 1, name
        assert max(t["num_peers"] for t in traces[name]) <= 2, name
        after = [t["epoch"] for t in traces[name] if t["t"] > rogue["phase2_at"]]
        assert after and after[-1] - after[0] >= 2, (name, after[:3], after[-3:])
    results = [json.loads((tmp_path / f"{name}.json").read_text()) for name in PEERS]
    assert results[0]["final_epoch"] == results[1]["final_epoch"]
    diff = worst(abs(x - y) for p, q in zip(results[0]["params"], results[1]["params"], strict=True)
               for x, y in zip(p, q, strict=True))
    assert diff <= SWARM_ROUNDING, diff
