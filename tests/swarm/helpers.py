"""Test conveniences for real swarms on loopback, on top of :mod:`collabopt.processes` (the process harness the
demo and the benchmarks use too): a bootstrap DHT, peer processes, their results, and the checks the tests share.

:class:`Process` adds to the harness's process what the fault tests check: which descendants (DHT, p2pd,
averagers) a peer had, and whether any of them outlived it. Every process is forked from the harness's launcher
(``harness.launcher``: torch, numpy and hivemind imported once, not by each peer); one in a network
namespace then moves itself there (``tests/net/in_netns.py``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import worst
from benchmarks.swarmrun import SWARM_ROUNDING
from collabopt import processes
from harness import launcher

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WORKER = HERE / "peer_worker.py"
IN_NETNS = ROOT / "tests" / "net" / "in_netns.py"


def finish_line(tmp_path: Path, *names: str) -> list[str]:
    """``finish_with`` for a worker config: it trains on until every named peer reached the last epoch too (see
    ``peer_worker.at_finish_line``: hivemind may count a round one epoch later on one peer)."""
    return [str(tmp_path / name) for name in names]


def unique_run_id(name: str) -> str:
    """A run id no earlier test used (stale DHT records of a reused run id confuse new peers)."""
    return f"{name}_{uuid.uuid4().hex[:10]}"


def child_env(**extra: str) -> dict[str, str]:
    """The harness's child environment with hivemind logging every averaging round (INFO, for the logs of failed
    tests), one intra-op thread, and this folder on PYTHONPATH (the workers import each other)."""
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return processes.child_env("INFO", OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, **extra)


class Process(processes.Process):
    """A harness process (``[sys.executable, script or "-m" module, ...]``) forked from the launcher in the repository
    root, inside network namespace ``netns`` if given, which remembers its descendants."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None, netns: str | None = None,
                 preload: tuple[str, ...] = ()):
        if netns is not None:  # not `ip netns exec`: a fresh interpreter imports torch and hivemind again
            args = [args[0], str(IN_NETNS), netns, *args[1:]]
        super().__init__(args, log_path, env=env or child_env(), cwd=ROOT,
                         spawn=functools.partial(launcher.spawn, preload=preload))
        self._descendants: set[int] = set()

    def remember_descendants(self) -> None:
        with contextlib.suppress(psutil.Error):
            self._descendants |= {c.pid for c in psutil.Process(self.pid).children(recursive=True)}

    def descendants_alive(self) -> list[int]:
        alive = []
        for pid in self._descendants:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        return alive

    def signal(self, signum: int) -> None:
        self.remember_descendants()
        super().signal(signum)

    def kill_tree(self) -> None:
        """Kill the process group and any remembered descendant that left it."""
        self.remember_descendants()
        for pid in self.descendants_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        super().kill_tree()


def start_bootstrap(tmp_path: Path, host: str = "127.0.0.1", netns: str | None = None) -> tuple[processes.Process, str]:
    """Start ``collabopt dht`` on ``host`` (loopback by default; log: ``<tmp_path>/bootstrap.log``), inside network
    namespace ``netns`` if given; return it and its INITIAL_PEERS."""
    if netns is None:
        return processes.start_bootstrap(tmp_path, host=host, env=child_env(), cwd=ROOT, spawn=launcher.spawn)
    # processes.start_bootstrap's command, forked into the namespace as Process does
    peers_file = tmp_path / "bootstrap.initial_peers"
    peers_file.unlink(missing_ok=True)
    proc = Process([sys.executable, "-m", "collabopt", "dht", "--host-maddrs", f"/ip4/{host}/tcp/0", "--peers-file",
                    str(peers_file)], tmp_path / "bootstrap.log", netns=netns)
    deadline = time.monotonic() + 60
    while not (peers_file.exists() and peers_file.read_text().strip()):  # written whole (renamed into place)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill_tree()
            raise RuntimeError(f"the bootstrap DHT exited or did not serve within 60 s; its log ends with:\n"
                               f"{proc.tail()}")
        time.sleep(0.2)
    return proc, peers_file.read_text().strip()


