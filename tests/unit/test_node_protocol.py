"""The node's step protocol on 2 real gloo ranks, rank 0's core on a fake peer (no hivemind, a few seconds)."""

from __future__ import annotations

import json

import torch.multiprocessing as mp
from node_protocol_worker import run


def test_node_step_protocol(tmp_path):
    mp.spawn(run, args=(2, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    # samples of both ranks are summed (4 + 8 per step); the second step reaches the target of 24
    assert r0["steps"] == r1["steps"] == [[12, False], [12, True]]
    assert r0["local_epoch"] == r1["local_epoch"] == 1
    assert r0["samples_reported"] == r1["samples_reported"] == 24
    # only rank 0's optimizer stepped; its parameters, LR and scheduler state reached rank 1
    assert r0["params"] == r1["params"]
    assert r0["lr"] == r1["lr"] == r0["scheduler_lr"] == r1["scheduler_lr"] == [0.05]
    assert r0["state"] == r1["state"] == ["collabopt/1", 1, 1]
    assert r0["uncounted"] == r1["uncounted"] == "ConfigurationError: step"
    assert r0["rank0_config_error"] == r1["rank0_config_error"] == "ConfigurationError: grad"
    assert r0["rank0_error"] == "ValueError: boom"
    assert "rank 0 failed (ValueError: boom)" in r1["rank0_error"]
    assert r0["after_errors"] == r1["after_errors"] == "ok"
    # the NaN step's 8 samples and the 4 accumulated before it in this epoch (retracted) are skipped
    assert r0["nan_step"] == r1["nan_step"] == [0, 12, -4, 1]
    assert r0["out_of_sync"] is r1["out_of_sync"] is True  # rank 0's core's, sent to rank 1 with the step
    assert r0["init_error"] == r1["init_error"] == "ConfigurationError: initial_peers"
    # serve_final_state is collective: rank 0's core flushes, then serves; every rank returns its reason
    assert r0["final_calls"] == ["finish_background_work", "serve_final_state(3.0)"]
    assert r0["final_state"] == r1["final_state"] == "no live peer is behind epoch 1"
