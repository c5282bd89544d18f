"""A hostile member serves altered parameters and a late joiner arrives (issue 35, "A joiner downloads state only
from a peer whose parameter fingerprint most of the swarm holds"; collabopt/engine/download_votes.py and
download_challenge.py).

3 honest peers and a hostile one train together; the hostile one serves altered parameters to every download, asks
to be the first source (priority raised) and votes with its real parameters' fingerprint, which is the honest peers'.
Then a joiner arrives. With ``aggregation="centered_clip"`` the hostile peer serves a permutation of its parameters
(each tensor's values reversed: the fingerprint's three sums are the honest ones, so only the secret challenge tells
it apart); the joiner refuses it and holds the honest peers' parameters from its first step to the end. With
``"mean"`` (nothing verified) it serves its parameters plus 1000, and the joiner starts from that state, so the test
can fail. The swarms run one after the other.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    finish,
    finish_line,
    max_param_diff,
    read_params,
    read_result,
    start_bootstrap,
    start_peer,
    unique_run_id,
)
from helpers import wait_for_file as wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

HONEST = ("h0", "h1", "h2")
ALTERED = 1000.0  # what the hostile peer adds to the parameters it serves
SAME = 1e-6
# (2560 samples: epochs of 2.5-4 s, the parameter averaging about 0.2 s of it. The joiner joins about 1 s after h0
# reaches epoch 2 and its download and challenge take about 0.3 s, so they end well inside that epoch, while the
# answerers still vote for it: with 1280 samples a faster host filled an epoch in 1.1 s, the challenge met the
# boundary, no voter answered and the hostile state was skipped, not refused. A chunk timeout of 5 s: a download the
# hostile peer holds for a parameter round is not given up at the default 1 s of this matchmaking_time on a slow host)
BASE = dict(target_batch_size=2560, epochs=4, batch_sizes=[16], lr=0.05, step_sleep=0.05, max_seconds=60,
            model_seed=0, save_epoch_params=True,
            options=dict(matchmaking_time=1.0, averaging_timeout=10.0, next_chunk_timeout=5.0))


def start_swarm(tmp_path: Path, aggregation: str) -> dict:
    """A bootstrap of its own (killing one swarm leaves the other's DHT alone); the honest peers and the hostile one
    ("x") start together, the joiner once h0 is at epoch 2."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    run_id = unique_run_id(f"votes_{aggregation}")
    names = (*HONEST, "x", "late")
    procs = {"bootstrap": bootstrap}
    for index, name in enumerate(names):
        config = dict(BASE, run_id=run_id, seed=index, options=dict(BASE["options"], aggregation=aggregation),
                      finish_with=finish_line(tmp_path, *(other for other in names if other != name)))
        if name == "late":
            config.update(model_seed=7, start_after=dict(progress_file=str(tmp_path / "h0.progress"), epoch=2))
        else:
            config.update(wait_peers=4)
        if name == "x":
            config.update(serve_altered="permuted" if aggregation == "centered_clip" else ALTERED)
        procs[name] = start_peer(tmp_path, name, config, initial_peers)
    return procs


def started_at(tmp_path: Path) -> int:
    """The epoch the joiner started training at (after its download)."""
    return json.loads((tmp_path / "late.started").read_text())["epoch"]


def test_a_joiner_refuses_a_hostile_state_and_holds_the_honest_one(tmp_path):
    began = time.monotonic()
    clipped_path, plain_path = tmp_path / "centered_clip", tmp_path / "mean"
    plain = start_swarm(plain_path, "mean")
    try:  # with "mean" the joiner starts from the hostile state: nothing more is needed of that swarm
        assert wait_for(plain_path / "late.started", 60), plain["late"].log()[-4000:]
    finally:
        for proc in plain.values():
            proc.kill_tree()
    clipped = start_swarm(clipped_path, "centered_clip")
    bootstrap = clipped.pop("bootstrap")
    try:
        finish(clipped, 90)
    finally:
        bootstrap.kill_tree()
    print(f"the two swarms: {time.monotonic() - began:.1f} s")

    # centered_clip: the joiner started from the honest peers' parameters of its first epoch, and ends with theirs
    epoch, log = started_at(clipped_path), clipped["late"].log()
    start = torch.load(clipped_path / "late.start.pt")
    honest = [torch.load(clipped_path / f"{name}.epochs.pt").get(epoch) for name in HONEST]
    assert epoch >= 2 and min(max_param_diff(start, params) for params in honest if params is not None) <= SAME, log
    # (the hostile peer was asked first; its fingerprint passed, and at least one challenge of it was answered and
    # refused it: no answer agreed, at least one disagreed. Where the answerers had moved on, another attempt says
    # "not installed: no other voter ... answered" first; the hostile state is never installed either way)
    assert re.search(r"refused the state \S+ sent \(its parameters are not those the other voters of epoch \d+ "
                     r"serve \(secret challenge: 0 answer\(s\) agree, [1-9]", log), log[-4000:]
    final = {name: read_params(clipped_path, name) for name in (*HONEST, "late")}
    assert all(max_param_diff(final["late"], final[name]) <= SAME for name in HONEST)
    assert read_result(clipped_path, "late")["final_epoch"] >= BASE["epochs"]

    # mean: nothing is verified, and the joiner started from the hostile state (honest parameters are within 10)
    plain_start = torch.load(plain_path / "late.start.pt")
    assert all(float((value - ALTERED).abs().max()) < 10.0 for value in plain_start.values()), plain_start
