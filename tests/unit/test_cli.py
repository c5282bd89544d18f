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
