"""Faults and lifecycle on real swarms: lineages apart, partial rounds, a plain hivemind peer's download, Ctrl+C and
SIGTERM, NaNs.

Peers SIGKILLed mid-training (the survivors go on and end in sync; no process of a killed peer is left) are
test_churn's claim; a late joiner of another initialization that holds the swarm's parameters, bit-identical, before
its first contribution is test_swarm_schedules' (its plateau-offload case)."""

from __future__ import annotations

import json
import signal
import sys
import time

import psutil
import pytest
import torch
from helpers import (
    HERE,
    SWARM_ROUNDING,
    Process,
    child_env,
    finish,
    finish_line,
    max_param_diff,
    read_params,
    read_result,
    start_peer,
    unique_run_id,
    wait_for_file,
)

pytestmark = [pytest.mark.swarm, pytest.mark.slow]


# The swarm fills these tests' epochs (480-512 samples) in about 0.5 s: with the harness's matchmaking_time of 2 s
# every epoch waited about 1.5 s for its gradient round's group, and as long again for its parameter round. What they
# check does not depend on how long a round gathers its group, and groups of 3 peers on loopback form within a
# second, also in a fresh-clone suite. next_chunk_timeout 5 s: by default matchmaking_time for a model this small,
# and a member paused 1 s on a busy machine would be left out of a round's part (a fault these tests do not inject)
FAST_ROUNDS = dict(matchmaking_time=1.0, next_chunk_timeout=5.0)


def test_a_peer_of_another_lineage_adopts_the_majoritys_parameters(tmp_path, bootstrap):
    """Two lineages at the same epoch (a healed partition's sides, in small): a and b start from one model, c from
    another, and no parameter averaging runs (average_state_every=1000), so rounds of all three average only
    gradients and would keep c apart for good. The lineage check makes c download a's or b's state after its
    first gradient round: all three end in sync."""
    base = dict(run_id=unique_run_id("lineage"), target_batch_size=480, epochs=4, lr=0.3, step_sleep=0.05,
                wait_peers=3, finish_with=finish_line(tmp_path, "a", "b", "c"),
                options=dict(FAST_ROUNDS, average_state_every=1000))
    configs = {"a": dict(base, seed=1, model_seed=0), "b": dict(base, seed=2, model_seed=0),
               "c": dict(base, seed=3, model_seed=1)}
    procs = {name: start_peer(tmp_path, name, cfg, bootstrap) for name, cfg in configs.items()}
    finish(procs, 150)
    logs = {name: proc.log() for name, proc in procs.items()}
    judged = "parameters differ from those of 2 of the 3 peers of its gradient round at epoch 0"
    downloaded = "collabopt: downloaded the state of epoch"
    assert judged in logs["c"] and downloaded in logs["c"].split(judged)[1], logs["c"][-3000:]
    for name in "ab":  # the majority keeps its parameters; a later judgement of a or b is legitimate only after it
        # stepped alone (a gradient round that failed under load on 2 cores leaves it on its own lineage)
        first = logs[name].find("differ from those of")
        assert first == -1 or "steps with its own gradients" in logs[name][:first], logs[name][-3000:]
    params = {name: read_params(tmp_path, name) for name in configs}
    assert max_param_diff(params["a"], params["b"]) <= SWARM_ROUNDING
    assert max_param_diff(params["a"], params["c"]) <= SWARM_ROUNDING
    results = {name: read_result(tmp_path, name) for name in configs}
    assert all(result["final_epoch"] >= 4 for result in results.values())
    # the boundary's one outcome says so: c's first round applied the group's gradients and re-synchronizes
    first = {name: results[name]["rounds"][0] for name in configs}
    assert (first["c"]["epoch"], first["c"]["reason"], first["c"]["resync"]) == (0, "apart", True), first
    # (a or b may find part of that round's results lost: "partial", and re-synchronize; see test_diloco.results_cut)
    assert all(first[name]["reason"] in ("averaged", "no group", "partial") for name in "ab"), first


