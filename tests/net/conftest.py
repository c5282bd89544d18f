"""Swarms in network namespaces (collabopt.testnet): real processes, links that are cut, limited or partitioned.

Needs root and iproute2. Elsewhere these tests skip with the reason; in CI (``CI`` set) they fail instead, so a
green CI run always includes them.
"""

from __future__ import annotations

import os

import pytest

from collabopt import testnet


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/net/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.swarm)
            item.add_marker(pytest.mark.net)


@pytest.fixture
def net3():
    """Three peer namespaces on one bridge (unlimited links) and one for the bootstrap peer."""
    reason = testnet.unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"network tests must run in CI: {reason}")
        pytest.skip(reason)
    with testnet.TestNet(3, None) as net:
        yield net
