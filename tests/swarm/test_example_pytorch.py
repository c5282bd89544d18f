"""examples/pytorch_loop.py runs as a peer of a swarm: two copies train together, a third joins with the command the
first printed (pasted into a plain shell), and one resumes."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch
from helpers import ROOT, Process, child_env, start_bootstrap, unique_run_id, wait_all

from collabopt import processes

pytestmark = pytest.mark.swarm
EXAMPLE = str(ROOT / "examples" / "pytorch_loop.py")
EPOCHS = 3


def example(tmp_path, name: str, args: list[str], seed: int, min_peers: int, initial_peers: str) -> Process:
    return Process([sys.executable, EXAMPLE, *args, "--seed", str(seed), "--min-peers", str(min_peers),
                    "--checkpoint", str(tmp_path / f"{name}.pt")],
                   tmp_path / f"{name}.log", env=child_env(INITIAL_PEERS=initial_peers))


def pasted_join_line(tmp_path, log: str) -> processes.Process:
    """The join command ``log`` printed, run as a user pastes it into a shell with no environment activated (its
    own seed and checkpoint file appended: the last of a repeated switch wins)."""
    line = re.search(r"^ +(INITIAL_PEERS=\S+ .*)$", log, re.MULTILINE).group(1)
    assert "examples/pytorch_loop.py --run-id" in line, line
    own = f" --seed 2 --min-peers 1 --checkpoint {tmp_path / 'joiner.pt'}"
    return processes.Process(["env", "-i", "PATH=/usr/bin:/bin", f"HOME={os.environ.get('HOME', '/')}",
                              "HIVEMIND_LOGLEVEL=INFO", "OMP_NUM_THREADS=1", "bash", "-c", line + own],
                             tmp_path / "joiner.log", cwd=ROOT)


def test_two_copies_of_the_example_train_together_a_third_joins_and_one_resumes(tmp_path):
    """The getting-started guide with the example's defaults: two copies start together, a third joins once they
    are at epoch 1, with the command the first printed, pasted into a plain shell (no activated environment). The
    defaults make an epoch longer than matchmaking_time (no short-epoch warning); the joiner downloads the state
    once, nobody logs an error, and all three end the last epoch bit-identical."""
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    run_id = unique_run_id("example")
    # 3 epochs: the joiner joins at epoch 1 (it downloads the state) and ends at least one epoch in a round with the
    # others (a 4th epoch cost 10-14 s of the suite and checked nothing more)
    args = ["--run-id", run_id, "--epochs", str(EPOCHS), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    procs = {name: example(tmp_path, name, args, i, 2, initial_peers) for i, name in enumerate(["first", "second"])}
    try:
        deadline = time.monotonic() + 180
        while not re.search(r"^epoch [1-9]:", procs["first"].log(), re.MULTILINE) and time.monotonic() < deadline:
            time.sleep(0.1)
        procs["joiner"] = pasted_join_line(tmp_path, procs["first"].log())
        codes = wait_all(procs, 240)
    finally:
        for proc in [*procs.values(), bootstrap]:
            proc.kill_tree()
    logs = {name: proc.log() for name, proc in procs.items()}
    assert codes == {"first": 0, "second": 0, "joiner": 0}, {n: log[-3000:] for n, log in logs.items()}
    for log in logs.values():
        reports = re.findall(r"^epoch (\d+): (\d+) peers", log, re.MULTILINE)
        assert reports and int(reports[-1][0]) == EPOCHS, log[-2000:]
        assert re.search(r": [23] peers", log), log[-2000:]
        assert "Traceback" not in log and "[ERROR]" not in log, log[-3000:]
        assert "fills an epoch in" not in log, log[-3000:]  # the defaults' epochs are longer than matchmaking_time
    # one download, the joiner's (collabopt's state service logs each state it installs)
    downloaded = "collabopt: downloaded the state of epoch"
    assert logs["joiner"].count(downloaded) == 1, logs["joiner"][-3000:]
    assert downloaded not in logs["first"] + logs["second"], (logs["first"][-3000:], logs["second"][-3000:])
    models = {name: torch.load(tmp_path / f"{name}.pt")["model"] for name in procs}
    for name in ("second", "joiner"):
        assert all(torch.equal(models["first"][key], models[name][key]) for key in models["first"]), name
    for proc in procs.values():
        lines = re.findall(r"^epoch \d+: .*$", proc.log(), re.MULTILINE)
        numbers = [int(line.split()[1].rstrip(":")) for line in lines]
        for i in range(1, len(lines)):  # a line per global epoch, unless it says it caught up with the swarm
            assert numbers[i] == numbers[i - 1] + 1 or "caught up" in lines[i], lines
        # a clean exit prints nothing alarming (hivemind's tracker used to leave a pending asyncio task behind)
        assert "Task was destroyed but it is pending" not in proc.log(), proc.log()[-2000:]
    saved = torch.load(tmp_path / "first.pt")
    assert saved["optimizer"]["local_epoch"] == EPOCHS

    # resume alone from the checkpoint: it continues from the saved epoch (and would join a running swarm). Its one
    # epoch's round looks for a group for matchmaking_time: 1 s, not the default's 5 s, alone
    resumed = Process([sys.executable, EXAMPLE, *args[:2], "--epochs", str(saved["optimizer"]["local_epoch"] + 1),
                       "--target-batch-size", "256", "--matchmaking-time", "1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                       "--checkpoint", str(tmp_path / "first.pt")], tmp_path / "resumed.log", env=child_env())
    try:
        assert resumed.wait(120) == 0, resumed.log()[-3000:]
    finally:
        resumed.kill_tree()
    assert f"resumed from {tmp_path / 'first.pt'} at epoch {saved['optimizer']['local_epoch']}" in resumed.log()
