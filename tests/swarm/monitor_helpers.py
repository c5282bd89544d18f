"""What the monitor tests share: a training peer that logs its own numbers (``monitor_worker.py``), ``collabopt
monitor --serve`` as a process, and reading its ``/api/state`` and ``/metrics``."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from helpers import HERE, Process, child_env

MONITOR_INTERVAL = 1.0  # seconds between the monitor's reads in the tests


def start_worker(tmp_path: Path, name: str, config: dict[str, Any], initial_peers: str) -> Process:
    """Start ``monitor_worker.py`` as peer ``name`` (files ``<tmp_path>/<name>.*``)."""
    config = dict(config, out=str(tmp_path / name))
    path = tmp_path / f"{name}.config.json"
    path.write_text(json.dumps(config))
    return Process([sys.executable, str(HERE / "monitor_worker.py"), str(path)], tmp_path / f"{name}.log",
                   env=child_env(INITIAL_PEERS=initial_peers))


def start_monitor(tmp_path: Path, run_id: str, initial_peers: str, timeout: float = 60.0) -> tuple[Process, str]:
    """``collabopt monitor --serve 127.0.0.1:0`` for ``run_id``; the process and the page's URL once it serves."""
    proc = Process([sys.executable, "-m", "collabopt", "monitor", "--run-id", run_id, "--initial-peers", initial_peers,
                    "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--serve", "127.0.0.1:0",
                    "--interval", str(MONITOR_INTERVAL)], tmp_path / "monitor.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"at (http://127\.0\.0\.1:\d+/)", proc.log())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill_tree()
    raise AssertionError(f"the monitor did not serve:\n{proc.log()[-3000:]}")


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def api_state(url: str) -> dict[str, Any]:
    return json.loads(get(url + "api/state"))


def prometheus(url: str) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` parsed: ``{(sample name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(get(url + "metrics").decode()):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def wait_state(url: str, condition, timeout: float, what: str) -> dict[str, Any]:
    """Poll ``/api/state`` until ``condition(state)``; the state (fails with the last one after ``timeout``)."""
    deadline = time.monotonic() + timeout
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = api_state(url)
        if condition(state):
            return state
        time.sleep(0.3)
    raise AssertionError(f"{what}: not seen within {timeout} s; last state: {json.dumps(state)[:4000]}")


def trace(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    """What peer ``name`` logged of itself (see ``monitor_worker.py``)."""
    path = tmp_path / f"{name}.trace"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_files(paths: list[Path], timeout: float, procs: dict[str, Process]) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{proc.log()[-4000:]}"
        assert time.monotonic() < deadline, f"not all of {[p.name for p in paths]} within {timeout} s"
        time.sleep(0.2)