def test_peers_of_a_partial_round_adopt_the_parameters_of_the_peer_whose_round_was_whole(tmp_path, bootstrap):
    """C's reducer answers a round (from epoch 1 on) past hivemind's reducer timeout: A and B use their own gradients
    for C's part of the average, and the round still succeeds (hivemind: "received ...% results"), so A, B and C end it
    with three different sets of parameters. Without parameter averaging (average_state_every=1000) nothing brought
    them back together (a fresh-clone suite's lineage test ended 0.0066 apart this way). A and B know their round was
    partial; at their next round they download C's state (C's round was whole), and all three end in sync."""
    base = dict(run_id=unique_run_id("partial"), target_batch_size=480, epochs=6, model_seed=0, lr=0.3,
                step_sleep=0.05, wait_peers=3, finish_with=finish_line(tmp_path, "a", "b", "c"),
                options=dict(average_state_every=1000))
    configs = {"a": dict(base, seed=1), "b": dict(base, seed=2),
               "c": dict(base, seed=3, stall_reducer=dict(from_epoch=1, seconds=6.0))}
    procs = {name: start_peer(tmp_path, name, cfg, bootstrap) for name, cfg in configs.items()}
    finish(procs, 150)
    logs = {name: proc.log() for name, proc in procs.items()}
    assert "stalling the reducer of a gradient round" in logs["c"], logs["c"][-3000:]
    resynced = []
    for name in "ab":  # (which epoch's round: the first from epoch 1 on that gives C a part to reduce)
        partial = "of this peer's gradient round at epoch"
        assert partial in logs[name], logs[name][-3000:]
        after = logs[name].split(partial, 1)[1]
        # (how many peers hold the group's parameters varies: under load B also had a round of its own partial,
        # and both then read "2 peer(s)")
        if "last gradient round was partial, so its parameters are its own;" in after:
            assert "re-synchronized with its gradient round's parameters" in after, after[-3000:]
            resynced.append(name)
    # a peer whose parameters came out equal to C's anyway holds the lineage and needs no download (seen in 4 of 11
    # runs: one of A and B reported a partial round, yet at its next round its fingerprint was C's); at least one did
    assert resynced, {name: logs[name][-3000:] for name in "ab"}
    assert "differ from" not in logs["c"] and "last gradient round was partial" not in logs["c"], logs["c"][-3000:]
    params = {name: read_params(tmp_path, name) for name in configs}
    assert max_param_diff(params["a"], params["b"]) <= SWARM_ROUNDING
    assert max_param_diff(params["a"], params["c"]) <= SWARM_ROUNDING
    results = {name: read_result(tmp_path, name) for name in configs}
    assert all(result["final_epoch"] >= 6 for result in results.values())
    # each partial round is the outcome of its boundary: applied, and the peer re-synchronizes
    for name in "ab":
        assert any(r["reason"] == "partial" and r["applied"] and r["resync"] for r in results[name]["rounds"]), (
            results[name]["rounds"])


