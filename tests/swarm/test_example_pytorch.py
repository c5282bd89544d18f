"""examples/pytorch_loop.py runs as a peer of a swarm: two copies train together, and it resumes."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from helpers import ROOT, Process, child_env, start_bootstrap, unique_run_id, wait_all

pytestmark = pytest.mark.swarm
EXAMPLE = str(ROOT / "examples" / "pytorch_loop.py")


def test_two_copies_of_the_example_train_together_and_resume(tmp_path):
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    run_id = unique_run_id("example")
    args = ["--run-id", run_id, "--epochs", "3", "--target-batch-size", "1024", "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0"]
    procs = {
        name: Process([sys.executable, EXAMPLE, *args, "--seed", str(i), "--min-peers", "2",
                       "--checkpoint", str(tmp_path / f"{name}.pt")],
                      tmp_path / f"{name}.log", env=child_env(INITIAL_PEERS=initial_peers))
        for i, name in enumerate(["first", "second"])
    }
    try:
        codes = wait_all(procs, 240)
    finally:
        for proc in [*procs.values(), bootstrap]:
            proc.kill_tree()
    assert codes == {"first": 0, "second": 0}, {n: p.log()[-3000:] for n, p in procs.items()}
    for proc in procs.values():
        reports = re.findall(r"^epoch (\d+): (\d+) peers", proc.log(), re.MULTILINE)
        assert reports and int(reports[-1][0]) >= 3, proc.log()[-2000:]
        assert re.search(r": 2 peers", proc.log()), proc.log()[-2000:]
        lines = re.findall(r"^epoch \d+: .*$", proc.log(), re.MULTILINE)
        numbers = [int(line.split()[1].rstrip(":")) for line in lines]
        for i in range(1, len(lines)):  # a line per global epoch, unless it says it caught up with the swarm
            assert numbers[i] == numbers[i - 1] + 1 or "caught up" in lines[i], lines
        # a clean exit prints nothing alarming (hivemind's tracker used to leave a pending asyncio task behind)
        assert "Task was destroyed but it is pending" not in proc.log(), proc.log()[-2000:]
    saved = torch.load(tmp_path / "first.pt")
    assert saved["optimizer"]["local_epoch"] >= 3

    # resume alone from the checkpoint: it continues from the saved epoch (and would join a running swarm)
    resumed = Process([sys.executable, EXAMPLE, *args[:2], "--epochs", str(saved["optimizer"]["local_epoch"] + 1),
                       "--target-batch-size", "256", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                       "--checkpoint", str(tmp_path / "first.pt")], tmp_path / "resumed.log", env=child_env())
    try:
        assert resumed.wait(120) == 0, resumed.log()[-3000:]
    finally:
        resumed.kill_tree()
    assert f"resumed from {tmp_path / 'first.pt'} at epoch {saved['optimizer']['local_epoch']}" in resumed.log()