def start_peer(tmp_path: Path, name: str, config: dict[str, Any], initial_peers: str,
               netns: str | None = None) -> Process:
    """Start ``peer_worker.py`` with ``config`` (inside network namespace ``netns`` if given); its results go to
    ``<tmp_path>/<name>.json`` / ``.pt``."""
    config = dict(config, out=str(tmp_path / name))
    config_path = tmp_path / f"{name}.config.json"
    config_path.write_text(json.dumps(config))
    return Process(
        [sys.executable, str(WORKER), str(config_path)],
        tmp_path / f"{name}.log",
        env=child_env(INITIAL_PEERS=initial_peers),
        netns=netns,
    )


def read_result(tmp_path: Path, name: str) -> dict[str, Any]:
    path = tmp_path / f"{name}.json"
    if not path.exists():
        log = (tmp_path / f"{name}.log").read_text(errors="replace")
        raise AssertionError(f"peer {name} wrote no result; its log ends with:\n{log[-4000:]}")
    return json.loads(path.read_text())


def read_params(tmp_path: Path, name: str):
    import torch

    return torch.load(tmp_path / f"{name}.pt")


def wait_all(procs: dict[str, processes.Process], timeout: float) -> dict[str, int | None]:
    deadline = time.monotonic() + timeout
    codes = {}
    for name, proc in procs.items():
        codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
    return codes


def finish(procs: dict[str, processes.Process], timeout: float) -> None:
    """Wait for every process, kill what is left of them (with their children), and fail unless all exited 0.

    One still running at ``timeout`` first gets SIGUSR1: a peer worker writes every thread's stack to its log (where
    the failure's message shows it: what it waited for); another kind of worker ends on it."""
    try:
        codes = wait_all(procs, timeout)
        running = [procs[name] for name, code in codes.items() if code is None]
        for proc in running:
            proc.signal(signal.SIGUSR1)
        if running:
            time.sleep(1.0)  # (faulthandler writes the stacks at once)
    finally:
        for proc in procs.values():
            proc.kill_tree()
    failed = {name: code for name, code in codes.items() if code != 0}
    ended = {name: f"still ran after {timeout:.0f} s" if code is None else f"exited with {code}"
             for name, code in failed.items()}
    logs = (f"{name} {ended[name]}:\n{procs[name].log()[-8000:]}" for name in failed)
    assert not failed, "\n".join(logs)


def max_param_diff(a: dict, b: dict) -> float:
    """The largest difference between two peers' parameters; NaN if either holds a NaN (no tolerance passes it)."""
    return worst(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def rounds_log(tmp_path: Path, name: str, lines: int = 30) -> str:
    """The last ``lines`` of peer ``name``'s log about its rounds, epochs and warnings, for assertion messages."""
    keep = ("Averaged", "averaging", "received", "Transitioning", "Proceeding", "collabopt", "WARN", "ERROR")
    log = (tmp_path / f"{name}.log").read_text(errors="replace").splitlines()
    return "\n".join([line[:200] for line in log if any(k in line for k in keep)][-lines:])


def progress_epoch(tmp_path: Path, name: str) -> int:
    """The epoch peer ``name`` last wrote to ``<name>.progress`` (-1 before its first)."""
    try:
        return json.loads((tmp_path / f"{name}.progress").read_text())["epoch"]
    except (OSError, ValueError, KeyError):
        return -1


def wait_for_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.1)
    return False


