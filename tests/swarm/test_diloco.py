"""DiLoCo mode (``outer_optimizer=``) on real swarms: peers are OS processes (diloco_worker.py, and the Accelerate
and Lightning workers) on loopback.

What is checked: after every round all peers hold the same parameters and between rounds they differ; one run's
rounds are the DiLoCo update computed by plain torch from the parameters the peers recorded; a peer whose round
failed keeps its local progress, re-synchronizes by state download and is equal to the others at the next round;
every adapter: plain loops (collaborate), an Accelerate 2-rank node beside a plain peer, 2 Lightning Trainers.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from helpers import Process, child_env, finish, finish_line, read_params, read_result, unique_run_id

from collabopt.metrics import DILOCO_PUBLISH_INTERVAL

pytestmark = pytest.mark.swarm
WORKER = Path(__file__).resolve().parent / "diloco_worker.py"
EQUAL = 1e-6  # the bound; every peer of a round receives the same averaged values


def start(tmp_path: Path, name: str, config: dict, initial_peers: str) -> Process:
    import json

    config = dict(config, out=str(tmp_path / name))
    path = tmp_path / f"{name}.config.json"
    path.write_text(json.dumps(config))
    return Process([sys.executable, str(WORKER), str(path)], tmp_path / f"{name}.log",
                   env=child_env(INITIAL_PEERS=initial_peers))


def run_swarm(tmp_path: Path, bootstrap: str, configs: dict[str, dict], timeout: float = 150) -> tuple[dict, dict]:
    procs = {name: start(tmp_path, name, config, bootstrap) for name, config in configs.items()}
    finish(procs, timeout=timeout)
    return ({name: read_result(tmp_path, name) for name in configs},
            {name: read_params(tmp_path, name) for name in configs})


def diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def results_cut(tmp_path: Path, name: str) -> int:
    """How many of this peer's all-reduces were incomplete: part of the average did not arrive, or a member's values
    are missing from part of it (collabopt.engine.diloco_averaging logs "all-reduce was incomplete"). Without an
    injected fault (``cut_results_round``) there is none, and a test fails on one: the loss once seen here with no
    fault (a reducer's stream of results ending one part short) was p2pd's close race, which collabopt's streams avoid
    (the side that reads last closes first: :mod:`collabopt.engine.streams`, docs/decisions.md "Results lost with no
    fault")."""
    return (tmp_path / f"{name}.log").read_text(errors="replace").count("all-reduce was incomplete")


def log_tail(tmp_path: Path, name: str, lines: int = 40) -> str:
    """The DiLoCo rounds, downloads and epochs of a peer's log (the last ``lines`` of them), for assertion messages."""
    keep = ("DiLoCo round", "Downloading", "out of sync", "accumulated", "WARN", "ERROR")
    log = (tmp_path / f"{name}.log").read_text(errors="replace").splitlines()
    return "\n".join([line[:200] for line in log if any(k in line for k in keep)][-lines:])


def rounds_by_epoch(result: dict) -> dict[int, dict]:
    return {r["epoch"]: r for r in result["rounds"]}


def peers(run_id: str, names_and_batches: dict[str, list[int]], epochs: int, **extra) -> dict[str, dict]:
    return {name: dict(run_id=run_id, target_batch_size=256, epochs=epochs, batch_sizes=batches, seed=i,
                       model_seed=0, wait_peers=len(names_and_batches), max_seconds=120, **extra)
            for i, (name, batches) in enumerate(names_and_batches.items())}


def test_three_peers_started_together_are_equal_after_every_round(tmp_path, bootstrap):
    """Plain loops with ``collaborate(model, opt, outer_optimizer=...)`` (the PyTorch adapter), batch sizes 8/16/24,
    started at once, none waiting for the others (issue 32's start: 900 samples a round). Each peer's first views of
    the swarm are seconds old (fetched by an ETA still warming up): peers that started together each took rounds
    alone, forking the anchor, then refused their group's rounds ("anchor differs") and downloaded, 0 of 12 runs clean
    (docs/decisions.md, "DiLoCo: no round alone on an old view of the swarm"). Now every peer applies every round in a
    group of 3, equal after it and apart between rounds, nobody downloads, and every sample counts once."""
    names = {"a": [8], "b": [16], "c": [24]}
    configs = peers(unique_run_id("diloco3"), names, epochs=4, collaborate=True)
    for name in configs:
        configs[name].update(wait_peers=0, target_batch_size=900,
                             finish_with=finish_line(tmp_path, *(n for n in names if n != name)))
    results, params = run_swarm(tmp_path, bootstrap, configs)

    cut = {name: results_cut(tmp_path, name) for name in names}
    assert not any(cut.values()), cut  # no fault injected: every all-reduce whole (see results_cut)
    for epoch in range(1, 5):
        rounds = {name: rounds_by_epoch(results[name]).get(epoch, {}) for name in names}
        why = (epoch, {n: results[n]["rounds"] for n in names}, {n: log_tail(tmp_path, n) for n in names})
        assert all(rounds[n].get("applied") and rounds[n]["group_size"] == 3 for n in names), why
        after = {name: params[name]["after"][epoch] for name in names}
        before = {name: params[name]["before"][epoch] for name in names}
        for x, y in itertools.combinations(names, 2):
            assert diff(after[x], after[y]) <= EQUAL, (epoch, x, y)
            assert diff(before[x], before[y]) > 1e-3, (epoch, x, y)  # local steps between rounds
        previous = params["a"]["after"].get(epoch - 1, params["a"]["start"])
        assert diff(after["a"], previous) > 1e-3  # the round moved the parameters
    for name in names:  # every sample since the last round counted in each round's weight
        why = ({n: results[n]["rounds"] for n in names}, {n: log_tail(tmp_path, n) for n in names})
        assert results[name]["resyncs"] == 0 and "Downloading parameters" not in (tmp_path / f"{name}.log").read_text(
            errors="replace"), (name, why)
        for r in results[name]["rounds"]:
            if r["applied"]:  # (rounds past epoch 4, at the finish line, may find the others gone)
                assert r["weight"] == r["fed_since_anchor"], (name, r)
        assert results[name]["final_loss"] < results[name]["start_loss"]
        assert results[name]["metrics_interval"] == DILOCO_PUBLISH_INTERVAL  # (DHT traffic: see collabopt.metrics)


def reference_rounds(start: dict, before: dict[str, dict], weights: dict[str, dict], epochs: list[int],
                     outer: dict) -> dict[int, dict]:
    """The DiLoCo rounds in plain torch: average of (anchor - parameters) weighted by samples, then the outer
    optimizer (SGD with Nesterov momentum, state kept across rounds) steps from the anchor."""
    names = list(before)
    anchor = {k: torch.nn.Parameter(v.clone().double()) for k, v in start.items()}
    opt = torch.optim.SGD(list(anchor.values()), **outer)
    out = {}
    for epoch in epochs:
        total = sum(weights[n][epoch] for n in names)
        for k, a in anchor.items():
            a.grad = sum(weights[n][epoch] * (a.detach() - before[n][epoch][k].double()) for n in names) / total
        opt.step()
        out[epoch] = {k: a.detach().clone() for k, a in anchor.items()}
    return out


def test_rounds_reproduce_the_diloco_update_in_plain_torch(tmp_path, bootstrap):
    names = {"a": [8, 40], "b": [16]}  # a trains on 1.5x the samples of b per step
    outer = dict(lr=0.7, momentum=0.9, nesterov=True)
    configs = peers(unique_run_id("diloco_ref"), names, epochs=3, compression="none", outer=outer)
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in names if n != name))
    results, params = run_swarm(tmp_path, bootstrap, configs)

    epochs = [1, 2, 3]
    rounds = {name: rounds_by_epoch(results[name]) for name in names}
    assert all(rounds[n][e]["applied"] and rounds[n][e]["group_size"] == 2 for n in names for e in epochs), rounds
    assert diff(params["a"]["start"], params["b"]["start"]) == 0.0
    weights = {n: {e: rounds[n][e]["weight"] for e in epochs} for n in names}
    assert weights["a"][1] != weights["b"][1] or weights["a"][2] != weights["b"][2]  # a real weighted average
    expected = reference_rounds(params["a"]["start"], {n: params[n]["before"] for n in names}, weights, epochs,
                                outer)
    for epoch in epochs:
        for name in names:
            assert diff(params[name]["after"][epoch], expected[epoch]) <= EQUAL, (epoch, name)


