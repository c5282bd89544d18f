"""LR schedules on real swarms: offloaded and delayed optimizers, and a peer that joins late."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    SWARM_ROUNDING,
    diffs_at_common_epochs,
    finish_line,
    max_param_diff,
    read_epoch_params,
    read_params,
    read_result,
    start_peer,
    unique_run_id,
    wait_all,
    wait_for_file,
    worst,
)
from schedulers import reference_lrs

pytestmark = pytest.mark.swarm

OFFLOAD = dict(offload_optimizer=True)
# With delayed rounds a late joiner can count one epoch ahead of the others (it downloads a state while they wait
# for their background round, then steps at once); at the finish line its last round then looks for peers that
# have left and waits averaging_timeout (seen: 28 s of a 51 s run). A shorter timeout bounds that wait; the
# parameters are compared at the epochs every peer reached by a round.
DELAYED = dict(offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True, delay_state_averaging=True,
               averaging_timeout=10.0)
# (options, each peer's scheduler); every case has a late joiner per scheduler. A peer's scheduler is its own (its
# LR is compared with its own spec's reference), so one swarm checks several. A late joiner's download and its LR
# afterwards are checked once per download path: plateau-offload (the state at the epoch it downloads) and delayed
# (the state one update ahead of the servers' parameters), with warmup_lambda and sequential on the delayed one.
# delay_optimizer_step without delay_grad_averaging had a swarm of its own (sequential): the same download path and
# LR claims as delayed's; its foreground gradient round is every default-mode swarm's. A case of two offloaded peers
# with OneCycleLR and no joiner checked nothing these do not: plateau-offload's A and B are two offloaded peers
# compared at every common epoch, the delayed case steps schedulers without a metric on a swarm, and OneCycleLR per
# global epoch is tests/unit/test_scheduling.py's. (Cases with a late joiner keep the harness's matchmaking_time of
# 2 s: with 1 s, in 2 of 6 runs of cases with one (offload, delayed) the joiner's parameters ended 0.0025-0.003
# apart from A's and B's (equal to each other), at its download epoch or the epochs after)
CASES = {
    "delayed": (DELAYED, {"a": "warmup_lambda", "b": "sequential", "late": "warmup_lambda", "late2": "sequential"}),
    "plateau-offload": (OFFLOAD, {"a": "plateau", "b": "plateau", "late": "plateau"}),
}
# the case whose late joiner starts from a model initialization of its own (model_seed 3; the others' is 0): the
# swarm's state replaces it before its first contribution, bit-identical to a server's parameters at that epoch
OWN_INIT = "plateau-offload"


@pytest.mark.parametrize("case", CASES)
def test_lr_follows_global_epochs_on_every_peer_and_a_late_joiner(tmp_path, bootstrap, case):
    options, specs = CASES[case]
    names = tuple(specs)
    joiners = [name for name in names if name.startswith("late")]
    lr, epochs = 0.05, 5
    initial_peers = bootstrap
    # the last epoch: 5, or 3 after the one the last late joiner starts at, written once they started (on a busy
    # machine one started at epoch 5 of 5 once, and had no epoch to be checked at)
    base = dict(run_id=unique_run_id(case.replace("-", "_")), target_batch_size=640, epochs=epochs, lr=lr,
                model_seed=0, options=options, step_sleep=0.05, batch_sizes=[16], save_epoch_params=True,
                finish_with=finish_line(tmp_path, *names), epochs_file=str(tmp_path / "epochs"))
    configs = {"a": dict(base, seed=1, wait_peers=2), "b": dict(base, seed=2, batch_sizes=[8, 24], wait_peers=2)}
    for seed, name in enumerate(joiners, start=3):
        configs[name] = dict(base, seed=seed, start_after=dict(progress_file=str(tmp_path / "a.progress"), epoch=2))
    if case == OWN_INIT:
        configs["late"]["model_seed"] = 3
    for name, config in configs.items():
        config["scheduler"] = specs[name]
        if specs[name] == "plateau":
            config["plateau_metric"] = 1.0  # a plateau: the LR is cut at every epoch after the first
    procs = {}
    try:
        for name, config in configs.items():
            procs[name] = start_peer(tmp_path, name, config, initial_peers)
        for name in joiners:
            started = wait_for_file(tmp_path / f"{name}.started", 90)
            epochs = max(epochs, json.loads((tmp_path / f"{name}.started").read_text())["epoch"] + 3 if started else 0)
        (tmp_path / "epochs").write_text(str(epochs))
        codes = wait_all(procs, 150)
    finally:
        for proc in procs.values():
            proc.kill_tree()
    for name, code in codes.items():
        assert code == 0, f"{name} exited {code}:\n{procs[name].log()[-4000:]}"
    results = {name: read_result(tmp_path, name) for name in procs}
    # peers past the finish line train on until all are there (seen: epoch 9 of 5 in delayed mode)
    last = max(r["final_epoch"] for r in results.values()) + 2
    for name, result in results.items():
        expected = reference_lrs(specs[name], lr, last, plateau_metric=1.0)
        assert name not in joiners or result["start_epoch"] >= 2, (name, result)
        assert result["final_epoch"] >= epochs, (name, result)
        for epoch, value in result["lrs"].items():
            assert value == pytest.approx(expected[int(epoch)], rel=1e-9), (name, epoch, value, expected)
        assert len(result["lrs"]) >= 2 + (name not in joiners)  # the schedule was observed over several epochs
        # the user's scheduler object reports the live value
        assert result["scheduler_lr"] == pytest.approx(result["final_lr"], rel=1e-12)
    # the parameters at every epoch the peers all reached by a round: equal, a late joiner's from its first round
    # on. In sync up to the last bits: hivemind's all-reduce hands each peer `averaged - local` to add to its own
    # tensor, so once any participant's parameters differed slightly (a late joiner that missed a round, delayed
    # updates applied at a later step), every peer keeps last-bit differences (seen: 1.5e-11 .. 3e-11). Bit-identity
    # without a late joiner is asserted in test_swarm_training / test_swarm_faults.
    ab = diffs_at_common_epochs(tmp_path, ["a", "b"], results=results)
    assert len(ab) >= epochs - 1, ab
    assert worst(ab.values()) <= SWARM_ROUNDING, ab
    # after the last flush (every delayed update applied): equal where the final epochs are
    final = {name: read_params(tmp_path, name) for name in procs}
    for name in names[1:]:
        if results[name]["final_epoch"] == results["a"]["final_epoch"]:
            assert max_param_diff(final["a"], final[name]) <= SWARM_ROUNDING, name
    epoch_params = {name: read_epoch_params(tmp_path, name) for name in procs}
    shift = 1 if options.get("delay_optimizer_step") else 0
    for joiner in joiners:
        late = diffs_at_common_epochs(tmp_path, ["a", "b", joiner], since=results[joiner]["start_epoch"] + 1,
                                      results=results)
        assert late and worst(late.values()) <= SWARM_ROUNDING, (joiner, late)
        # a download: the state served is the optimizer's. With delay_optimizer_step the model's parameters take each
        # boundary's update at the next boundary (hivemind's TrainingStateAverager applies a background step's result
        # at a later step()), so the state a joiner downloads at epoch e is what the others' parameters become at
        # e + 1; the joiner, with no update pending, holds it through its own boundary
        for epoch in results[joiner]["downloaded_epochs"]:
            if epoch + shift in epoch_params["a"]:
                assert max_param_diff(epoch_params[joiner][epoch], epoch_params["a"][epoch + shift]) <= SWARM_ROUNDING
    if case == OWN_INIT:  # before its first step it held a server's parameters of its start epoch, bit-identical,
        # not its own initialization
        start_epoch, start = results["late"]["start_epoch"], torch.load(tmp_path / "late.start.pt")
        sources = [epoch_params[name][start_epoch] for name in ("a", "b") if start_epoch in epoch_params[name]]
        assert sources and min(max_param_diff(start, params) for params in sources) == 0.0, start_epoch
        torch.manual_seed(3)
        own = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).state_dict()
        assert max_param_diff(start, own) > 0.01
