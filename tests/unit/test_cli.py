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
