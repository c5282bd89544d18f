"""Peers that joined through one initial peer reach each other, on machines whose only address lies in a reserved
range (192.0.2.0/24): libp2p's own routing finds no address of such a peer, so the peers learn each other's from the
swarm's address records (collabopt/engine/peer_addresses.py).

Each peer runs in its own namespace; B and C are started with A's address only, as A's join line prints it.
"""

from __future__ import annotations

import re
import time

from helpers import (
    SWARM_ROUNDING,
    diffs_at_common_epochs,
    finish,
    finish_line,
    read_params,
    read_result,
    start_peer,
    unique_run_id,
)
from netswarm import AVERAGING_TIMEOUT, MATCHMAKING_TIME, assert_in_sync, wait_until

from harness.testnet import RESERVED_SUBNET

PARTIAL = re.compile(r"% of this peer's gradient round at epoch \d+ arrived")


def join_address(log: str) -> str | None:
    match = re.search(r"INITIAL_PEERS=(\S+)", log)
    return match[1] if match else None


def test_three_peers_joined_through_one_initial_peer_reach_each_other(tmp_path, make_net):
    net = make_net(3, subnet=RESERVED_SUBNET)
    names = ("a", "b", "c")
    base = dict(max_seconds=240, step_sleep=0.05, target_batch_size=1152, epochs=5, lr=0.3, save_epoch_params=True,
                run_id=unique_run_id("route"), model_seed=0, wait_peers=3, finish_with=finish_line(tmp_path, *names))
    procs, initial_peers = {}, ""
    try:
        for i, name in enumerate(names):
            options = dict(host_maddrs=[f"/ip4/{net.addr[i]}/tcp/0"], averaging_timeout=AVERAGING_TIMEOUT,
                           matchmaking_time=MATCHMAKING_TIME)
            procs[name] = start_peer(tmp_path, name, dict(base, seed=i + 1, options=options), initial_peers,
                                     netns=net.peers[i])
            if not initial_peers:
                wait_until(lambda: join_address(procs["a"].log()) is not None, 120, "A printed no join line")
                initial_peers = join_address(procs["a"].log())
                time.sleep(1.0)
        finish(procs, 300)
    finally:
        for proc in procs.values():
            proc.kill_tree()
    logs = {name: proc.log() for name, proc in procs.items()}
    results = {name: read_result(tmp_path, name) for name in names}
    print(f"routing: epochs {[results[n]['final_epoch'] for n in names]}, "
          f"rounds of 3 {[logs[n].count('gradients averaged with 3 peers') for n in names]}, "
          f"routing failures {[logs[n].count('routing: not found') for n in names]}")
    for name in names:
        assert results[name]["final_epoch"] >= base["epochs"], (name, results[name]["final_epoch"])
        assert not PARTIAL.search(logs[name]), (name, PARTIAL.search(logs[name])[0])
        assert "gradients averaged with 3 peers" in logs[name], name  # (B and C in one group: they reached each other)
    diffs = diffs_at_common_epochs(tmp_path, names)
    assert diffs and all(diff <= SWARM_ROUNDING for diff in diffs.values()), diffs  # equal at every common epoch
    assert_in_sync({name: read_params(tmp_path, name) for name in names})
