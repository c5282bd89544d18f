"""Command-line switches for a peer's network options, shared by the examples and open to any training script.

``add_network_arguments(parser)`` adds ``--initial-peers``, ``--port``, ``--host-maddrs``, ``--announce-maddrs``,
``--client-mode``, ``--relay-peers`` and ``--identity-path``; ``network_options(args)`` turns the parsed values
into collabopt options (``host_maddrs=``, ``client_mode=``, ...) to pass to ``collaborate``,
``CollaborativeOptimizer`` or an adapter. Each switch has an environment variable (the switch wins); an unset one
leaves collabopt's default, so only what the user chose is passed. These are the switches ``collabopt doctor``
advises.

    parser = argparse.ArgumentParser()
    add_network_arguments(parser)
    args = parser.parse_args()
    copt = CollaborativeOptimizer(opt, run_id="digits", target_batch_size=4096, **network_options(args))
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from collabopt.errors import ConfigurationError
from collabopt.swarm import INITIAL_PEERS_ENV, peer_maddrs, validate_listen_maddrs

__all__ = ["ENVIRONMENT", "add_network_arguments", "network_options"]

# each switch's destination and its environment variable (read when the switch is not given)
ENVIRONMENT = {
    "initial_peers": INITIAL_PEERS_ENV,
    "port": "COLLABOPT_PORT",
    "host_maddrs": "COLLABOPT_HOST_MADDRS",
    "announce_maddrs": "COLLABOPT_ANNOUNCE_MADDRS",
    "client_mode": "COLLABOPT_CLIENT_MODE",
    "relay_peers": "COLLABOPT_RELAY_PEERS",
    "identity_path": "COLLABOPT_IDENTITY_PATH",
}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def add_network_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the network switches to ``parser`` (as a group of its own) and return it."""
    group = parser.add_argument_group("network (each also read from the environment variable named)")
    group.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR",
                       help=f"addresses of running peers, as one prints them (${ENVIRONMENT['initial_peers']}); "
                            "none: start a new swarm")
    group.add_argument("--port", type=_port_argument, default=None,
                       help=f"listen on this TCP port on all IPv4 interfaces (${ENVIRONMENT['port']}); default: a "
                            "free port chosen at start. Fix it to open it in a firewall or forward it on a router")
    group.add_argument("--host-maddrs", nargs="+", default=None, metavar="MADDR",
                       help=f"addresses to listen on, e.g. /ip4/0.0.0.0/tcp/31337 (${ENVIRONMENT['host_maddrs']}); "
                            "instead of --port")
    group.add_argument("--announce-maddrs", nargs="+", default=None, metavar="MADDR",
                       help="addresses to tell other peers, e.g. a router's public address and forwarded port "
                            f"/ip4/203.0.113.5/tcp/31337 (${ENVIRONMENT['announce_maddrs']})")
    group.add_argument("--client-mode", action="store_true", default=None,
                       help="behind NAT or a firewall: accept no incoming connections, train through the "
                            f"connections this peer opens (${ENVIRONMENT['client_mode']}=1)")
    group.add_argument("--relay-peers", nargs="+", default=None, metavar="MADDR",
                       help="behind NAT: be reached through these public peers (e.g. the initial peer); relayed "
                            f"traffic is limited, for small models only (${ENVIRONMENT['relay_peers']})")
    group.add_argument("--identity-path", default=None,
                       help="a private key file (created if missing): the same peer id, and with --port the same "
                            f"address, across restarts (${ENVIRONMENT['identity_path']})")
    return parser


def network_options(args: argparse.Namespace, environ: Any = None) -> dict[str, Any]:
    """The collabopt options the switches (else their environment variables) set; none for what neither sets.

    >>> network_options(argparse.Namespace(port="31337", client_mode=True), environ={})
    {'host_maddrs': ['/ip4/0.0.0.0/tcp/31337'], 'client_mode': True}
    """
    environ = os.environ if environ is None else environ
    values, given_as = {}, {}
    for name, variable in ENVIRONMENT.items():
        value = getattr(args, name, None)
        switch = "--" + name.replace("_", "-")
        if value is None and environ.get(variable, "").strip():
            value, switch = environ[variable].strip(), f"${variable}"
        if value is not None:
            values[name], given_as[name] = value, switch
    options: dict[str, Any] = {}
    if "initial_peers" in values:  # (the environment variable is read by collabopt itself)
        options["initial_peers"] = peer_maddrs(_split(values["initial_peers"]), given_as["initial_peers"])
    if "port" in values and "host_maddrs" in values:
        raise ConfigurationError(given_as["port"], f"cannot be combined with {given_as['host_maddrs']}",
                                 "pass one of them: --port 31337 listens on /ip4/0.0.0.0/tcp/31337")
    if "port" in values:
        options["host_maddrs"] = [f"/ip4/0.0.0.0/tcp/{_port(values['port'], given_as['port'])}"]
    for name in ("host_maddrs", "announce_maddrs"):
        if name in values:
            options[name] = validate_listen_maddrs(_split(values[name]), given_as[name])
    client_mode = _flag(values["client_mode"], given_as["client_mode"]) if "client_mode" in values else False
    if client_mode and "relay_peers" in values:
        raise ConfigurationError(given_as["client_mode"], f"cannot be combined with {given_as['relay_peers']}: a "
                                 "client-mode peer accepts no connections, relayed or not", "drop one of them")
    if client_mode:
        options["client_mode"] = True
    if "relay_peers" in values:
        options["relay_peers"] = peer_maddrs(_split(values["relay_peers"]), given_as["relay_peers"])
    if "identity_path" in values:
        options["identity_path"] = str(values["identity_path"])
    return options


def _split(value: str | list[str]) -> list[str]:
    """Addresses given as several arguments or as one string separated by commas or whitespace."""
    items = [value] if isinstance(value, str) else list(value)
    return [part for item in items for part in str(item).replace(",", " ").split()]


def _port(value: Any, switch: str) -> int:
    try:
        port = int(str(value).strip())
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigurationError(switch, f"expected a TCP port number, got {value!r}",
                                 "pass e.g. 31337 (0: a free port chosen at start)")
    return port


def _port_argument(text: str) -> int:
    try:
        return _port(text, "--port")
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(f"{e.problem} ({e.fix})") from None


def _flag(value: Any, switch: str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in TRUE:
        return True
    if str(value).strip().lower() in FALSE:
        return False
    raise ConfigurationError(switch, f"expected 1 or 0, got {value!r}", f"set {switch.lstrip('$')}=1 or leave it unset")
