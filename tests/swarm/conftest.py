"""Fixtures of the swarm tests; every test in this folder is marked ``swarm`` (``-m "not swarm"`` skips them all).

The helpers (helpers.py, schedulers.py, the workers) are importable through pytest's ``pythonpath`` setting
(pyproject.toml); the worker processes get this folder on PYTHONPATH from ``helpers.child_env``.
"""

from pathlib import Path

import pytest
from helpers import start_bootstrap

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.swarm)


@pytest.fixture
def bootstrap(tmp_path):
    """A bootstrap DHT (``collabopt dht``) on loopback for this test; yields its INITIAL_PEERS value."""
    proc, initial_peers = start_bootstrap(tmp_path)
    yield initial_peers
    proc.kill_tree()