def test_a_member_whose_anchor_differs_is_not_averaged_into_the_round(tmp_path, bootstrap):
    """C starts from another model (another anchor) beside A and B: in their first round of 3, C takes part with
    weight 0 (it judges the gathered anchors before the all-reduce: protocol.diloco_contributes), so A and B apply
    exactly their own two pseudo-gradients' round; C does not apply it, downloads, keeps its progress, and is equal
    to them after its next round."""
    names = {"a": [8], "b": [16], "c": [12]}
    outer = dict(lr=0.7, momentum=0.9, nesterov=True)
    configs = peers(unique_run_id("diloco_apart"), names, epochs=3, compression="none", outer=outer)
    configs["c"]["model_seed"] = 1
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in names if n != name))
    results, params = run_swarm(tmp_path, bootstrap, configs)

    first = {name: rounds_by_epoch(results[name]).get(1, {}) for name in "ab"}
    why = ({n: results[n]["rounds"] for n in names}, {n: log_tail(tmp_path, n) for n in names})
    assert all(r.get("applied") and r.get("group_size") == 3 for r in first.values()), why
    c_first = results["c"]["rounds"][0]
    assert not c_first["applied"] and c_first["reason"] == "anchor differs" and results["c"]["resyncs"] >= 1, why
    assert "joins the round with weight 0" in (tmp_path / "c.log").read_text(errors="replace"), why
    weights = {n: {1: first[n]["weight"]} for n in "ab"}
    expected = reference_rounds(params["a"]["start"], {n: params[n]["before"] for n in "ab"}, weights, [1], outer)
    for name in "ab":
        assert diff(params[name]["after"][1], expected[1]) <= EQUAL, name
    later = [r["epoch"] for r in results["c"]["rounds"] if r["applied"]]
    assert later, why
    for epoch in later:  # C's progress since its own start went into the swarm with the next round it applied
        assert diff(params["c"]["after"][epoch], params["a"]["after"][epoch]) <= EQUAL, epoch