def test_a_plain_hivemind_peer_downloads_a_collabopt_peers_state(tmp_path, bootstrap):
    """hivemind names its RPC handlers after the averager's class: collabopt's state service answers downloads under
    hivemind's name (``<prefix>::TrainingStateAverager.rpc_download_state``) and advertises its state in hivemind's
    ``<prefix>.all_averagers`` record, so a plain hivemind peer of the run gets the state of a collabopt peer (it joins
    none of collabopt's averaging rounds)."""
    collab = start_peer(tmp_path, "collab", dict(run_id=unique_run_id("plain"), target_batch_size=64, epochs=3,
                                                 model_seed=0, lr=0.1, linger=60), bootstrap)
    try:
        assert wait_for_file(tmp_path / "collab.pt", 90), collab.log()[-3000:]
        config = tmp_path / "plain.config.json"
        config.write_text(json.dumps(dict(run_id=json.loads((tmp_path / "collab.config.json").read_text())["run_id"],
                                          out=str(tmp_path / "plain"), target_batch_size=64, model_seed=0, lr=0.1)))
        plain = Process([sys.executable, str(HERE / "plain_hivemind_worker.py"), str(config)], tmp_path / "plain.log",
                        env=child_env(INITIAL_PEERS=bootstrap))
        assert plain.wait(90) == 0, plain.log()[-3000:]
    finally:
        collab.kill_tree()
    epoch = json.loads((tmp_path / "plain.json").read_text())["epoch"]
    assert epoch >= 3, plain.log()[-3000:]
    assert max_param_diff(read_params(tmp_path, "plain"), read_params(tmp_path, "collab")) == 0.0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_a_peer_quickly_and_leaves_no_process(tmp_path, bootstrap, signum):
    cfg = dict(run_id=unique_run_id("signal"), target_batch_size=64, epochs=10_000, lr=0.1, step_sleep=0.02,
               max_seconds=300)
    peer = start_peer(tmp_path, "peer", cfg, bootstrap)
    try:
        assert wait_for_file(tmp_path / "peer.progress", 90), peer.log()[-3000:]
        peer.remember_descendants()
        children = psutil.Process(peer.pid).children(recursive=True)
        assert any("p2pd" in " ".join(c.cmdline()) for c in children), "expected a p2pd child to watch"
        assert len(children) >= 3  # DHT process, its p2pd, averager processes
        sent = time.monotonic()
        peer.signal(signum)
        code = peer.wait(10)  # the acceptance bound: it exits within 10 s
        elapsed = time.monotonic() - sent
        assert code is not None, f"peer still running 10 s after {signum!r}:\n{peer.log()[-3000:]}"
        # SIGTERM: SystemExit(143); SIGINT: KeyboardInterrupt, which Python ends by re-raising SIGINT (-2)
        expected = 128 + signal.SIGTERM if signum == signal.SIGTERM else -signal.SIGINT
        assert code == expected, (code, peer.log()[-2000:])
        deadline = time.monotonic() + 5
        while peer.descendants_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert peer.descendants_alive() == [], f"left behind: {peer.descendants_alive()}"
        print(f"{signum!r}: exited in {elapsed:.1f} s")
    finally:
        peer.kill_tree()


def test_unreachable_initial_peer_fails_clearly(monkeypatch):
    """A well-formed address nobody answers at: a SwarmConnectionError with advice, not a hang."""
    from collabopt import CollaborativeOptimizer, SwarmConnectionError

    monkeypatch.delenv("INITIAL_PEERS", raising=False)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nobody = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWJ7CitovXMdKJp8FY7EcxfuMcxBHcQotgYjYMNxQAiAkX"
    with pytest.raises(SwarmConnectionError, match="none of the initial peers answered"):
        CollaborativeOptimizer(opt, run_id="errors", target_batch_size=64, initial_peers=[nobody],
                               host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=3)


def all_finite(params: dict) -> bool:
    return all(bool(torch.isfinite(value).all()) for value in params.values())


