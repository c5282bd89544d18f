"""Swarms in network namespaces (harness.testnet): real processes, links that are cut, limited or partitioned.

Needs root and iproute2. Elsewhere these tests skip with the reason; in CI (``CI`` set) they fail instead, so a
green CI run always includes them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from harness import testnet


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/net/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.swarm)
            item.add_marker(pytest.mark.net)


def install_tools() -> None:
    """As root on Debian, install what the test bed needs when it is missing (iproute2; nftables for NAT)."""
    missing = [package for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables"))
               if shutil.which(tool) is None]
    if not missing or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", *sorted(set(missing))], capture_output=True, timeout=300)


def require_testnet(nat: bool = False) -> None:
    install_tools()
    reason = testnet.unavailable_reason(nat)
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"network tests must run in CI: {reason}")
        pytest.skip(reason)


@pytest.fixture
def make_net():
    """``make_net(n, rate_mbit, nat, subnet)``: a TestNet of ``n`` peer namespaces (those in ``nat`` behind NAT),
    removed after the test."""
    nets = []

    def make(n: int, rate_mbit=None, nat=(), subnet: str = testnet.SUBNET) -> testnet.TestNet:
        require_testnet(nat=bool(nat))
        net = testnet.TestNet(n, rate_mbit, nat, subnet=subnet)
        nets.append(net)
        return net.__enter__()

    yield make
    for net in nets:
        net.__exit__(None, None, None)