def train_node_with_peer(tmp_path: Path, node: Process, *, run_id: str, target_batch_size: int, epochs: int,
                         lr: float, initial_peers: str) -> tuple[dict, dict, dict]:
    """Run a started 2-rank ``node`` (results ``node.rank0/1``) with a plain peer that joins once the node is in
    the swarm, then check what "one node = one peer" means; return the results of rank 0, rank 1 and the peer.

    The node's config needs ``finish_with=finish_line(tmp_path, "peer")``.
    Checked: 2 peers in the swarm (3 if every rank had joined), the last epoch reached everywhere, every sample fed
    on either rank reported once, the ``exponential`` LR schedule (lr, gamma 0.7) per global epoch on both ranks,
    ranks bit-identical, the peer equal to the node to :data:`SWARM_ROUNDING`, and the parameters trained.
    """
    import pytest
    import torch
    from schedulers import reference_lrs

    if not wait_for_file(tmp_path / "node.rank0.ready", 90):
        node.kill_tree()
        pytest.fail(f"the node did not start:\n{node.log()[-5000:]}")
    peer = start_peer(tmp_path, "peer", dict(run_id=run_id, target_batch_size=target_batch_size, epochs=epochs,
                                             lr=lr, scheduler="exponential", model_seed=0, batch_sizes=[16],
                                             step_sleep=0.05, max_seconds=150, wait_peers=2,
                                             finish_with=finish_line(tmp_path, "node")), initial_peers)
    finish({"node": node, "peer": peer}, timeout=170)

    r0, r1 = (read_result(tmp_path, f"node.rank{rank}") for rank in (0, 1))
    peer_result = read_result(tmp_path, "peer")
    assert r0["type"] == r1["type"] == "NodeOptimizer"
    assert r0["max_num_peers"] == r1["max_num_peers"] == 2, (r0, r1)
    # counted at its epochs: after its finish line the peer may read the swarm once the node has left (1 peer)
    assert peer_result["max_peers_seen"] == 2
    assert r0["final_epoch"] == r1["final_epoch"] >= epochs and peer_result["final_epoch"] >= epochs
    assert abs(r0["final_epoch"] - peer_result["final_epoch"]) <= 1  # see peer_worker.at_finish_line
    assert r0["samples_reported"] == r1["samples_reported"] == r0["samples_fed"] + r1["samples_fed"]
    assert r0["samples_fed"] > 0 and r1["samples_fed"] > 0
    expected = reference_lrs("exponential", lr, epochs + 2)
    for r in (r0, r1):
        for epoch, value in r["lrs"].items():
            assert value == pytest.approx(expected[int(epoch)], rel=1e-12), (r["rank"], epoch)
        assert r["get_lr"] == pytest.approx(expected[r["final_epoch"]], rel=1e-12)
    p0, p1, pp = (read_params(tmp_path, name) for name in ("node.rank0", "node.rank1", "peer"))
    assert max_param_diff(p0, p1) == 0.0
    assert max_param_diff(p0, pp) <= SWARM_ROUNDING
    assert max_param_diff(p0, torch.load(tmp_path / "peer.start.pt")) > 1e-3
    return r0, r1, peer_result


def read_epoch_params(tmp_path: Path, name: str) -> dict[int, dict]:
    """Peer ``name``'s parameters right after each epoch change (its config needs ``save_epoch_params``)."""
    import torch

    return torch.load(tmp_path / f"{name}.epochs.pt")


def diffs_at_common_epochs(tmp_path: Path, names: list[str] | tuple[str, ...], since: int = 0,
                           results: dict[str, dict] | None = None,
                           diff: Callable[[dict, dict], float] = max_param_diff) -> dict[int, float]:
    """At every epoch ``>= since`` that every peer of ``names`` recorded (``save_epoch_params``), the largest
    parameter difference (``diff``) between any of them and the first. With ``results`` (the peers' ``<name>.json``),
    an epoch a peer reached by a state download (``downloaded_epochs``) is left out: the state served with delayed
    updates is one update ahead of the servers' own parameters (see test_swarm_schedules)."""
    params = {name: read_epoch_params(tmp_path, name) for name in names}
    skip = set().union(*(results[name].get("downloaded_epochs", ()) for name in names)) if results else set()
    common = sorted(set.intersection(*(set(p) for p in params.values())) - skip)
    first = params[names[0]]
    return {epoch: worst(diff(first[epoch], params[name][epoch]) for name in names[1:])
            for epoch in common if epoch >= since}
