"""A fixed port that a process of this machine already listens on is refused before a daemon starts, in one line
that names the port and the fix (collabopt.local_ports); a port that is free, or only in TIME_WAIT, is not."""

from __future__ import annotations

import contextlib
import socket

import pytest

from collabopt import swarm
from collabopt.doctor import FAIL, SKIP, DoctorOptions, run_checks
from collabopt.errors import SwarmConnectionError
from collabopt.local_ports import taken_ports

PEER = "/ip4/10.0.0.2/tcp/31337/p2p/12D3KooWCxv9C3e6qv91uDww31w8bJovEcFDUJXA8UxqW1q6Z81H"


@contextlib.contextmanager
def listening_like_libp2p():
    """A loopback listener with SO_REUSEPORT, as libp2p's on its defaults: such a daemon could listen on it too."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener, f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}"


def test_a_port_a_listener_holds_is_taken_and_free_once_it_closed_even_in_time_wait():
    with listening_like_libp2p() as (listener, maddr):
        assert taken_ports(["/ip4/127.0.0.1/tcp/0", maddr]) == [maddr]
        with socket.create_connection(listener.getsockname()) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the listening side closes first: its port's connection stays in TIME_WAIT
            client.recv(1)
    assert taken_ports([maddr]) == []


def test_a_peer_on_a_taken_port_is_refused_before_its_daemon_starts(monkeypatch):
    monkeypatch.setattr(swarm.p2p, "start_dht", lambda **kwargs: pytest.fail("the daemon started"))
    with listening_like_libp2p() as (_, maddr), pytest.raises(SwarmConnectionError) as raised:
        swarm.start_dht(swarm.SwarmOptions(host_maddrs=[maddr], initial_peers=[PEER]))
    message = str(raised.value)
    assert message.startswith(f"host_maddrs: {maddr}: this port is already in use on this machine")
    assert "--port PORT" in message and "host_maddrs=['/ip4/0.0.0.0/tcp/PORT']" in message


def test_doctor_fails_a_taken_port_and_checks_no_network():
    with listening_like_libp2p() as (_, maddr):
        checks = run_checks(DoctorOptions(initial_peers=[PEER], host_maddrs=[maddr]))
    by_name = {c.name: c for c in checks}
    assert by_name["--host-maddrs"].status == FAIL and "already in use" in by_name["--host-maddrs"].detail
    assert "--port PORT" in by_name["--host-maddrs"].fix
    assert by_name["network"].status == SKIP
