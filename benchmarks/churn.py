"""Churn: a swarm whose peers are SIGKILLed one after another and restarted with the same identity.

    python -m benchmarks.churn                  # 5 peers, 3.5 minutes, a kill every 10-20 s, and a churn-free run
    python -m benchmarks.churn --seconds 60     # shorter

Each peer is ``tests/swarm/peer_worker.py`` (the swarm tests' training peer). A kill hits the training process
only (SIGKILL), as a crash or the OOM killer would; its DHT process and p2pd must then exit by themselves. The
killed peer restarts at once with the same ``identity_path``. Peer "a" is never killed. A restarted peer's parameters
before its first step are compared with every other peer's parameters of the same epoch: it must equal one of them
(when hivemind's matchmaking split a round into two groups, the swarm holds two lineages until the next parameter
averaging joins them, and the peer downloaded one of them).

The report (:func:`run_churn`) says: kills survived, global epochs reached (against a churn-free run of the same
length in :func:`main`), each restarted peer's distance from the swarm before its first contribution, the live
peers' distance at the end (at the last epoch both recorded, see :func:`_diff_at_common_epoch`), whether every loss
stayed finite, and which processes of killed peers were left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import ROOT, spawner, worst, write_json
from collabopt import processes

WORKER = ROOT / "tests" / "swarm" / "peer_worker.py"
RESULTS = ROOT / "benchmarks" / "results"


def _env(initial_peers: str | None = None) -> dict[str, str]:
    env = processes.child_env("INFO", PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "swarm"), str(ROOT)]))
    if initial_peers:
        env["INITIAL_PEERS"] = initial_peers
    return env


def _progress(path: Path) -> int:
    try:
        return json.loads(path.read_text())["epoch"]
    except (OSError, ValueError, KeyError):
        return -1


def _descendants(pid: int) -> set[int]:
    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _alive(pids: set[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            pass
    return alive


def _max_diff(a: dict, b: dict) -> float:
    return worst(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _diff_at_common_epoch(final_a: dict, epochs_a: dict, final_b: dict, epochs_b: dict, target: int) -> float:
    """How far two live peers are apart at the end: at the last epoch both recorded, if it is the finish line or
    later, else their final parameters. Peers stop at different epochs: those at the finish line keep training
    until the last one gets there (often by a download, after which it stops at once), so comparing final
    parameters would compare different epochs."""
    common = [epoch for epoch in epochs_a if epoch in epochs_b and epoch >= target]
    if common:
        return _max_diff(epochs_a[max(common)], epochs_b[max(common)])
    return _max_diff(final_a, final_b)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def _rejoined(started: Path, proc: processes.Process) -> bool:
    """Whether a restarted peer is back in the swarm (it wrote ``started``); raises if it exited first."""
    if started.exists():
        return True
    if proc.poll() is not None:
        raise RuntimeError(f"{started.stem} exited before it rejoined:\n{proc.tail()}")
    return False


def run_churn(workdir: Path, *, peers: int = 5, seconds: float = 60.0, kills: int = 3,
              interval: tuple[float, float] = (10.0, 20.0), seed: int = 8, target_batch_size: int = 480,
              step_sleep: float = 0.05, settle_epochs: int = 2, run_id: str | None = None,
              options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``peers`` peers for ``seconds`` after the swarm's epoch 2, SIGKILLing a random peer (never the first)
    every ``interval`` seconds, at most ``kills`` times, restarting each at once with the same identity; then let
    every live peer train ``settle_epochs`` more epochs without churn and stop. ``options`` go to every peer's
    CollaborativeOptimizer (default: matchmaking_time 5 s, collabopt's default). Returns the report (see the module
    docstring)."""
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    slots = [chr(ord("a") + i) for i in range(peers)]
    slot_progress = {slot: workdir / f"slot_{slot}" for slot in slots}
    run_id = run_id or f"churn_{os.getpid()}_{int(time.time())}"
    base = dict(run_id=run_id, target_batch_size=target_batch_size, epochs=0, lr=0.3, step_sleep=step_sleep,
                model_seed=0, epochs_file=str(workdir / "target_epoch"), max_seconds=seconds + 240,
                finish_with=[str(path) for path in slot_progress.values()])
    bootstrap, initial_peers = processes.start_bootstrap(workdir, env=_env(), cwd=ROOT, spawn=spawner())
    live: dict[str, processes.Process] = {}
    names = {slot: slot for slot in slots}
    killed: list[tuple[str, set[int]]] = []
    restarted: list[str] = []

    def start(slot: str, name: str, **extra: Any) -> processes.Process:
        config = dict(base, seed=100 * len(killed) + slots.index(slot) + 1, out=str(workdir / name),
                      progress_file=str(slot_progress[slot]) + ".progress",
                      save_epoch_params=True,
                      options=dict({"matchmaking_time": 5.0, **(options or {})},
                                   identity_path=str(workdir / f"{slot}.id")), **extra)
        write_json(workdir / f"{name}.config.json", config)
        return processes.Process([sys.executable, str(WORKER), str(workdir / f"{name}.config.json")],
                                 workdir / f"{name}.log", env=_env(initial_peers), cwd=ROOT, spawn=spawner())

    def swarm_epoch() -> int:
        return max(_progress(Path(f"{p}.progress")) for p in slot_progress.values())

    try:
        for slot in slots:
            live[slot] = start(slot, slot, wait_peers=peers)
        _wait_for(lambda: min(_progress(Path(f"{p}.progress")) for p in slot_progress.values()) >= 2, 180,
                  "the swarm did not reach epoch 2")
        began = time.monotonic()
        # the swarm's epoch: the highest any peer reached (one peer can sit out averaging_timeout in a round whose
        # member was killed while the others go on: a fresh-clone run counted 2 epochs on peer a, 3 on the others)
        epoch_at_start = swarm_epoch()
        while len(killed) < kills and time.monotonic() - began < seconds:
            time.sleep(min(rng.uniform(*interval), max(0.0, seconds - (time.monotonic() - began))))
            if time.monotonic() - began >= seconds:
                break
            slot = rng.choice(slots[1:])
            victim = live[slot]
            if victim.poll() is not None:
                raise RuntimeError(f"{names[slot]} exited before its kill:\n{victim.tail()}")
            children = _descendants(victim.pid)
            os.kill(victim.pid, signal.SIGKILL)  # the training process only: its children must notice
            victim.wait(10)
            killed.append((names[slot], children))
            names[slot] = f"{slot}{len(killed)}"
            live[slot] = start(slot, names[slot])
            restarted.append(names[slot])
        time.sleep(max(0.0, seconds - (time.monotonic() - began)))
        epochs_reached = swarm_epoch() - epoch_at_start
        # the finish line is set once every restarted peer is back in the swarm: set before, it lay behind the epoch
        # a late restart joined at, and the peers stopped at different epochs, the last ones' rounds alone
        for slot in slots:
            if names[slot] in restarted:
                _wait_for(lambda slot=slot: _rejoined(workdir / f"{names[slot]}.started", live[slot]), 180,
                          f"{names[slot]} did not rejoin")
        target = max(_progress(Path(f"{p}.progress")) for p in slot_progress.values()) + settle_epochs
        (workdir / "target_epoch").write_text(str(target))
        deadline = time.monotonic() + 240
        codes = {slot: proc.wait(max(0.1, deadline - time.monotonic())) for slot, proc in live.items()}
        failed = {names[s]: code for s, code in codes.items() if code != 0}
        if failed:
            logs = "\n".join(f"{n}:\n{(workdir / f'{n}.log').read_text(errors='replace')[-3000:]}" for n in failed)
            raise RuntimeError(f"peers failed {failed}:\n{logs}")
        orphan_deadline = time.monotonic() + 30
        while any(_alive(children) for _, children in killed) and time.monotonic() < orphan_deadline:
            time.sleep(0.5)
        orphans = {name: _alive(children) for name, children in killed if _alive(children)}
    finally:
        for proc in live.values():
            proc.kill_tree()
        for _, children in killed:
            for pid in _alive(children):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        bootstrap.kill_tree()

    history = {name: torch.load(workdir / f"{name}.epochs.pt") for name in names.values()
               if (workdir / f"{name}.epochs.pt").exists()}
    restarts = []
    for name in restarted:  # some of them were killed again later: they wrote no result
        if not (workdir / f"{name}.started").exists():
            restarts.append(dict(name=name, start_epoch=None, diff_before_first_step=None))
            continue
        start_params = torch.load(workdir / f"{name}.start.pt")
        epoch = json.loads((workdir / f"{name}.started").read_text())["epoch"]
        diffs = [_max_diff(start_params, epochs[epoch]) for other, epochs in history.items()
                 if other != name and epoch in epochs]
        restarts.append(dict(name=name, start_epoch=epoch, diff_before_first_step=min(diffs) if diffs else None))
    finals = {slot: torch.load(workdir / f"{names[slot]}.pt") for slot in slots}
    results = {slot: json.loads((workdir / f"{names[slot]}.json").read_text()) for slot in slots}
    return dict(
        peers=peers, seconds=seconds, kills=len(killed), killed=[name for name, _ in killed], restarts=restarts,
        epochs_reached=epochs_reached, target_epoch=target,
        final_epochs={names[s]: r["final_epoch"] for s, r in results.items()},
        final_diff=worst(_diff_at_common_epoch(finals["a"], history.get(names["a"], {}), finals[slot],
                                               history.get(names[slot], {}), target) for slot in slots),
        finite=all(math.isfinite(r["final_loss"]) for r in results.values()),
        final_loss=results["a"]["final_loss"], orphans=orphans,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=210.0)
    parser.add_argument("--kills", type=int, default=20, help="at most this many kills")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="collabopt-churn-") as tmp:
        workdir = args.workdir or Path(tmp)
        calm = run_churn(workdir / "calm", peers=args.peers, seconds=args.seconds, kills=0)
        churn = run_churn(workdir / "churn", peers=args.peers, seconds=args.seconds, kills=args.kills)
    report = dict(churn=churn, churn_free=calm, epochs_ratio=churn["epochs_reached"] / max(1, calm["epochs_reached"]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_json(RESULTS / "churn.json", report)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
