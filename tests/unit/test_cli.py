"""The command line without a swarm: bad input is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_refuses_bad_peers_before_starting():
    env = {k: v for k, v in os.environ.items() if k != "INITIAL_PEERS"}
    proc = subprocess.run([sys.executable, "-m", "collabopt", "dht", "--initial-peers", "/ip4/1.2.3/tcp/1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "initial_peers" in proc.stderr and "Fix:" in proc.stderr


def test_monitor_without_initial_peers_says_what_to_pass():
    env = {k: v for k, v in os.environ.items() if k != "INITIAL_PEERS"}
    proc = subprocess.run([sys.executable, "-m", "collabopt", "monitor", "--run-id", "x"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("collabopt monitor: --initial-peers: none given") and "Fix:" in proc.stderr


def test_bare_command_prints_the_commands():
    proc = subprocess.run([sys.executable, "-m", "collabopt"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "collabopt demo" in proc.stdout and "collabopt doctor --initial-peers" in proc.stdout
    assert "``" not in proc.stdout, "plain text, not reStructuredText"


def test_monitor_report_of_a_run_nobody_trains_says_to_check_the_run_id():
    from collabopt.cli import report_text

    text = report_text(dict(run_id="typo", num_peers=0, global_epoch=0, samples_accumulated=0,
                            samples_per_second=0.0, peers=[]))
    assert text.splitlines()[0] == "run typo: 0 peers, epoch 0, 0 samples this epoch, 0.0 samples/s"
    assert "is --run-id the run_id the peers use?" in text
