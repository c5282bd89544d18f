"""Swarms in network namespaces (collabopt.testnet): real processes, links that are cut, limited or partitioned.

Needs root and iproute2. Elsewhere these tests skip with the reason; in CI (``CI`` set) they fail instead, so a
green CI run always includes them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from collabopt import testnet


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/net/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.swarm)
            item.add_marker(pytest.mark.net)


def install_iproute2() -> None:
    """As root on Debian, install what the test bed needs when it is missing."""
    if shutil.which("ip") and shutil.which("tc") or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", "iproute2"], capture_output=True, timeout=300)


@pytest.fixture
def net3():
    """Three peer namespaces on one bridge (unlimited links) and one for the bootstrap peer."""
    install_iproute2()
    reason = testnet.unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"network tests must run in CI: {reason}")
        pytest.skip(reason)
    with testnet.TestNet(3, None) as net:
        yield net
