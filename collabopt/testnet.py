"""A private test network for the tests and the benchmarks: one network namespace per peer, joined by a bridge,
links optionally limited with ``tc tbf``, and cut / restored on demand (:meth:`TestNet.cut`).

Everything lives in namespaces this module creates (the bridge too, in a "hub" namespace), on addresses that exist
only there, with no route out, so no test traffic can reach any other network. Needs Linux, root and iproute2.
``with TestNet(...)`` removes every namespace on exit, also after an error, Ctrl+C or SIGTERM; namespaces left by a
killed run are removed the next time one starts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from typing import Any

PREFIX = "conet"
SUBNET = "10.213.7"  # 10.213.7.0/24, private, exists only inside our namespaces


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why the WAN test bed cannot run here, or ``None`` when it can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); run as root to include the network tests and benchmarks"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found; install iproute2 (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except (subprocess.SubprocessError, OSError) as e:
        return f"cannot create a network namespace ({getattr(e, 'stderr', '') or e})"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Remove namespaces left by benchmark runs whose process is gone."""
    listing = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+)\S*)", listing, flags=re.M):
        full, pid = name
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _ip("netns", "del", full, check=False)
        except PermissionError:
            pass


class TestNet:
    """``n`` peer namespaces (``.peers[i]`` with address ``.addr[i]``) plus one unlimited namespace for a bootstrap.

    ``rate_mbit`` limits each peer's upload and download (tbf on both ends of its link): one rate for all, or one
    per peer (``None``: unlimited).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, n: int, rate_mbit: float | list[float | None] | None):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.hub = f"{self.tag}h"
        self.peers = [f"{self.tag}p{i}" for i in range(n)]
        self.bootstrap = f"{self.tag}b"
        self.addr = [f"{SUBNET}.{i + 10}" for i in range(n)]
        self.bootstrap_addr = f"{SUBNET}.2"
        self.rates = list(rate_mbit) if isinstance(rate_mbit, (list, tuple)) else [rate_mbit] * n
        self._created: list[str] = []
        self._old_handlers: dict[int, Any] = {}

    def __enter__(self) -> TestNet:
        remove_stale()
        for sig in (signal.SIGTERM, signal.SIGHUP):  # turn them into exceptions so that __exit__ runs
            self._old_handlers[sig] = signal.signal(sig, _raise_interrupt)
        try:
            self._create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _create(self) -> None:
        self._add_ns(self.hub)
        for bridge in ("br0", "br1"):  # br1 holds the far side of a partition
            _ip("-n", self.hub, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.hub, "link", "set", bridge, "up")
        links = [(self.bootstrap, self.bootstrap_addr, None)] + [
            (ns, addr, rate) for ns, addr, rate in zip(self.peers, self.addr, self.rates, strict=True)
        ]
        for i, (ns, addr, rate) in enumerate(links):
            self._add_ns(ns)
            hub_end = f"v{i}"
            _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", hub_end, "master", "br0")
            _ip("-n", self.hub, "link", "set", hub_end, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if rate:
                for where, dev in ((ns, "eth0"), (self.hub, hub_end)):  # upload, download
                    burst = max(32, int(rate * 1e6 / 8 / 250 / 1024) * 2)  # KiB: two timer ticks of data
                    subprocess.run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                    f"{rate}mbit", "burst", f"{burst}kb", "latency", "100ms"],
                                   check=True, capture_output=True, text=True, timeout=30)

    def _hub_end(self, peer: int) -> str:
        return f"v{peer + 1}"  # v0 is the bootstrap's link

    def cut(self, peer: int) -> None:
        """Take peer ``peer``'s link down: nothing reaches it or leaves it until :meth:`restore`."""
        _ip("-n", self.hub, "link", "set", self._hub_end(peer), "down")

    def restore(self, peer: int) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_end(peer), "up")

    def partition(self, far_side: list[int]) -> None:
        """Split the network in two: the peers in ``far_side`` reach each other only (the bootstrap stays with the
        others). :meth:`heal` joins the two sides again."""
        for peer in far_side:
            _ip("-n", self.hub, "link", "set", self._hub_end(peer), "master", "br1")

    def heal(self) -> None:
        for peer in range(len(self.peers)):
            _ip("-n", self.hub, "link", "set", self._hub_end(peer), "master", "br0")

    def __exit__(self, *exc: Any) -> None:
        for name in reversed(self._created):
            _ip("netns", "del", name, check=False)
        self._created.clear()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
