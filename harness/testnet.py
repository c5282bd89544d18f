"""A private test network for the tests and the benchmarks: one network namespace per peer, joined by a bridge,
links optionally limited with ``tc tbf``, cut / restored (:meth:`TestNet.cut`) or partitioned on demand, and peers
optionally behind NAT (a masquerading router namespace of their own: they connect out, nothing connects in).

Everything lives in namespaces this module creates (the bridge too, in a "hub" namespace), on addresses that exist
only there, with no route out, so no test traffic can reach any other network. Needs Linux, root and iproute2
(and nftables for NAT). ``with TestNet(...)`` removes every namespace on exit, also after an error, Ctrl+C or
SIGTERM; namespaces left by a killed run are removed the next time one starts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

PREFIX = "conet"
SUBNET = "10.213.7"  # 10.213.7.0/24, private, exists only inside our namespaces
RESERVED_SUBNET = "192.0.2"  # TEST-NET-1 (RFC 5737), as on machines whose only address lies in a reserved range


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason(nat: bool = False) -> str | None:
    """Why the WAN test bed cannot run here (with NAT routers if ``nat``), or ``None`` when it can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); run as root to include the network tests and benchmarks"
    for tool in ("ip", "tc") + (("nft",) if nat else ()):
        if shutil.which(tool) is None:
            package = "nftables" if tool == "nft" else "iproute2"
            return f"`{tool}` not found; install {package} (apt-get install {package})"
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
    per peer (``None``: unlimited). ``subnet``: the first three octets of the addresses on the bridge (a /24 that
    exists only in these namespaces; ``RESERVED_SUBNET``: a reserved range, as on some machines). ``fair``: each
    limited link shares its rate evenly among the other ends (see :func:`_fair_queues`); by default its tbf keeps one
    FIFO queue, where TCP streams share unevenly. ``congestion``: the TCP congestion
    control of every namespace (``None``: the host's default, which new namespaces inherit). Each peer in ``nat``
    sits behind a router namespace of its own that masquerades its outgoing connections and drops every incoming
    one: ``.addr[i]`` is then its private address (10.213.1xx.2, unknown to the others), ``.public_addr[i]`` the
    router's address the others see.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, n: int, rate_mbit: float | list[float | None] | None = None, nat: list[int] | tuple = (),
                 subnet: str = SUBNET, fair: bool = False, congestion: str | None = None):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.hub = f"{self.tag}h"
        self.peers = [f"{self.tag}p{i}" for i in range(n)]
        self.bootstrap = f"{self.tag}b"
        self.public_addr = [f"{subnet}.{i + 10}" for i in range(n)]
        self.nat = sorted(set(nat))
        if any(not 0 <= i < n for i in self.nat):
            raise ValueError(f"nat={list(nat)}: peer indices must be in 0..{n - 1}")
        self.addr = [_private_addr(i) if i in self.nat else self.public_addr[i] for i in range(n)]
        self.bootstrap_addr = f"{subnet}.2"
        self.rates = list(rate_mbit) if isinstance(rate_mbit, (list, tuple)) else [rate_mbit] * n
        self.fair = fair
        self.congestion = congestion
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
        if self.congestion and _ip("netns", "exec", name, "sysctl", "-qw",
                                   f"net.ipv4.tcp_congestion_control={self.congestion}", check=False).returncode:
            allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip()
            raise RuntimeError(f"a namespace may not use TCP congestion control {self.congestion!r}: the host allows "
                               f"{allowed!r} (sysctl net.ipv4.tcp_allowed_congestion_control)")

    def _create(self) -> None:
        self._add_ns(self.hub)
        for bridge in ("br0", "br1"):  # br1 holds the far side of a partition
            _ip("-n", self.hub, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.hub, "link", "set", bridge, "up")
        uplinks = [self._router(i) if i in self.nat else ns for i, ns in enumerate(self.peers)]
        links = [(self.bootstrap, self.bootstrap_addr, None)] + [
            (ns, addr, rate) for ns, addr, rate in zip(uplinks, self.public_addr, self.rates, strict=True)
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
                others = [a for a in self.public_addr if a != addr]
                for where, dev, field in ((ns, "eth0", "dst"), (self.hub, hub_end, "src")):  # upload, download
                    burst = max(32, int(rate * 1e6 / 8 / 250 / 1024) * 2)  # KiB: two timer ticks of data
                    _tc(where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{rate}mbit",
                        "burst", f"{burst}kb", "latency", "100ms")
                    if self.fair:
                        _fair_queues(where, dev, field, others, packets=max(10, int(rate * 1e6 / 8 * 0.1 / 1514)))
        for i in self.nat:
            self._create_nat(i)

    def _router(self, peer: int) -> str:
        return f"{self.tag}r{peer}"

    def _create_nat(self, peer: int) -> None:
        """Put peer ``peer`` behind its router: a private link, a default route through it, masquerade out, and a
        forward policy that lets in only replies to connections the peer opened."""
        router, ns = self._router(peer), self.peers[peer]
        gateway = _private_addr(peer, host=1)
        self._add_ns(ns)
        _ip("-n", router, "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", router, "addr", "add", f"{gateway}/24", "dev", "eth1")
        _ip("-n", router, "link", "set", "eth1", "up")
        _ip("-n", ns, "addr", "add", f"{self.addr[peer]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "add", "default", "via", gateway)
        subprocess.run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                       check=True, capture_output=True, text=True, timeout=30)
        subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=_NAT_RULES,
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


_NAT_RULES = """
table ip nat {
    chain postrouting { type nat hook postrouting priority 100; oifname "eth0" masquerade; }
}
table ip filter {
    chain forward { type filter hook forward priority 0; policy drop;
        ct state established,related accept; iifname "eth1" oifname "eth0" accept; }
}
"""


def _tc(where: str, *args: str) -> None:
    subprocess.run(["tc", "-n", where, *args], check=True, capture_output=True, text=True, timeout=30)


def _fair_queues(where: str, dev: str, field: str, others: list[str], packets: int) -> None:
    """Under the link's tbf, one queue per other end (by ``field``, "dst" or "src" address) and one for the rest,
    served in turn a packet at a time: the flow fairness of fq_codel or fq (what most hosts and home routers run), per
    peer, with only HTB and u32, which kernels without those qdiscs still have. The classes' rate is far above the
    link's, so tbf alone sets the pace; each queue holds ``packets``, the FIFO's 100 ms at the link's rate."""
    _tc(where, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "2:", "htb", "default", "1")
    for k, addr in enumerate([None, *others], start=1):
        _tc(where, "class", "add", "dev", dev, "parent", "2:", "classid", f"2:{k}", "htb", "rate", "10gbit",
            "quantum", "1514")
        _tc(where, "qdisc", "add", "dev", dev, "parent", f"2:{k}", "pfifo", "limit", str(packets))
        if addr:
            _tc(where, "filter", "add", "dev", dev, "parent", "2:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", field, f"{addr}/32", "flowid", f"2:{k}")


def _private_addr(peer: int, host: int = 2) -> str:
    return f"10.213.{100 + peer}.{host}"


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