def test_a_peer_that_misses_a_round_keeps_its_progress_and_resyncs(tmp_path, bootstrap):
    names = {"a": [8], "b": [16], "c": [24]}
    configs = peers(unique_run_id("diloco_fault"), names, epochs=5)
    configs["c"]["fail_round"] = 2
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in names if n != name))
    results, params = run_swarm(tmp_path, bootstrap, configs)

    rounds = {name: rounds_by_epoch(results[name]) for name in names}
    why = ({n: results[n]["rounds"] for n in names}, {n: log_tail(tmp_path, n) for n in names})
    # C missed round 2 (the others applied it, maybe the next one too, while C's averaging failed), then
    # downloaded the swarm's state at epoch `caught_up`
    assert not rounds["c"].get(2, {}).get("applied", False), why
    caught_up = min(e for e, r in rounds["c"].items() if r["resynced"])
    assert caught_up >= 2 and not rounds["c"][caught_up]["applied"], why
    assert rounds["a"][2]["applied"] and rounds["a"][2]["group_size"] == 2, why
    # C's parameters after the download: the swarm's anchor plus C's own progress since its old anchor (epoch 1)
    anchor_old, anchor_new = params["c"]["after"][1], params["a"]["after"][caught_up]
    kept = {k: anchor_new[k] + params["c"]["before"][caught_up][k] - anchor_old[k] for k in anchor_new}
    assert diff(params["c"]["after"][caught_up], kept) <= EQUAL
    assert diff(params["c"]["before"][caught_up], anchor_old) > 1e-3  # there was progress to keep
    # the next round: everyone again, equal; C's weight counts every sample since its last round (before the fault)
    cut = {name: results_cut(tmp_path, name) for name in names}
    assert not any(cut.values()), (cut, why)  # the injected fault fails C's round, not part of an all-reduce
    following = caught_up + 1
    for name in names:
        assert rounds[name][following]["applied"] and rounds[name][following]["group_size"] == 3, (name, why)
        assert diff(params[name]["after"][following], params["a"]["after"][following]) <= EQUAL
        for r in results[name]["rounds"]:
            if r["applied"]:
                assert r["weight"] == r["fed_since_anchor"], (name, r)
    assert results["c"]["rounds_failed"] >= 1 and results["c"]["resyncs"] >= 1


