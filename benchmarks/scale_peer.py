"""One peer of benchmark B7 (:mod:`benchmarks.scale`), run as its own OS process.

A ``member`` trains a tiny model with :class:`~collabopt.CollaborativeOptimizer` (synchronous mode, compute simulated
by sleeping) and measures a window of whole global epochs: its DHT traffic (:mod:`benchmarks.dht_traffic`), the CPU
seconds of its processes (training, DHT, averagers, p2pd), its boundaries (collabopt's status lines) and the rounds
its steps returned (``StepResult.round``: group sizes). It writes its record when the window ends and trains on until
the runner's stop file appears (late joiners download from it meanwhile).

A ``joiner`` starts its optimizer when the runner's join file appears (the 4 joiners of a swarm at once) and times
its download of the swarm's state.

Usage: ``python -m benchmarks.scale_peer config.json``; writes ``config['out']`` (JSON).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F

from benchmarks import dht_traffic
from benchmarks.common import write_json
from benchmarks.peer import record_status


def _wait_for(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def process_cpu(opt: Any) -> dict[str, float]:
    """CPU seconds (user + system) of this peer's processes: ``main`` (training loop, progress tracker and metrics
    threads), ``dht`` (the DHT node), ``averagers`` (gradient and state averager), ``p2pd`` (the transport of both),
    ``other``."""
    loop = opt._peer.loop
    # (collabopt's gradient rounds run in a thread of the main process: no process of their own)
    averagers = {getattr(a, "pid", None) for a in (loop.grad_averager, loop.state_averager)} - {None}
    me = psutil.Process()
    out = dict(main=0.0, dht=0.0, averagers=0.0, p2pd=0.0, other=0.0)
    for proc in [me, *me.children(recursive=True)]:
        try:
            times, name = proc.cpu_times(), proc.name()
        except psutil.Error:  # ended meanwhile
            continue
        kind = ("main" if proc.pid == me.pid else "dht" if proc.pid == opt.dht.pid else
                "averagers" if proc.pid in averagers else "p2pd" if "p2pd" in name else "other")
        out[kind] += times.user + times.system
    return out


def _build(cfg: dict[str, Any], model: torch.nn.Module) -> Any:
    from collabopt import CollaborativeOptimizer

    return CollaborativeOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"],
        batch_size=cfg["batch"], initial_peers=cfg["initial_peers"], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        matchmaking_time=cfg["matchmaking_time"], averaging_timeout=cfg["averaging_timeout"], verbose=True,
        print_join_message=False, **cfg.get("options", {}))


def snapshot(opt: Any) -> dict[str, Any]:
    return dict(time=time.time(), epoch=opt.local_epoch, dht=dht_traffic.snapshot(), calls=dht_traffic.calls(),
                cpu=process_cpu(opt))


def member(cfg: dict[str, Any]) -> None:
    """Train; measure ``measure_epochs`` epochs after ``warmup_epochs``; train on until the stop file appears."""
    model = torch.nn.Linear(16, 4)
    g = torch.Generator().manual_seed(cfg.get("seed", 0))
    x, y = torch.randn(cfg["batch"], 16, generator=g), torch.randint(0, 4, (cfg["batch"],), generator=g)
    status = record_status()
    opt = _build(cfg, model)
    opt.wait_for_peers(cfg["peers"], timeout=cfg.get("join_timeout", 180))  # a first epoch with the whole swarm
    ready = time.time()
    Path(cfg["ready_file"]).touch()
    _wait_for(cfg["go_file"], cfg.get("join_timeout", 180))
    steps: list[tuple[float, float, float, int]] = []  # (start, compute s, step() s, epoch after)
    rounds: list[dict[str, Any]] = []
    marks: list[dict[str, Any]] = []  # snapshots at the window's start and end
    deadline = time.monotonic() + cfg["max_seconds"]
    written = False
    try:
        while time.monotonic() < deadline and not Path(cfg["stop_file"]).exists():
            start = time.time()
            time.sleep(cfg["compute_seconds"])
            F.cross_entropy(model(x), y).backward()
            compute = time.time() - start
            result = opt.step()
            opt.zero_grad()
            end = time.time()
            steps.append((start, compute, end - start - compute, opt.local_epoch))
            if result.round is not None:
                r = result.round
                rounds.append(dict(time=end, epoch=r.epoch, applied=r.applied, reason=r.reason,
                                   group_size=r.group_size, num_peers=r.num_peers,
                                   parameters_averaged=r.parameters_averaged))
            if result.epoch_changed and not marks and opt.local_epoch >= cfg["warmup_epochs"]:
                marks.append(snapshot(opt))
            if (len(marks) == 1 and result.epoch_changed
                    and opt.local_epoch >= marks[0]["epoch"] + cfg["measure_epochs"]):
                marks.append(snapshot(opt))
            if len(marks) == 2 and not written:
                write_json(cfg["out"], dict(role="member", ready=ready, steps=steps, rounds=rounds, marks=marks,
                                            status=status.events, num_peers=opt.num_peers, batch=cfg["batch"],
                                            target_batch_size=cfg["target_batch_size"]))
                written = True
        if not written:
            write_json(cfg["out"], dict(role="member", error=f"the window did not end in {cfg['max_seconds']} s "
                                        f"(epoch {opt.local_epoch}, {len(marks)} marks)", steps=steps,
                                        rounds=rounds, status=status.events))
    finally:
        opt.close()


def _time_phases() -> dict[str, float]:
    """Wall times at which this process's DHT and its peer (loop, averagers) were up: where a joiner's start goes."""
    from collabopt import swarm
    from collabopt.engine.peer import HivemindPeer

    phases: dict[str, float] = {}
    start_dht, build_peer = swarm.start_dht, HivemindPeer.__init__

    def timed_start_dht(*args: Any, **kwargs: Any) -> Any:
        phases["dht_start"] = time.time()
        try:
            return start_dht(*args, **kwargs)
        finally:
            phases["dht_up"] = time.time()

    def timed_build_peer(self: Any, *args: Any, **kwargs: Any) -> None:
        build_peer(self, *args, **kwargs)
        phases["peer_up"] = time.time()

    swarm.start_dht, HivemindPeer.__init__ = timed_start_dht, timed_build_peer
    return phases


def joiner(cfg: dict[str, Any]) -> None:
    """Join when the join file appears; time the download of the swarm's state (during the optimizer's start, or
    the first one after it)."""
    from collabopt.engine.peer import HivemindPeer

    downloads: list[tuple[float, float, int]] = []  # (start, end, epoch after)
    download = HivemindPeer.load_state_from_peers

    def timed_download(self: Any) -> None:
        start = time.time()
        try:
            download(self)
        finally:
            downloads.append((start, time.time(), self.local_epoch))

    HivemindPeer.load_state_from_peers = timed_download
    phases = _time_phases()
    model = torch.nn.Linear(16, 4)
    torch.optim.SGD(model.parameters(), lr=0.01)  # the first optimizer imports torch._dynamo: 1 s, not the swarm's
    Path(cfg["ready_file"]).touch()
    if not _wait_for(cfg["go_file"], cfg.get("join_timeout", 600)):
        raise RuntimeError("no join file")
    joined = time.time()
    opt = _build(cfg, model)
    built = time.time()
    try:
        wait_until = time.monotonic() + cfg.get("sync_timeout", 60)
        while opt.local_epoch < max(1, opt.global_epoch) and time.monotonic() < wait_until:
            if opt.global_epoch > opt.local_epoch:
                opt.load_state_from_peers()
            else:
                time.sleep(0.1)  # the tracker has not seen the swarm yet
        synced = time.time() if opt.local_epoch >= max(1, opt.global_epoch) else None
        write_json(cfg["out"], dict(role="joiner", joined=joined, built=built, synced=synced, downloads=downloads,
                                    phases=phases, epoch=opt.local_epoch, global_epoch=opt.global_epoch,
                                    num_peers=opt.num_peers))
    finally:
        opt.close()


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every peer starts from the same parameters
    dht_traffic.install(cfg["run_id"])
    dht_traffic.count_calls(cfg["run_id"])
    (member if cfg["role"] == "member" else joiner)(cfg)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip hivemind's noisy interpreter-exit finalizers; everything was shut down above
