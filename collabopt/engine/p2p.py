"""Starting hivemind's DHT and libp2p daemons the way collabopt's peers, ``collabopt dht`` and ``doctor`` need.

Every DHT that is not a client also serves the dial-back check of :mod:`collabopt.engine.dialback`, so that
``collabopt doctor`` on another machine can learn whether that machine is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.proto import dht_pb2
from hivemind.utils import logging as hivemind_logging

from collabopt.engine.compat import Multiaddr
from collabopt.engine.dialback import DIALBACK_PROTOCOL, serve_dialback
from collabopt.engine.relay_daemon import RelayDaemon, split_options
from collabopt.lifeline import children_follow_parent
from collabopt.membership import swarm_key_of

logger = logging.getLogger(__name__)


class _HivemindHandlerUnlessConfigured(logging.Handler):
    """Hands a record to hivemind's own handler while the application has configured no logging (the root logger
    has no handler); otherwise the record propagates to the application's handlers only."""

    def __init__(self, target: logging.Handler):
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.target.handle(record)


def log_like_hivemind() -> None:
    """collabopt's log lines in hivemind's format and at ``HIVEMIND_LOGLEVEL`` while the application configured no
    logging: otherwise collabopt's status lines (INFO with ``verbose=True``, like hivemind's) were dropped and its
    warnings printed without a time, between hivemind's timed lines. A level set on the ``collabopt`` logger is kept."""
    hivemind_logging.get_logger("hivemind")  # hivemind creates its handler on first use
    target = getattr(hivemind_logging, "_default_handler", None)
    ours = logging.getLogger("collabopt")
    if target is None or any(isinstance(h, _HivemindHandlerUnlessConfigured) for h in ours.handlers):
        return
    ours.addHandler(_HivemindHandlerUnlessConfigured(target))
    if ours.level == logging.NOTSET:
        ours.setLevel(hivemind_logging.loglevel)


# What every p2pd collabopt starts finds in its environment (:func:`p2pd_environment`)
P2PD_ENVIRONMENT = {"LIBP2P_TCP_REUSEPORT": "false"}