def test_a_member_that_loses_part_of_a_rounds_results_counts_its_progress_once(tmp_path, bootstrap):
    """Fault injection (diloco_worker.cut_results): in the second round, one peer's reducer ends one member's
    results one part short, though it averaged that part (the failure of results_cut). The member's pseudo-gradient
    reached the group, which applied the round with it: the member does not send it again, downloads the swarm's
    state and keeps only its progress since, and its next round weighs only the samples since: it counts them once."""
    names = {"a": [8], "b": [16], "c": [24]}
    configs = peers(unique_run_id("diloco_cut"), names, epochs=5, cut_results_round=2,
                    cut_marker=str(tmp_path / "cut.marker"))
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in names if n != name))
    results, params = run_swarm(tmp_path, bootstrap, configs)

    rounds = {name: rounds_by_epoch(results[name]) for name in names}
    why = ({n: results[n]["rounds"] for n in names}, {n: log_tail(tmp_path, n) for n in names})
    cutter = [n for n in names if "cut one part short" in (tmp_path / f"{n}.log").read_text(errors="replace")]
    cut = [n for n in names if results_cut(tmp_path, n)]
    assert len(cutter) == 1 and len(cut) == 1 and cut != cutter, (cutter, cut, why)
    member, others = cut[0], [n for n in names if n != cut[0]]
    lost = min(params[member]["partial"])  # the epoch of the (first) round it lost results of
    epoch = min(e for e, r in rounds[member].items() if r["resynced"])  # the epoch it downloaded
    assert epoch > lost and not rounds[member][epoch]["applied"], why
    assert all(rounds[n][epoch]["applied"] and rounds[n][epoch]["group_size"] == 3 for n in others), why
    # after the download: the swarm's anchor plus the member's progress since its pseudo-gradient was taken
    contributed, anchor = params[member]["partial"][lost], params[others[0]]["after"][epoch]
    kept = {k: anchor[k] + params[member]["before"][epoch][k] - contributed[k] for k in anchor}
    assert diff(params[member]["after"][epoch], kept) <= EQUAL, why
    previous = params[member]["after"].get(lost, params[member]["start"])
    assert diff(contributed, previous) > 1e-3  # (its pseudo-gradient was not nothing)
    following = epoch + 1  # everyone again, equal; the member's weight: its samples since that pseudo-gradient
    for name in names:
        assert rounds[name][following]["applied"] and rounds[name][following]["group_size"] == 3, (name, why)
        assert diff(params[name]["after"][following], params["a"]["after"][following]) <= EQUAL
        assert rounds[name][following]["weight"] == rounds[name][following]["fed_since_anchor"], (name, why)


