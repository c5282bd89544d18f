"""Command-line switches for a peer's network options: one definition, for the examples, the ``collabopt``
commands and any training script.

``add_network_arguments(parser)`` adds ``--initial-peers``, ``--port``, ``--host-maddrs``, ``--announce-maddrs``,
``--client-mode``, ``--relay-peers`` and ``--identity-path`` (``switches=`` picks some: ``collabopt monitor``, which
only reads, takes the addresses alone); ``network_options(args)`` turns the parsed values into collabopt options
(``host_maddrs=``, ``client_mode=``, ...) to pass to ``collaborate``, ``CollaborativeOptimizer`` or an adapter. Each
switch has an environment variable (the switch wins); an unset one leaves collabopt's default, so only what the
user chose is passed. Each default is said once, in the switch's help. These are the switches ``collabopt doctor``
advises.

    parser = argparse.ArgumentParser()
    add_network_arguments(parser)
    args = parser.parse_args()
    copt = CollaborativeOptimizer(opt, run_id="digits", target_batch_size=4096, **network_options(args))
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from collabopt.errors import ConfigurationError
from collabopt.swarm import DEFAULT_HOST_MADDRS, INITIAL_PEERS_ENV, peer_maddrs, validate_listen_maddrs

__all__ = ["ENVIRONMENT", "SWITCHES", "add_network_arguments", "network_options"]

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
SWITCHES = tuple(ENVIRONMENT)
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
TITLE = "network (each also read from the environment variable named)"


def _help(name: str, switches: Sequence[str] = SWITCHES) -> str:
    """The help of one switch: what it sets, its environment variable and its default (said here only)."""
    env = f"${ENVIRONMENT[name]}"
    instead = ", instead of --port" if "port" in switches else ""
    return {
        "initial_peers": f"addresses of running peers, as a peer's join line or `collabopt dht` prints them ({env}); "
                         "default: none, and a training peer starts a new swarm",
        "port": f"listen on this TCP port on all IPv4 interfaces ({env}); default: a free port chosen at start. Fix "
                "it to open it in a firewall or forward it on a router",
        "host_maddrs": f"addresses to listen on, e.g. /ip4/0.0.0.0/tcp/31337{instead} ({env}); default: "
                       f"{' '.join(DEFAULT_HOST_MADDRS)} (all IPv4 interfaces, a free port)",
        "announce_maddrs": "addresses to tell other peers, e.g. a router's public address and forwarded port "
                           f"/ip4/203.0.113.5/tcp/31337 ({env}); default: the addresses listened on",
        "client_mode": "behind NAT or a firewall: accept no incoming connections, train through the connections "
                       f"this peer opens ({env}=1); default: off",
        "relay_peers": "behind NAT: be reached through these public peers (e.g. the initial peer); relayed traffic "
                       f"is limited, for small models only ({env}); default: none",
        "identity_path": "a private key file (created if missing): the same peer id, and with --port the same "
                         f"address, across restarts ({env}); default: a new peer id at each start",
    }[name]


def add_network_arguments(parser: argparse.ArgumentParser,
                          switches: Sequence[str] = SWITCHES) -> argparse.ArgumentParser:
    """Add the network ``switches`` (default: all of :data:`SWITCHES`) to ``parser``, as a group of its own, and
    return it. A switch left out is not read from the environment either (:func:`network_options`)."""
    unknown = [name for name in switches if name not in ENVIRONMENT]
    if unknown:
        raise ValueError(f"unknown network switches {unknown}: choose among {list(SWITCHES)}")
    group = parser.add_argument_group(TITLE)
    for name in SWITCHES:  # (always in this order)
        if name not in switches:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "port":
            group.add_argument(flag, type=_port_argument, default=None, help=_help(name, switches))
        elif name == "client_mode":
            group.add_argument(flag, action="store_true", default=None, help=_help(name, switches))
        elif name == "identity_path":
            group.add_argument(flag, default=None, metavar="PATH", help=_help(name, switches))
        else:
            group.add_argument(flag, nargs="+", default=None, metavar="MADDR", help=_help(name, switches))
    return parser


def network_options(args: argparse.Namespace, environ: Any = None, *,
                    check_addresses: bool = True) -> dict[str, Any]:
    """The collabopt options the switches (else their environment variables) set; none for what neither sets.

    Only the switches ``args`` has are read (those ``add_network_arguments`` was asked for). ``check_addresses=False``
    leaves the addresses as given, unchecked (``collabopt doctor`` reports a bad one as a failed check).

    >>> network_options(argparse.Namespace(port="31337", client_mode=True), environ={})
    {'host_maddrs': ['/ip4/0.0.0.0/tcp/31337'], 'client_mode': True}
    """
    environ = os.environ if environ is None else environ
    values, given_as = {}, {}
    for name, variable in ENVIRONMENT.items():
        if not hasattr(args, name):
            continue
        value, switch = getattr(args, name), "--" + name.replace("_", "-")
        if value is None and environ.get(variable, "").strip():
            value, switch = environ[variable].strip(), f"${variable}"
        if value is not None:
            values[name], given_as[name] = value, switch

    def peers(name: str) -> list[str]:
        return peer_maddrs(_split(values[name]), given_as[name]) if check_addresses else _split(values[name])

    def listen(name: str) -> list[str]:
        return validate_listen_maddrs(_split(values[name]), given_as[name]) if check_addresses else _split(values[name])

    options: dict[str, Any] = {}
    if "initial_peers" in values:
        options["initial_peers"] = peers("initial_peers")
    if "port" in values and "host_maddrs" in values:
        raise ConfigurationError(given_as["port"], f"cannot be combined with {given_as['host_maddrs']}",
                                 "pass one of them: --port 31337 listens on /ip4/0.0.0.0/tcp/31337")
    if "port" in values:
        options["host_maddrs"] = [f"/ip4/0.0.0.0/tcp/{_port(values['port'], given_as['port'])}"]
    for name in ("host_maddrs", "announce_maddrs"):
        if name in values:
            options[name] = listen(name)
    client_mode = _flag(values["client_mode"], given_as["client_mode"]) if "client_mode" in values else False
    if client_mode and "relay_peers" in values:
        raise ConfigurationError(given_as["client_mode"], f"cannot be combined with {given_as['relay_peers']}: a "
                                 "client-mode peer accepts no connections, relayed or not",
                                 f"keep {given_as['client_mode']} and drop {given_as['relay_peers']} (client mode "
                                 "needs one training peer that accepts connections), or drop "
                                 f"{given_as['client_mode']} to be reached through the relays")
    if client_mode:
        options["client_mode"] = True
    if "relay_peers" in values:
        options["relay_peers"] = peers("relay_peers")
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
