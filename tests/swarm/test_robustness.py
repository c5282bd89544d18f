"""A hostile member among 4 peers (issue 35, "Robustness"): with aggregation="centered_clip" the honest peers' held-out
loss ends within 10% of a 4-peer run with no attacker on the same seeds and samples; with "mean" the same attack
hurts (2x the clean loss, or divergence), so each test can fail. In every swarm the honest peers hold equal
parameters at every epoch (the clean run's, each aggregation's under attack).

The attacks, one per test (tests/swarm/peer_worker.py, ``attack``): its gradients times -20 at every step; Gaussian
noise at 100x its gradient's norm; a claim of 1,000x its real samples, its gradients computed on wrong labels (a claim
of honest gradients only gives them more weight: the claim is what lets a poisoned gradient, which a mean of 4
absorbs, take the round). Each test runs the attack under both aggregations at once (two swarms); the clean run is
shared.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from pathlib import Path

import pytest
from helpers import (
    SWARM_ROUNDING,
    diffs_at_common_epochs,
    finish,
    finish_line,
    read_result,
    start_bootstrap,
    start_peer,
    unique_run_id,
    worst,
)

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

HONEST = ("p0", "p1", "p2")
EPOCHS = 6
# Adam: 6 steps take the clean run's held-out loss from 1.46 to about a third of it, 0.47 (SGD needs many more
# epochs; 8 steps took it to a fifth, at a third more time per swarm). Two runs at 6: centered_clip 0.95-1.01x the
# clean loss under each attack (bound 1.1x), mean 15-16x (times -20), 2.9-3.0x (noise), 4.0-5.7x (claim) (bound 2x).
# 128 samples per peer and epoch: the clip's bias is a share of the honest gradients' spread, which shrinks with
# the batch (times -20 at 32 samples per peer: 1.12-1.14x the clean loss; at 128: 1.06-1.07x)
BASE = dict(target_batch_size=512, epochs=EPOCHS, batch_sizes=[64], optimizer="Adam", lr=0.05, held_out=1024,
            step_sleep=0.02, max_seconds=90, wait_peers=4, model_seed=0, data_seed=0, save_epoch_params=True,
            options=dict(matchmaking_time=1.0, averaging_timeout=10.0, verbose=False))
ATTACKS = {
    "times_minus_20": dict(scale=-20.0),
    "noise_100x": dict(noise=100.0),
    "claim_1000x": dict(claim=1000, wrong_labels=True),
}


def start_swarm(tmp_path: Path, aggregation: str, attack: dict | None) -> dict:
    """A bootstrap and 4 peers (p3 hostile when ``attack`` is given), each peer with its own seed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    run_id = unique_run_id("robust")
    procs = {"bootstrap": bootstrap}
    for index, name in enumerate((*HONEST, "p3")):
        config = dict(BASE, run_id=run_id, seed=index, options=dict(BASE["options"], aggregation=aggregation))
        if name == "p3" and attack is not None:
            config.update(attack=attack, count="claimed" if attack.get("claim") else "forward")
        config["finish_with"] = finish_line(tmp_path, *[other for other in (*HONEST, "p3") if other != name
                                                        and (attack is None or other != "p3")])
        procs[name] = start_peer(tmp_path, name, config, initial_peers)
    return procs


def honest_loss(tmp_path: Path, procs: dict) -> float:
    """The honest peers' mean held-out loss (inf where a peer diverged)."""
    peers = {name: proc for name, proc in procs.items() if name in HONEST}
    try:
        finish(peers, timeout=120)
    finally:
        for proc in procs.values():
            proc.kill_tree()
    results = {name: read_result(tmp_path, name) for name in HONEST}
    assert_honest_peers_equal(tmp_path, results)
    losses = [results[name]["held_out_loss"] for name in HONEST]
    return statistics.mean(loss if math.isfinite(loss) else math.inf for loss in losses)


def apart(a: dict, b: dict) -> float:
    """The largest parameter difference; a NaN or inf equals itself there (the mean's swarm under attack can
    diverge, and its honest peers still hold one value), and a NaN against a number is inf apart (a NaN would pass
    every comparison through ``max``)."""
    worst = 0.0
    for key in a:
        x, y = a[key].double(), b[key].double()
        same = (x == y) | (x.isnan() & y.isnan())
        worst = max(worst, float((x - y).abs().masked_fill(same, 0.0).nan_to_num(nan=math.inf, posinf=math.inf).max()))
    return worst


def assert_honest_peers_equal(tmp_path: Path, results: dict) -> None:
    """The honest peers hold the same parameters at every epoch they all reached by a round: every member of a
    round, the hostile one too, receives the reducers' values."""
    diffs = diffs_at_common_epochs(tmp_path, HONEST, since=1, results=results, diff=apart)
    assert diffs, {name: results[name]["epochs_seen"] for name in HONEST}
    assert worst(diffs.values()) <= SWARM_ROUNDING, diffs


@pytest.fixture(scope="module")
def clean_loss(tmp_path_factory) -> float:
    tmp_path = tmp_path_factory.mktemp("clean")
    began = time.monotonic()
    loss = honest_loss(tmp_path, start_swarm(tmp_path, "mean", None))
    print(f"clean run: honest held-out loss {loss:.4f} ({time.monotonic() - began:.1f} s)")
    return loss


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_centered_clip_withstands_a_hostile_peer_that_hurts_the_mean(tmp_path, clean_loss, attack):
    began = time.monotonic()
    clipped = start_swarm(tmp_path / "centered_clip", "centered_clip", ATTACKS[attack])
    plain = start_swarm(tmp_path / "mean", "mean", ATTACKS[attack])
    clipped_loss = honest_loss(tmp_path / "centered_clip", clipped)
    plain_loss = honest_loss(tmp_path / "mean", plain)
    print(f"{attack}: clean {clean_loss:.4f}, centered_clip {clipped_loss:.4f}, mean {plain_loss:.4f} "
          f"({time.monotonic() - began:.1f} s)")
    assert plain_loss >= 2 * clean_loss, f"the attack did not hurt the mean: {plain_loss} against {clean_loss}"
    assert clipped_loss <= 1.1 * clean_loss, f"centered_clip: {clipped_loss} against {clean_loss} clean"


def test_diloco_rounds_with_centered_clip_land_equal_on_every_peer(tmp_path):
    """DiLoCo's pseudo-gradient rounds through the clipping reducer: every member receives the same values (the
    reducer's result, sent once), so the peers are equal after every round, and the rounds train."""
    from test_diloco import EQUAL, diff, peers, rounds_by_epoch, run_swarm

    names = {"a": [16], "b": [16], "c": [16]}
    configs = peers(unique_run_id("diloco_clip"), names, epochs=3, aggregation="centered_clip")
    for name in configs:
        configs[name]["finish_with"] = finish_line(tmp_path, *(other for other in names if other != name))
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    try:
        results, params = run_swarm(tmp_path, initial_peers, configs)
    finally:
        bootstrap.kill_tree()
    for epoch in range(1, 4):
        whole = [name for name in names if rounds_by_epoch(results[name]).get(epoch, {}).get("applied")]
        assert len(whole) >= 2, (epoch, {name: results[name]["rounds"] for name in names})
        for x, y in itertools.pairwise(whole):
            assert diff(params[x]["after"][epoch], params[y]["after"][epoch]) <= EQUAL, (epoch, x, y)
    assert all(results[name]["final_loss"] < results[name]["start_loss"] for name in names)