def test_accelerate_two_rank_node_beside_a_plain_peer(tmp_path, bootstrap):
    """One node of 2 ranks (its inner optimizer: SGD with an ExponentialLR per round) and one plain peer (AdamW): 2
    peers in the swarm, ranks bit-identical at every step (they take the same inner steps), node equal to the peer
    after every round, the node's LR one scheduler step per round."""
    from test_accelerate import launch

    run_id, epochs, lr, gamma = unique_run_id("diloco_acc"), 3, 0.05, 0.7
    node = launch(tmp_path, "node", dict(run_id=run_id, target_batch_size=256, epochs=epochs, lr=lr, gamma=gamma,
                                         outer=dict(lr=0.7, momentum=0.9, nesterov=True), save_epoch_params=True,
                                         step_sleep=0.02, wait_peers=2, finish_with=finish_line(tmp_path, "peer")),
                  bootstrap)
    peer = start(tmp_path, "peer", dict(run_id=run_id, target_batch_size=256, epochs=epochs, batch_sizes=[16],
                                        model_seed=0, wait_peers=2, max_seconds=120,
                                        finish_with=finish_line(tmp_path, "node")), bootstrap)
    finish({"node": node, "peer": peer}, timeout=170)

    r0, r1 = (read_result(tmp_path, f"node.rank{rank}") for rank in (0, 1))
    peer_result = read_result(tmp_path, "peer")
    assert r0["type"] == r1["type"] == "NodeOptimizer"
    assert r0["max_num_peers"] == 2 and r0["epochs_seen"] == r1["epochs_seen"]
    assert r0["samples_reported"] == r1["samples_reported"] == r0["samples_fed"] + r1["samples_fed"]
    p0, p1 = (read_params(tmp_path, f"node.rank{rank}") for rank in (0, 1))
    assert diff(p0, p1) == 0.0  # after inner steps that were never broadcast
    e0, e1 = (torch.load(tmp_path / f"node.rank{rank}.epochs.pt") for rank in (0, 1))
    peer_rounds, peer_params = rounds_by_epoch(peer_result), read_params(tmp_path, "peer")
    for epoch in range(1, epochs + 1):
        assert diff(e0[epoch], e1[epoch]) == 0.0
        assert peer_rounds[epoch]["applied"] and peer_rounds[epoch]["group_size"] == 2, peer_rounds[epoch]
        assert diff(e0[epoch], peer_params["after"][epoch]) <= EQUAL, epoch
        assert diff(peer_params["before"][epoch], e0[epoch - 1] if epoch > 1 else peer_params["start"]) > 1e-3
        for r in (r0, r1):
            assert r["lrs"][str(epoch)] == pytest.approx(lr * gamma**epoch, rel=1e-12)


def test_two_lightning_trainers(tmp_path, bootstrap):
    """2 Trainers (SGD with momentum inside, StepLR per round from configure_optimizers): equal after every round,
    every sample counted, the LR of torch's StepLR after as many steps as rounds."""
    from test_lightning_swarm import params as trainer_params
    from test_lightning_swarm import result as trainer_result
    from test_lightning_swarm import start_trainer, torch_lrs

    run_id, epochs, lr = unique_run_id("diloco_pl"), 3, 0.05
    base = dict(run_id=run_id, target_batch_size=256, global_epochs=epochs, lr=lr, scheduler="step", batch_size=16,
                step_sleep=0.02, max_seconds=100, outer=dict(lr=0.7, momentum=0.9, nesterov=True),
                save_epoch_params=True, barrier=[str(tmp_path / "a"), str(tmp_path / "b")],
                finish_with=finish_line(tmp_path, "a", "b"))
    procs = {name: start_trainer(tmp_path, name, dict(base, seed=seed), bootstrap)
             for name, seed in (("a", 1), ("b", 2))}
    finish(procs, 150)

    results = {name: trainer_result(tmp_path, name) for name in procs}
    epoch_params = {name: torch.load(tmp_path / f"{name}.rank0.epochs.pt") for name in procs}
    reference = torch_lrs("step", lr, epochs + 2)
    for name, res in results.items():
        assert res["final_epoch"] >= epochs and res["max_peers_logged"] == 2, (name, res)
        assert res["samples_reported"] == res["samples_fed"], (name, res)
        for k, value in res["lrs"].items():
            assert value == pytest.approx(reference[int(k)], rel=1e-12), (name, k)
    for epoch in range(1, epochs + 1):
        assert diff(epoch_params["a"][epoch], epoch_params["b"][epoch]) <= EQUAL, epoch
    assert diff(trainer_params(tmp_path, "a"), epoch_params["a"][1]) > 1e-3  # it trained after round 1