def test_a_peer_with_nan_batches_does_not_poison_the_swarm(tmp_path, bootstrap):
    """Every 4th batch of C has a NaN or inf loss. Its guard drops the accumulations those batches poison: all peers
    end finite, in sync, and every sample is either contributed or counted as skipped (without the guard all 3
    ended NaN)."""
    run_id = unique_run_id("nan_batches")
    base = dict(run_id=run_id, target_batch_size=512, epochs=3, model_seed=0, lr=0.5, step_sleep=0.05,
                finish_with=finish_line(tmp_path, "a", "b", "c"), wait_peers=3, max_seconds=150, options=FAST_ROUNDS)
    procs = {
        "a": start_peer(tmp_path, "a", dict(base, seed=1), bootstrap),
        "b": start_peer(tmp_path, "b", dict(base, seed=2), bootstrap),
        "c": start_peer(tmp_path, "c", dict(base, seed=3, nan_every=4), bootstrap),
    }
    finish(procs, 180)
    results = {name: read_result(tmp_path, name) for name in procs}
    params = {name: read_params(tmp_path, name) for name in procs}
    for name, result in results.items():
        assert result["final_epoch"] >= 3, (name, result)
        assert all_finite(params[name]), name
        # Every sample is contributed, skipped (NaN/inf) or dropped by a step that downloaded first. C may download:
        # a drop lowers its count of the epoch (as hivemind's does after a GradScaler overflow), and a drop just
        # before the epoch's end can leave it out of the round the others start (seen once in CI: 16 samples).
        accounts = {key: result[key] for key in ("samples_fed", "samples_reported", "samples_skipped",
                                                 "samples_dropped", "downloaded_epochs", "rounds")}
        assert (result["samples_reported"] + result["samples_skipped"] + result["samples_dropped"]
                == result["samples_fed"]), (name, accounts)
        assert not result["samples_dropped"] or result["downloaded_epochs"], (name, accounts)
    assert results["a"]["samples_dropped"] == results["b"]["samples_dropped"] == 0
    assert results["c"]["nonfinite_steps"] >= 5 and results["c"]["samples_skipped"] > 0
    assert results["a"]["nonfinite_steps"] == results["b"]["nonfinite_steps"] == 0
    assert max_param_diff(params["a"], params["b"]) <= SWARM_ROUNDING
    assert max_param_diff(params["a"], params["c"]) <= SWARM_ROUNDING


def test_nan_from_an_unguarded_peer_is_never_applied(tmp_path, bootstrap):
    """R runs without the guard (as plain hivemind or an older collabopt would) and sends NaN gradients. The reducers
    of its rounds refuse its parts (they log the refusal, so the poison reached a round): A and B end finite and
    equal to each other.

    averaging_timeout is 10 s, not the harness's 30 s. In one fresh-clone suite A began epoch 3's global step 0.07 s
    after entering epoch 3, while R was downloading and B was at the finish line: its gradient round and then its
    parameter round each waited out the timeout alone (60 s; the test took 75 s instead of ~16 s)."""
    run_id = unique_run_id("nan_rogue")
    base = dict(run_id=run_id, target_batch_size=512, epochs=3, model_seed=0, lr=0.5, step_sleep=0.05,
                finish_with=finish_line(tmp_path, "a", "b", "r"), wait_peers=3, max_seconds=150,
                options=dict(FAST_ROUNDS, averaging_timeout=10.0))
    procs = {
        "a": start_peer(tmp_path, "a", dict(base, seed=1), bootstrap),
        "b": start_peer(tmp_path, "b", dict(base, seed=2), bootstrap),
        "r": start_peer(tmp_path, "r", dict(base, seed=3, nan_every=20,
                                            options=dict(FAST_ROUNDS, averaging_timeout=10.0,
                                                         nonfinite_guard=False)),
                        bootstrap),
    }
    finish(procs, 180)
    results = {name: read_result(tmp_path, name) for name in procs}
    params = {name: read_params(tmp_path, name) for name in procs}
    for name in ("a", "b"):
        assert all_finite(params[name]), name
        assert results[name]["final_epoch"] >= 3, (name, results[name])
    # the poison reached a round and a reducer refused it. Not necessarily A's and B's: in one fresh-clone suite A's
    # log had no refusal (B's and R's had), and in a local run B's had none (not traced: which reducer sees R's
    # non-finite values varies from run to run, also with every element of R's gradients NaN)
    assert any("reducer refused parts of a gradient round" in (tmp_path / f"{name}.log").read_text()
               for name in procs), "no reducer refused a NaN part: did R send NaN?"
    assert max_param_diff(params["a"], params["b"]) <= SWARM_ROUNDING