@contextlib.contextmanager
def p2pd_environment() -> Iterator[None]:
    """While a libp2p daemon starts (a DHT's process forks inside), its environment holds :data:`P2PD_ENVIRONMENT`,
    where the user did not set those variables: libp2p dials from ephemeral ports, not from its listening port.

    Why: dialing from the listening port (``SO_REUSEPORT``, libp2p's default), two peers that dial each other at the
    same moment (the members of a new group do, as its round begins) get one TCP connection by simultaneous open, on
    which both act as the initiator; the security handshake fails on both sides, and each backs off from the other's
    address for seconds ("dial backoff"). Dials from ephemeral ports cannot meet. See docs/decisions.md, "Dials from
    ephemeral ports" (and its cost: observed addresses).
    """
    added = [name for name in P2PD_ENVIRONMENT if name not in os.environ]
    os.environ.update({name: P2PD_ENVIRONMENT[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def start_dht(**kwargs: Any) -> Any:
    """Start a ``hivemind.DHT``; unless it is a client, it also serves collabopt's dial-back check. With
    ``trusted_relays`` its libp2p daemon is collabopt's (:class:`~collabopt.engine.relay_daemon.RelayDaemon`)."""
    daemon = None
    if kwargs.get("trusted_relays"):
        daemon, kwargs = _start_relay_daemon(kwargs)
    try:
        # the DHT process (and its p2pd, where it starts one) end with this process, even on SIGKILL
        with children_follow_parent(), p2pd_environment():
            dht = hivemind.DHT(start=True, p2p=daemon, **kwargs)
    except BaseException:
        if daemon is not None:
            daemon.stop()
        raise
    if daemon is not None:
        daemon.release()  # (the DHT's process is connected to it now)
        daemon.follow(dht)
    if not kwargs.get("client_mode"):
        try:
            dht.run_coroutine(functools.partial(_add_dialback_handler, swarm_key_of(dht)))
        except Exception as e:  # a convenience for others' diagnosis: never a reason not to start
            logger.debug("collabopt: could not serve the dial-back check: %r", e)
    return dht


def _start_relay_daemon(kwargs: dict[str, Any]) -> tuple[RelayDaemon, dict[str, Any]]:
    """A started daemon for a DHT given ``trusted_relays`` (static relays, no p2pd bootstrap), connected to the
    initial peers, and the DHT's own arguments. See docs/decisions.md, "Static relays"."""
    options, dht_kwargs = split_options(kwargs)
    environment = {name: value for name, value in P2PD_ENVIRONMENT.items() if name not in os.environ}
    peers = kwargs.get("initial_peers") or ()
    daemon = RelayDaemon(options, bool(kwargs.get("client_mode")), environment, peers)
    try:
        daemon.hold(functools.partial(_connect_initial_peers, initial_peers=peers, timeout=daemon.timeout) if peers
                    else _connected, timeout=2 * daemon.timeout)
    except BaseException:
        daemon.stop()
        raise
    return daemon, dht_kwargs


async def _connected(_p2p: Any) -> None:
    """(no initial peers: nothing to connect to)"""


async def _connect_initial_peers(p2p: Any, initial_peers: Sequence[Any], timeout: float) -> None:
    """Connect a started ``p2p`` to ``initial_peers`` (full multiaddrs): return once one answers (the others go on
    connecting while ``p2p``'s loop runs; the DHT's bootstrap pings them all anyway); shut ``p2p`` down and raise as
    p2pd's bootstrap does if none answers within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline, errors = loop.time() + timeout, []
    pending = {asyncio.ensure_future(connect(p2p, str(maddr))) for maddr in initial_peers}
    for task in pending:  # whatever the outcome, nobody waits for it after an early return
        task.add_done_callback(lambda task: task.cancelled() or task.exception())
    while pending:
        done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                           return_when=asyncio.FIRST_COMPLETED)
        if not done:
            errors.append(f"{len(pending)} gave no answer in {timeout} s")
            break
        for task in done:
            if task.exception() is None:
                return
            errors.append(task.exception())
    for task in pending:
        task.cancel()
    await p2p.shutdown()
    raise P2PDaemonError(f"failed to connect to bootstrap peers: {errors}")


async def _add_dialback_handler(key: Any, _dht: Any, node: Any) -> None:
    handler = functools.partial(serve_dialback, key=key, own_id=node.p2p.peer_id.to_bytes())
    await node.p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, handler)


# ---- libp2p for `collabopt doctor`: a daemon of its own, no DHT


async def _daemon_listen_maddr(_dht: Any, node: Any) -> Any:
    return node.p2p.daemon_listen_maddr


async def own_replica(dht: Any) -> Any:
    """A connection of this process to ``dht``'s libp2p daemon for one service alone. ``dht.replicate_p2p()`` gives
    every caller in a process the same replica, whose handlers run in the event loop of the first caller: two
    services in two threads would then serve each other's requests, and the first to stop would shut the other's
    connection down. (``dht.run_coroutine`` blocks: call this in the service's thread.)"""
    maddr = dht.run_coroutine(_daemon_listen_maddr)
    return await P2P.replicate(maddr)


async def create_p2p(**kwargs: Any) -> Any:
    """Start a libp2p daemon (``hivemind.P2P``) that listens like a peer would, without a DHT."""
    with p2pd_environment():
        return await P2P.create(**kwargs)


async def visible_maddrs(p2p: Any) -> list[Any]:
    return await p2p.get_visible_maddrs()


async def shutdown_p2p(p2p: Any) -> None:
    await p2p.shutdown()


def peer_id_of(maddr: str) -> Any:
    """The ``PeerID`` of a full multiaddr (``.../p2p/<id>``)."""
    return PeerID.from_base58(Multiaddr(maddr)["p2p"])


_peer_id = peer_id_of


async def connect(p2p: Any, maddr: str) -> None:
    """Open a libp2p connection to the peer at full multiaddr ``maddr`` (raises when it fails)."""
    await connect_to(p2p, _peer_id(maddr), [maddr])


async def connect_to(p2p: Any, peer_id: Any, maddrs: Sequence[str]) -> None:
    """Open a libp2p connection to ``peer_id`` at any of ``maddrs`` (full multiaddrs, or without ``/p2p/``)."""
    suffix = Multiaddr(f"/p2p/{peer_id}")
    addrs = [Multiaddr(m).decapsulate(suffix) if m.endswith(str(suffix)) else Multiaddr(m) for m in maddrs]
    await p2p._client.connect(peer_id, addrs)


class UnsignedAnswer(Exception):
    """A DHT answered a request signed with a swarm key without signing its answer with that key: an open swarm."""


async def dht_ping(p2p: Any, maddr: str, timeout: float = 10.0, authorizer: Any = None) -> float:
    """Ping the DHT of the peer at ``maddr`` without joining it (no sender info: it adds nobody to its routing
    table); return the peer's DHT time. With ``authorizer`` (a swarm's ``SwarmKeyAuthorizer``) the ping is signed
    and an answer not signed with the same key raises :class:`UnsignedAnswer`. A DHT that refuses the ping (it
    needs another key, or one) raises ``P2PHandlerError`` (see :func:`refused`)."""
    request = dht_pb2.PingRequest()
    if authorizer is not None:
        await authorizer.sign_request(request, None)
    response = await asyncio.wait_for(p2p.call_protobuf_handler(
        _peer_id(maddr), "DHTProtocol.rpc_ping", request, dht_pb2.PingResponse), timeout)
    if authorizer is not None and not await authorizer.validate_response(response, request):
        raise UnsignedAnswer(f"{maddr} answered without this swarm key's signature: it is an open swarm's peer")
    return float(response.dht_time)


def refused(error: BaseException) -> bool:
    """Whether ``error`` (of :func:`dht_ping`) is a DHT's refusal of a request: hivemind's servicer answers a
    request its authorizer refuses with nothing, which reaches the caller as a handler error at once."""
    return isinstance(error, P2PHandlerError) and "SerializeToString" in str(error)


async def membership_verdict(maddrs: Sequence[str], authorizer: Any, timeout: float = 5.0) -> str | None:
    """Why the DHTs at ``maddrs`` refuse this peer, asked at once over a libp2p daemon of its own (at most
    ``timeout`` seconds each); None where none of them answered, or all accepted its ping (then the cause is
    elsewhere). ``authorizer``: this peer's (None: no key)."""

    async def verdict(p2p: Any, maddr: str) -> str | None:
        async def connect_and_ping() -> None:
            await connect(p2p, maddr)
            await dht_ping(p2p, maddr, timeout, authorizer)

        try:
            await asyncio.wait_for(connect_and_ping(), timeout)
        except UnsignedAnswer:
            return ("this peer set swarm_key, but the swarm it joins has no key (an open swarm): drop swarm_key, or "
                    "start every peer of the swarm with the same one")
        except Exception as e:
            if refused(e):
                return ("the swarm refused this peer's swarm_key: it is not the swarm's key; pass the key the swarm's "
                        "peers use (the same on every peer)" if authorizer is not None else
                        "the swarm refused this peer: it admits members only; pass its key as swarm_key= (or "
                        "COLLABOPT_SWARM_KEY, or --swarm-key-file)")
        return None

    p2p = await create_p2p(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        verdicts = await asyncio.gather(*(verdict(p2p, str(maddr)) for maddr in maddrs))
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
    return next((v for v in verdicts if v is not None), None)


async def open_stream(p2p: Any, maddr: str, protocol: str) -> tuple[Any, Any]:
    """A binary stream to ``protocol`` of the peer at ``maddr``: its (reader, writer)."""
    _info, reader, writer = await p2p.call_binary_stream_handler(_peer_id(maddr), protocol)
    return reader, writer