def test_a_late_joiner_downloads_the_anchor_and_the_outer_momentum(tmp_path, bootstrap):
    """A peer joining after round 2 downloads the anchor and the outer optimizer's momentum: at its first round it
    ends equal to the others (with another momentum its outer step would differ)."""
    import json
    import time

    def progress(name: str) -> int:
        try:
            return json.loads((tmp_path / f"{name}.progress").read_text())["epoch"]
        except (OSError, ValueError):
            return -1

    def wait_until(condition, seconds: float = 90) -> None:
        deadline = time.monotonic() + seconds
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.2)

    names = {"a": [8], "b": [16]}
    # all train until the epochs file exists: 3 rounds after the epoch D starts at (its start-up time varies)
    configs = peers(unique_run_id("diloco_late"), names, epochs=0, epochs_file=str(tmp_path / "epochs"))
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in ("a", "b", "d") if n != name))
    procs = {name: start(tmp_path, name, config, bootstrap) for name, config in configs.items()}
    wait_until(lambda: progress("a") >= 2)
    procs["d"] = start(tmp_path, "d", dict(configs["a"], batch_sizes=[12], seed=3, wait_peers=None,
                                           finish_with=finish_line(tmp_path, "a", "b")), bootstrap)
    wait_until(lambda: progress("d") >= 0)
    (tmp_path / "epochs").write_text(str(max(progress("d"), 2) + 3))
    finish(procs, timeout=150)
    results = {name: read_result(tmp_path, name) for name in procs}
    params = {name: read_params(tmp_path, name) for name in procs}

    late = results["d"]
    assert late["start_epoch"] >= 2, late  # downloaded the swarm's state before its first step
    assert diff(params["d"]["start"], params["a"]["after"][late["start_epoch"]]) <= EQUAL
    joined = [r["epoch"] for r in late["rounds"] if r["applied"]]
    assert joined, late["rounds"]
    cut = {name: results_cut(tmp_path, name) for name in procs}
    assert not any(cut.values()), cut  # no fault injected: every all-reduce whole (see results_cut)
    for epoch in joined:  # A and B applied that round too, and all three are equal
        applied = [name for name in "ab" if any(r["epoch"] == epoch and r["applied"] for r in results[name]["rounds"])]
        assert applied == ["a", "b"], (epoch, results["a"]["rounds"], results["b"]["rounds"])
        for name in applied:
            assert diff(params["d"]["after"][epoch], params[name]["after"][epoch]) <= EQUAL, (epoch, name)


def test_overlap_rounds_land_equal_and_reproduce_plain_torch(tmp_path, bootstrap):
    """overlap_rounds=True (2 peers, exact averaging): each round's all-reduce runs while inner steps go on. The
    anchors the peers land on are equal, they are plain-torch DiLoCo applied to the parameters each peer had when the
    round started, and the parameters after a landing are that anchor plus the progress made meanwhile."""
    names = {"a": [8, 40], "b": [16]}
    outer = dict(lr=0.7, momentum=0.9, nesterov=True)
    configs = peers(unique_run_id("diloco_overlap"), names, epochs=4, compression="none", outer=outer, overlap=True)
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(n for n in names if n != name))
    results, params = run_swarm(tmp_path, bootstrap, configs)

    landed = [1, 2, 3]
    rounds = {name: rounds_by_epoch(results[name]) for name in names}
    assert all(rounds[n][e]["applied"] for n in names for e in landed), rounds
    weights = {n: {e: rounds[n][e]["weight"] for e in landed} for n in names}
    expected = reference_rounds(params["a"]["start"], {n: params[n]["base"] for n in names}, weights, landed, outer)
    for k in landed:  # the k-th round landed: it started at epoch k, from the parameters recorded then
        for name in names:
            land = params[name]["landed"][k]
            assert diff(land["anchor"], expected[k]) <= EQUAL, (k, name)
            kept = {key: land["anchor"][key] + land["before"][key] - params[name]["base"][k][key]
                    for key in land["anchor"]}
            assert diff(land["after"], kept) <= EQUAL, (k, name)
        assert diff(params["a"]["landed"][k]["anchor"], params["b"]["landed"][k]["anchor"]) <= EQUAL
    assert all(results[n]["rounds_failed"] == 0 for n in names)
