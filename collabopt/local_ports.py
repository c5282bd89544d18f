"""Whether a fixed listening port is already held on this machine, told before a libp2p daemon starts on it.

A libp2p daemon on its defaults listens with ``SO_REUSEPORT``: a second peer given the port of such a peer on the same
machine starts anyway, the kernel then shares the incoming connections of that port between the two processes, and the
new peer's join fails only after the bootstrap's timeout, as "none of the initial peers answered" (a pasted join line
that carries ``--port`` does exactly this on the first peer's machine). A daemon collabopt starts listens without it
unless the user set ``LIBP2P_TCP_REUSEPORT`` (:func:`collabopt.engine.p2p.p2pd_environment`): on a port already held it
exits with a bare ``P2PDaemonError``, as any daemon does on a port another program holds. A test bind without
``SO_REUSEPORT`` fails in every case, so the error can name the port and the fix before anything starts.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

from collabopt.errors import SwarmConnectionError

PORT_FIX = ("give this peer another port (--port PORT with the examples and the collabopt commands, "
            "host_maddrs=['/ip4/0.0.0.0/tcp/PORT'] in your own script), or none for a free one: two peers of one "
            "machine need two ports")


def taken_ports(host_maddrs: Sequence[str] | None) -> list[str]:
    """The addresses of ``host_maddrs`` with a fixed TCP port that a socket of this machine already listens on.

    An address that is not ``/ip4|ip6/<address>/tcp/<port>``, port 0 (a free port), or one this machine cannot bind
    for another reason (an address that is not its own) is left to the daemon, which reports it.

    >>> taken_ports(["/ip4/0.0.0.0/tcp/0", "/dns4/example.org/tcp/31337"])
    []
    """
    taken = []
    for maddr in host_maddrs or ():
        parts = str(maddr).split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or not parts[4].isdigit():
            continue
        port = int(parts[4])
        if port == 0:
            continue
        family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # a closed connection's TIME_WAIT holds no port for a listener: only a listening socket fails this bind
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((parts[2], port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    taken.append(str(maddr))
    return taken


def check_ports_free(host_maddrs: Sequence[str] | None) -> None:
    """Raise :class:`SwarmConnectionError` naming the port and the fix when :func:`taken_ports` finds one."""
    taken = taken_ports(host_maddrs)
    if taken:
        raise SwarmConnectionError(
            f"host_maddrs: {', '.join(taken)}: this port is already in use on this machine (by a peer that runs "
            f"here, or another program). Fix: {PORT_FIX}")
