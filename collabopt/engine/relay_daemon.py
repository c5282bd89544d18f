"""The libp2p daemon of a peer that reaches the swarm through trusted relays: collabopt starts it itself.

Rules, and why (docs/decisions.md, "Static relays"):

* It runs hivemind's ``p2pd`` binary with the flags hivemind's ``P2P.create`` gives the same arguments, and two of its
  own: ``-relayDiscovery=0`` (the named relays are static relays: a reservation within seconds, where relay discovery
  waits for autorelay's candidates) and no p2pd bootstrap (``-b=0``: it exits when the relay, usually an initial
  peer, connected first). collabopt connects it to the initial peers once it runs. hivemind's ``P2P`` has no
  parameter for either, so the DHT attaches to this daemon (``hivemind.DHT(p2p=...)``, which reads only its
  ``daemon_listen_maddr``) rather than starting one.
* It ends with the DHT's process, as hivemind's DHT ends the daemon it starts (:meth:`RelayDaemon.follow`), and with
  this process: a parent-death signal where this is the main thread, else at exit; p2pd's own ``-idleTimeout`` ends
  it at a check (every ``idle_timeout`` seconds) that finds no client connected. Its output is read and logged as
  hivemind logs its own daemons'.
* Like hivemind's, it refuses to start with an identity (``identity_path``) another peer of the swarm already uses.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import importlib.resources
import inspect
import json
import logging
import multiprocessing.connection
import os
import secrets
import subprocess
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.logging import golog_level_to_python, loglevel, python_level_to_golog

from collabopt.engine.compat import Multiaddr
from collabopt.errors import DROP, ConfigurationError
from collabopt.lifeline import sigterm_when_parent_dies

logger = logging.getLogger(__name__)

# hivemind's P2P.create arguments and their defaults: what a DHT hands to its daemon rather than to its DHT node
P2P_DEFAULTS = {name: parameter.default for name, parameter in inspect.signature(P2P.create).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
_DHT_MODES = {"auto": "dht", "server": "dhtServer", "client": "dhtClient"}
_REACHABILITY = {"public": "forceReachabilityPublic", "private": "forceReachabilityPrivate"}
_started: list[subprocess.Popen] = []  # (ended at exit where still running)


def split_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``hivemind.DHT`` arguments as (the daemon's: hivemind's ``P2P.create`` arguments, the DHT's: the rest)."""
    daemon = {name: value for name, value in kwargs.items() if name in P2P_DEFAULTS and name != "initial_peers"}
    return daemon, {name: value for name, value in kwargs.items() if name not in daemon}


def daemon_flags(listen: str, options: dict[str, Any], client_mode: bool) -> list[str]:
    """p2pd's flags for ``options`` (``P2P.create`` arguments, hivemind's defaults where absent), as hivemind's
    ``P2P.create`` makes them, with static relays and without p2pd's bootstrap."""
    o = {**P2P_DEFAULTS, **options}
    if o["use_ipfs"]:
        raise ConfigurationError("use_ipfs", "cannot be combined with relay_peers: relays serve the swarm's own peers",
                                 "drop use_ipfs=True, or drop relay_peers",
                                 fixes=[{"use_ipfs": DROP}, {"relay_peers": DROP}])
    for maddr in map(Multiaddr, map(str, o["announce_maddrs"] or ())):
        if any(protocol in maddr and maddr[protocol] == "0" for protocol in ("tcp", "udp")):
            raise ValueError("Please specify an explicit port in announce_maddrs: port 0 is not supported")
    mode = o["dht_mode"] if "dht_mode" in options else "client" if client_mode else "server"  # (as hivemind's node)
    flags: dict[str, Any] = {
        "autoRelay": o["use_auto_relay"], "autonat": o["auto_nat"], "b": False, "connManager": o["conn_manager"],
        "idleTimeout": f"{o['idle_timeout']}s", "listen": listen, "natPortMap": o["nat_port_map"],
        "relay": o["use_relay"], "relayHopLimit": o["relay_hop_limit"], "tls": o["tls"],
        "persistentConnMaxMsgSize": o["persistent_conn_max_msg_size"], "relayDiscovery": False,
        _DHT_MODES[mode]: True,
    }
    if o["force_reachability"] in _REACHABILITY:
        flags[_REACHABILITY[o["force_reachability"]]] = True
    for flag, name in (("hostAddrs", "host_maddrs"), ("announceAddrs", "announce_maddrs"),
                       ("trustedRelays", "trusted_relays")):
        if o[name]:
            flags[flag] = ",".join(str(maddr) for maddr in o[name])
    if o["no_listen"]:
        flags["noListenAddrs"] = True
    if o["identity_path"] is not None:
        if not os.path.isfile(o["identity_path"]):
            P2P.generate_identity(o["identity_path"])
        flags["id"] = o["identity_path"]
    return [f"-{flag}={int(value) if isinstance(value, bool) else value}" for flag, value in flags.items()]


