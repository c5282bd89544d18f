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


@pytest.fixture(scope="module")
def _module_bootstrap(tmp_path_factory):
    """The bootstrap DHT of one test module's ``bootstrap`` fixture: started at the first use, started again if it
    exited, killed at the module's end (its log: ``<basetemp>/bootstrap<N>/bootstrap.log``)."""
    running: list = []

    def initial_peers() -> str:
        if not running or running[0][0].poll() is not None:
            if running:
                running.pop()[0].kill_tree()
            running.append(start_bootstrap(tmp_path_factory.mktemp("bootstrap")))
        return running[0][1]

    yield initial_peers
    for proc, _ in running:
        proc.kill_tree()


@pytest.fixture
def bootstrap(_module_bootstrap):
    """A bootstrap DHT (``collabopt dht``) on loopback; its INITIAL_PEERS value.

    Shared by the tests of a module (a start costs a DHT's start, and 1.5-2 s more where it is not forked from the
    launcher: the import of torch and hivemind): the tests do not see each other through it. Every test trains under
    its own run id (``helpers.unique_run_id``), and all a swarm finds in the DHT is keyed by its run id (progress
    records, matchmaking keys); every peer of a test is killed when the test ends, and a new peer that is handed the
    address of one of them drops it from its routing table at the first failed contact (on loopback the dial is
    refused at once)."""
    return _module_bootstrap()
