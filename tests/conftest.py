"""Shared fixtures. The test helpers (swarm.py, schedulers.py) are imported as plain modules from this folder."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarm import start_bootstrap  # noqa: E402


@pytest.fixture
def bootstrap(tmp_path):
    """A bootstrap DHT (``collabopt dht``) on loopback for this test; yields its INITIAL_PEERS value."""
    proc, initial_peers = start_bootstrap(tmp_path)
    yield initial_peers
    proc.kill_tree()
