"""The libp2p daemon of a peer that reaches the swarm through trusted relays: collabopt starts it itself.

Rules, and why (docs/decisions.md, "Static relays"):

* It runs hivemind's ``p2pd`` binary with the flags hivemind's ``P2P.create`` gives the same arguments, and two of its
  own: ``-relayDiscovery=0`` (the named relays are static relays: a reservation within seconds, where relay discovery
  waits for autorelay's candidates) and no p2pd bootstrap (``-b=0``: it exits when the relay, usually an initial
  peer, connected first). collabopt connects it to the initial peers once it runs. hivemind's ``P2P`` has no
  parameter for either, so the DHT attaches to this daemon (``hivemind.DHT(p2p=...)``, which reads only its
  ``daemon_listen_maddr``) rather than starting one.
* It ends by itself: p2pd's ``-idleTimeout`` ends it at the first check (every ``idle_timeout`` seconds) that finds no
  client connected, once the DHT's process and the services' replicas left; it also ends with this process (a
  parent-death signal where this is the main thread, else at exit). Its output is read and logged as hivemind logs its
  own daemons'.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import importlib.resources
import inspect
import json
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.logging import golog_level_to_python, loglevel, python_level_to_golog

from collabopt.engine.compat import Multiaddr

logger = logging.getLogger(__name__)

# hivemind's P2P.create arguments and their defaults: what a DHT hands to its daemon rather than to its DHT node
P2P_DEFAULTS = {name: parameter.default for name, parameter in inspect.signature(P2P.create).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
_DHT_MODES = {"auto": "dht", "server": "dhtServer", "client": "dhtClient"}
_REACHABILITY = {"public": "forceReachabilityPublic", "private": "forceReachabilityPrivate"}
_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # (Linux)
except (OSError, AttributeError):
    _prctl = None
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
        raise ValueError("use_ipfs cannot be combined with relay_peers: pass initial_peers, or drop relay_peers")
    for maddr in o["announce_maddrs"] or ():
        if "tcp" in Multiaddr(str(maddr)) and Multiaddr(str(maddr))["tcp"] == "0":
            raise ValueError("Please specify an explicit port in announce_maddrs: port 0 is not supported")
    flags: dict[str, Any] = {
        "autoRelay": o["use_auto_relay"], "autonat": o["auto_nat"], "b": False, "connManager": o["conn_manager"],
        "idleTimeout": f"{o['idle_timeout']}s", "listen": listen, "natPortMap": o["nat_port_map"],
        "relay": o["use_relay"], "relayHopLimit": o["relay_hop_limit"], "tls": o["tls"],
        "persistentConnMaxMsgSize": o["persistent_conn_max_msg_size"], "relayDiscovery": False,
        _DHT_MODES["client" if client_mode else o["dht_mode"]]: True,
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

    def __init__(self, options: dict[str, Any], client_mode: bool, environment: dict[str, str]):
        socket = f"/tmp/hivemind-p2pd-{secrets.token_urlsafe(8)}.sock"
        self.daemon_listen_maddr = Multiaddr(f"/unix{socket}")
        self._socket, self._last_line = socket, ""
        self._announced, self._released = threading.Event(), threading.Event()
        binary = str(importlib.resources.files("hivemind.hivemind_cli") / "p2pd")
        env = {**os.environ, **environment, "GOLOG_LOG_FMT": "json"}
        env.setdefault("GOLOG_LOG_LEVEL", python_level_to_golog(loglevel))
        from_main = threading.current_thread() is threading.main_thread()  # (the signal follows the forking thread)
        self.process = subprocess.Popen([binary, *daemon_flags(str(self.daemon_listen_maddr), options, client_mode)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=_end_with_parent if from_main else None)
        _started.append(self.process)
        threading.Thread(target=self._read_output, name="collabopt-p2pd-output", daemon=True).start()
        timeout = float(options.get("startup_timeout", P2P_DEFAULTS["startup_timeout"]))
        if not self._announced.wait(timeout) or self.process.poll() is not None:
            self.stop()
            raise P2PDaemonError(f"Daemon failed to start in {timeout:.1f} seconds: {self._last_line}")

    def _read_output(self) -> None:
        """Log the daemon's lines as hivemind does (its INFO and WARNING at DEBUG: Go's loggers are verbose); note
        when it is ready; remove its socket once it ended."""
        for raw in self.process.stdout:
            self._last_line = line = raw.decode(errors="ignore").rstrip()
            if line.startswith("Peer ID:"):
                self._announced.set()
            _log_daemon_line(line)
        self._announced.set()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._socket)

    def hold(self, use: Callable[[Any], Awaitable[Any]]) -> Any:
        """``use(replica)``'s result, ``replica`` a connection of its own to the daemon (``P2P.replicate``) on a loop
        of its own in a thread of its own (the caller may be inside a running loop). The connection stays open until
        :meth:`release`: until the DHT's process connected, an idle check would find no client and end the daemon."""
        outcome: concurrent.futures.Future = concurrent.futures.Future()

        async def held() -> None:
            try:
                replica = await P2P.replicate(self.daemon_listen_maddr)
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
        return outcome.result()

    def release(self) -> None:
        """Close the connection :meth:`hold` opened."""
        self._released.set()

    def stop(self) -> None:
        """End the daemon now (a start that failed)."""
        self.release()
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)


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


def _end_with_parent() -> None:
    """(the daemon's process, between fork and exec: nothing but a call resolved before) End with the process that
    started it."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


@atexit.register
def _end_started_daemons() -> None:
    for process in _started:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + 3.0
    for process in _started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))


__all__ = ["P2P_DEFAULTS", "RelayDaemon", "daemon_flags", "split_options"]
