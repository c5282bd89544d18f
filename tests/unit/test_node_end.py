"""The end of a node's run on 2 real gloo ranks, rank 0's core on a fake peer (no hivemind, a few seconds each)."""

from __future__ import annotations

import json

import torch.multiprocessing as mp
from node_end_worker import end_run, sigterm_in_lightning_wait


def run(worker, tmp_path) -> tuple[dict, dict]:
    mp.spawn(worker, args=(str(tmp_path),), nprocs=2, join=True)
    return tuple(json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))


def test_the_ranks_decide_together_whether_the_node_serves(tmp_path):
    """end_run: where rank 1 ended on an exception (serve=False) and rank 0 normally, nobody serves and both close
    (a rank serving alone waited in a collective the other never entered, up to node_timeout); where both ended
    normally, rank 0 serves and both return its reason."""
    r0, r1 = run(end_run, tmp_path)
    raised = [r0["one_rank_raised"], r1["one_rank_raised"]]
    assert [r["end_run"] for r in raised] == ["returned None"] * 2
    assert [r["closed"] for r in raised] == [True, True]
    assert not any(call.startswith("serve_final_state") for call in r0["one_rank_raised"]["core_calls"])
    finished = [r0["every_rank_finished"], r1["every_rank_finished"]]
    assert [r["end_run"] for r in finished] == ["returned 'no live peer is behind epoch 0'"] * 2
    assert finished[0]["core_calls"][-3:] == ["finish_background_work", "serve_final_state(None)", "shutdown"]


def test_sigterm_ends_a_lightning_nodes_final_wait_on_every_rank(tmp_path):
    """Lightning's handler broadcasts on the default group with several processes; run during the final wait (the
    other rank waits in the wait group) it blocked for the default group's timeout, then failed. Here rank 0 raises
    Terminated, the node sends it to rank 1, and both record the SIGTERM where Lightning keeps it."""
    r0, r1 = run(sigterm_in_lightning_wait, tmp_path)
    assert r0["wait"] == r1["wait"] == "Terminated"
    assert r0["received_sigterm"] is r1["received_sigterm"] is True
    assert r0["handler_restored"] is r1["handler_restored"] is True