class RelayDaemon:
    """A started p2pd (see the module); ``daemon_listen_maddr`` is what ``hivemind.DHT(p2p=...)`` reads."""

    def __init__(self, options: dict[str, Any], client_mode: bool, environment: dict[str, str],
                 initial_peers: Sequence[Any] = ()):
        socket = f"/tmp/hivemind-p2pd-{secrets.token_urlsafe(8)}.sock"
        self.daemon_listen_maddr = Multiaddr(f"/unix{socket}")
        self._socket, self._last_line = socket, ""
        self._peer_id_seen, self._output_ended, self._released = (threading.Event() for _ in range(3))
        self.timeout = float(options.get("startup_timeout", P2P_DEFAULTS["startup_timeout"]))
        _refuse_a_taken_identity(options, initial_peers)  # (before daemon_flags writes a new identity's file)
        flags = daemon_flags(str(self.daemon_listen_maddr), options, client_mode)
        binary = str(importlib.resources.files("hivemind.hivemind_cli") / "p2pd")
        env = {**os.environ, **environment, "GOLOG_LOG_FMT": "json"}
        env.setdefault("GOLOG_LOG_LEVEL", python_level_to_golog(loglevel))
        from_main = threading.current_thread() is threading.main_thread()  # (the signal follows the forking thread)
        self.process = subprocess.Popen([binary, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=functools.partial(_end_with_parent, os.getpid()) if from_main
                                        else None)
        _started.append(self.process)
        threading.Thread(target=self._read_output, name="collabopt-p2pd-output", daemon=True).start()
        if not (self._peer_id_seen.wait(self.timeout) and self.process.poll() is None):
            self.stop()
            self._output_ended.wait(1.0)
            raise P2PDaemonError(f"Daemon failed to start in {self.timeout:.1f} seconds: {self._last_line}")

    def _read_output(self) -> None:
        """Log the daemon's lines as hivemind does (its INFO and WARNING at DEBUG: Go's loggers are verbose); note
        when it is ready; once it ended, remove its socket and forget it."""
        with self.process.stdout:
            for raw in self.process.stdout:
                self._last_line = line = raw.decode(errors="ignore").rstrip()
                if line.startswith("Peer ID:"):
                    self._peer_id_seen.set()
                _log_daemon_line(line)
        self._output_ended.set()
        self.process.wait()
        with contextlib.suppress(ValueError):
            _started.remove(self.process)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._socket)

    def hold(self, use: Callable[[Any], Awaitable[Any]], timeout: float) -> Any:
        """``use(replica)``'s result, ``replica`` a connection of its own to the daemon (``P2P.replicate``) on a loop
        of its own in a thread of its own (the caller may be inside a running loop); it raises ``TimeoutError`` after
        ``timeout`` seconds. The connection stays open until :meth:`release`: until the DHT's process connected, an
        idle check would find no client and end the daemon."""
        outcome: concurrent.futures.Future = concurrent.futures.Future()

        async def held() -> None:
            try:
                replica = await asyncio.wait_for(P2P.replicate(self.daemon_listen_maddr), timeout)
            except BaseException as e:
                outcome.set_exception(e)
                return
            try:
                outcome.set_result(await use(replica))
                while not self._released.is_set():
                    await asyncio.sleep(0.05)
            except BaseException as e:
                if not outcome.done():
                    outcome.set_exception(e)
            finally:
                with contextlib.suppress(Exception):
                    await replica.shutdown()  # (the connection only: the daemon stays)

        threading.Thread(target=asyncio.run, args=(held(),), name="collabopt-p2pd-hold", daemon=True).start()
        try:
            return outcome.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the libp2p daemon did not answer within {timeout:.1f} s") from None

    def release(self) -> None:
        """Close the connection :meth:`hold` opened."""
        self._released.set()

    def follow(self, process: Any) -> None:
        """End the daemon once ``process`` (the DHT's ``multiprocessing.Process``) ended, as hivemind's DHT ends its own
        daemon (its sentinel is watched: nobody else's wait for that process is disturbed)."""
        def watch() -> None:
            multiprocessing.connection.wait([process.sentinel])
            self.stop()

        threading.Thread(target=watch, name="collabopt-p2pd-follow", daemon=True).start()

    def stop(self) -> None:
        """End the daemon now."""
        self.release()
        _end(self.process, 5.0)


def _refuse_a_taken_identity(options: dict[str, Any], initial_peers: Sequence[Any]) -> None:
    """As hivemind's ``P2P.create``: an identity file another peer of the swarm already uses is refused."""
    o = {**P2P_DEFAULTS, **options}
    path = o["identity_path"]
    if path is None or not os.path.isfile(path) or not o["check_if_identity_free"] or not initial_peers:
        return
    logger.info(f"Checking that identity from `{path}` is not used by other peers")
    with concurrent.futures.ThreadPoolExecutor(1) as apart:  # (the caller may be inside a running loop)
        taken = apart.submit(asyncio.run, P2P.is_identity_taken(
            path, initial_peers=initial_peers, tls=o["tls"], use_auto_relay=o["use_auto_relay"], use_ipfs=False,
            use_relay=o["use_relay"])).result()
    if taken:
        raise P2PDaemonError(f"Identity from `{path}` is already taken by another peer")


def _end(process: subprocess.Popen, timeout: float) -> None:
    """Terminate ``process``; kill it if it is still there after ``timeout`` seconds."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()


def _log_daemon_line(line: str) -> None:
    try:
        record = json.loads(line)
        level = golog_level_to_python(record["level"])
        message = record["msg"] + (f": {record['error']}" if "error" in record else "")
    except (ValueError, KeyError, TypeError):
        level, message = logging.DEBUG, line
    if level <= logging.WARNING or "use of closed network connection" in message:
        level = logging.DEBUG  # (and the daemon's own end: its listener closed)
    logger.log(level, "p2pd: %s", message)


def _end_with_parent(parent: int) -> None:
    """(the daemon's process, between fork and exec: nothing but calls resolved before) End with the process that
    started it, also where it ended before the signal was set."""
    sigterm_when_parent_dies()
    if os.getppid() != parent:
        os._exit(1)


@atexit.register
def _end_started_daemons() -> None:
    for process in list(_started):
        _end(process, 3.0)


__all__ = ["P2P_DEFAULTS", "RelayDaemon", "daemon_flags", "split_options"]
