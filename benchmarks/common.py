"""Shared helpers: machine/version info, robust statistics, model builders and running a benchmark module
(processes through :mod:`collabopt.processes`, the harness the tests and the demo use too)."""

from __future__ import annotations

import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from collabopt import processes
from collabopt.processes import Process

ROOT = Path(__file__).resolve().parents[1]


def machine_info() -> dict[str, Any]:
    """Machine, load and library versions, for the header of the report."""
    import hivemind
    import torch

    import collabopt

    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": round(load[0], 2),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        "collabopt": getattr(collabopt, "__version__", "?"),
        "git_commit": commit,
    }


def median(values: Sequence[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return float(statistics.median(values)) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    """``min..max`` of a sample, for the table."""
    values = [v for v in values if v == v]
    return f"{min(values):.3f}..{max(values):.3f}" if values else "-"


def worst(values: Iterable[float]) -> float:
    """The largest of ``values``; NaN if one is NaN (Python's max() keeps its running value against a NaN met after
    it: a peer holding NaN would pass a tolerance) or if there is none."""
    values = list(values)
    return float("nan") if not values or any(v != v for v in values) else max(values)


def make_mlp(params_target: int, width: int = 1024, in_dim: int = 256, out_dim: int = 16):
    """A ReLU MLP with about ``params_target`` parameters (a stack of ``width x width`` layers)."""
    import torch

    layers: list[torch.nn.Module] = [torch.nn.Linear(in_dim, width), torch.nn.ReLU()]
    count = in_dim * width + width + width * out_dim + out_dim
    while count + width * width + width <= params_target:
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        count += width * width + width
    layers.append(torch.nn.Linear(width, out_dim))
    return torch.nn.Sequential(*layers)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def write_json(path: str | Path, value: Any) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def spawner(netns: str | None = None) -> processes.Spawn | None:
    """How to start a benchmark process: forked from a launcher (``harness/launcher.py``) only where
    COLLABOPT_BENCHMARK_FORK=1 (the swarm tests set it; a user's run starts each process fresh: None), never into a
    netns."""
    if os.environ.get("COLLABOPT_BENCHMARK_FORK") != "1" or netns is not None:
        return None
    from harness import launcher

    return launcher.spawn


def child_env(**extra: str) -> dict[str, str]:
    """Environment for benchmark subprocesses: the harness's (one intra-op thread, no inherited peers), quiet
    hivemind, and the repository on PYTHONPATH (``python -m benchmarks.peer``)."""
    return processes.child_env("WARNING", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                               **extra)


def run_module(module: str, config: dict[str, Any], workdir: Path, timeout: float, name: str) -> dict[str, Any]:
    """Run ``python -m <module> <config.json>`` in a process of its own (:func:`spawner`); return the JSON it wrote to
    ``config['out']``."""
    config = dict(config, out=str(workdir / f"{name}.json"))
    config_path = workdir / f"{name}.config.json"
    write_json(config_path, config)
    log_path = workdir / f"{name}.log"
    with Process([sys.executable, "-m", module, str(config_path)], log_path, env=child_env(), cwd=ROOT,
                 spawn=spawner()) as proc:
        code = proc.wait(timeout)  # leaving the block kills what is left (stray hivemind children: p2pd, averagers)
    if code is None:
        raise RuntimeError(f"{module} ({name}) ran past {timeout:.0f} s; log: {log_path}")
    if code != 0 or not Path(config["out"]).exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{module} ({name}) exited with {code}; log ends with:\n{tail}")
    return json.loads(Path(config["out"]).read_text())


def seconds_per_step(params: int, width: int, in_dim: int, batch: int, steps: int = 20) -> float:
    """Median seconds of one forward+backward of the benchmark MLP on one thread (to size epochs)."""
    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_mlp(params, width=width, in_dim=in_dim)
        x, y = torch.randn(batch, in_dim), torch.randint(0, 16, (batch,))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            times.append(time.perf_counter() - start)
        return median(times[steps // 4:])
    finally:
        torch.set_num_threads(threads)


def ask_paused(proc: subprocess.Popen, command: str | None, where: str, timeout: float | None = None) -> dict[str, Any]:
    """Send ``command`` to a benchmark variant's process (its own session, stopped with SIGSTOP between rounds) and
    read its one-line JSON answer; after a ``round`` it is stopped again, so that the background work of the idle
    variants' swarms (DHT, tracker, averagers) does not run beside another's round. ``where`` tells the error where
    the variant's output is."""
    if command is not None:
        os.killpg(proc.pid, signal.SIGCONT)
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    if timeout is not None and not select.select([proc.stdout], [], [], timeout)[0]:
        raise RuntimeError(f"no answer in {timeout:.0f} s ({where})")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"exited with {proc.wait()} ({where})")
    if command == "round":
        os.killpg(proc.pid, signal.SIGSTOP)
    return json.loads(line)


def stop_paused(procs: Sequence[subprocess.Popen]) -> None:
    """End benchmark variants' processes: resumed, their input closed (they finish), killed if they do not."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGCONT)
            proc.stdin.close()
            proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
