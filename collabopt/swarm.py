"""Starting or joining a swarm: DHT options, peer address validation and the join message."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from collabopt.engine import p2p
from collabopt.engine.compat import Multiaddr
from collabopt.errors import DROP, ConfigurationError, SwarmConnectionError, SwarmKeyError
from collabopt.local_ports import check_ports_free
from collabopt.membership import (  # noqa: F401 (found here too)
    MEMBERS_ONLY,
    OPEN_SWARM,
    SwarmKey,
    SwarmKeyAuthorizer,
    membership_line,
    swarm_key_from,
    swarm_key_of,
)

logger = logging.getLogger(__name__)

INITIAL_PEERS_ENV = "INITIAL_PEERS"
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
# where a peer's address comes from (no fix can guess it: the words say where to copy it from)
AS_PRINTED = "the addresses a running peer prints in its join line (or `collabopt dht` as INITIAL_PEERS=...)"


def parse_initial_peers(
    initial_peers: str | Sequence[str] | None, env_vars: Sequence[str] = (INITIAL_PEERS_ENV,)
) -> list[str]:
    """Return the initial peers as a validated list of multiaddr strings.

    ``initial_peers`` may be a list, or one string with addresses separated by commas or whitespace.
    When it is ``None``, the first of ``env_vars`` that is set is used. An empty result means "start a new swarm".

    >>> parse_initial_peers("/ip4/10.0.0.2/tcp/31337/p2p/QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4")
    ['/ip4/10.0.0.2/tcp/31337/p2p/QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4']
    """
    parameter = "initial_peers"
    if initial_peers is None:
        for name in env_vars:
            if os.environ.get(name, "").strip():
                initial_peers, parameter = os.environ[name], f"the {name} environment variable"
                break
        else:
            return []
    if isinstance(initial_peers, str):
        items = initial_peers.replace(",", " ").split()
    elif isinstance(initial_peers, Sequence):
        items = []
        for item in initial_peers:
            if not isinstance(item, (str, Multiaddr)):
                raise ConfigurationError(
                    parameter,
                    f"expected multiaddr strings, got {type(item).__name__} {item!r}",
                    f"pass strings like '/ip4/1.2.3.4/tcp/31337/p2p/Qm...', {AS_PRINTED}",
                )
            items.extend(str(item).replace(",", " ").split())
    else:
        raise ConfigurationError(
            parameter,
            f"expected a list of multiaddrs or a comma-separated string, got {type(initial_peers).__name__}",
            f"pass e.g. initial_peers=['/ip4/1.2.3.4/tcp/31337/p2p/Qm...'], {AS_PRINTED}",
        )
    for item in items:
        validate_peer_maddr(item, parameter)
    return items


def peer_maddrs(maddrs: str | Sequence[str], parameter: str) -> list[str]:
    """``maddrs`` (a list, or one string separated by commas or whitespace) as a list of validated peer addresses."""
    items = maddrs.replace(",", " ").split() if isinstance(maddrs, str) else [str(m) for m in maddrs]
    for item in items:
        validate_peer_maddr(item, parameter)
    return items


def relay_options(relay_peers: Sequence[str], announce_maddrs: Sequence[str] | None = None) -> dict[str, Any]:
    """``hivemind.DHT`` arguments that make a peer behind NAT reachable through ``relay_peers`` (public peers: every
    hivemind peer with ``use_relay=True``, the default, serves as a libp2p circuit relay).

    The peer reserves a slot on each relay at once (autorelay with these relays only, this peer declared not
    reachable) and announces its address through each (``<relay>/p2p-circuit``), so that every other peer,
    behind a NAT of its own or not, connects to it through the relay. (libp2p's autorelay announces relay addresses
    by itself only for relays with public IP addresses.) hivemind 1.1.12's p2pd relays at most 128 KiB per direction
    and 2 minutes per relayed connection, then resets it: enough for the DHT and small models only.

    >>> relay_options(["/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWRelay"])["announce_maddrs"]
    ['/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWRelay/p2p-circuit']
    """
    relay_peers = list(relay_peers)
    return dict(use_relay=True, use_auto_relay=True, trusted_relays=relay_peers, force_reachability="private",
                announce_maddrs=[*(announce_maddrs or ()), *(f"{relay}/p2p-circuit" for relay in relay_peers)])


def validate_peer_maddr(maddr: str, parameter: str = "initial_peers") -> None:
    """Raise :class:`ConfigurationError` unless ``maddr`` is a full multiaddr of a peer (with ``/p2p/<id>``)."""
    fix = f"copy the address exactly as printed: {AS_PRINTED}, e.g. '/ip4/1.2.3.4/tcp/31337/p2p/QmPeerId...'"
    try:
        parsed = Multiaddr(maddr)
    except Exception as e:
        raise ConfigurationError(parameter, f"{maddr!r} is not a valid multiaddr ({e})", fix) from None
    protocols = [protocol.name for protocol in parsed.protocols()]
    if "p2p" not in protocols:
        raise ConfigurationError(parameter, f"{maddr!r} has no /p2p/<peer id> part", fix)


def validate_listen_maddrs(maddrs: Sequence[str] | None, parameter: str) -> list[str] | None:
    """Validate addresses to listen on or announce (no peer id needed)."""
    if maddrs is None:
        return None
    if isinstance(maddrs, str):
        maddrs = maddrs.replace(",", " ").split()
    for maddr in maddrs:
        try:
            Multiaddr(str(maddr))
        except Exception as e:
            fix, fixes = _listen_fix(parameter, [str(m) for m in maddrs])
            raise ConfigurationError(parameter, f"{maddr!r} is not a valid multiaddr ({e})", fix, fixes=fixes) from None
    return [str(maddr) for maddr in maddrs]


def _listen_fix(parameter: str, maddrs: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The fix of a bad listen or announce address: ``IP:PORT`` written as a multiaddr, or the option left out (its
    default); as data where ``parameter`` is an option (not a switch or an environment variable)."""
    written, option = [_as_multiaddr(maddr) for maddr in maddrs], parameter.isidentifier()
    default = "all IPv4 interfaces, a free port" if "host" in parameter else "the addresses listened on"
    drop = f"drop {parameter} (default: {default})"
    if all(written) and option:
        return f"pass {parameter}={written!r}, or {drop}", [{parameter: written}, {parameter: DROP}]
    return (f"use the form '/ip4/0.0.0.0/tcp/31337' ('/ip4/0.0.0.0/tcp/0': a free port), or {drop}",
            [{parameter: DROP}] if option else [])


def _as_multiaddr(address: str) -> str | None:
    """A valid multiaddr as it is, ``"10.0.0.2:31337"`` as ``"/ip4/10.0.0.2/tcp/31337"`` (an IPv6 address in
    brackets too), else None."""
    with contextlib.suppress(Exception):
        return str(Multiaddr(address))
    host, _, port = address.strip().rpartition(":")
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host.strip("[]"))
        if port.isdigit() and int(port) <= 65535:
            return f"/ip{ip.version}/{ip}/tcp/{int(port)}"
    return None


@dataclass(frozen=True, kw_only=True)
class DhtOptions:
    """Options of this peer's DHT node that users set (shared by :class:`SwarmOptions` and the peer's config)."""

    initial_peers: str | Sequence[str] | None = None
    host_maddrs: Sequence[str] | None = None
    announce_maddrs: Sequence[str] | None = None
    client_mode: bool = False
    identity_path: str | None = None
    use_ipfs: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    relay_peers: str | Sequence[str] | None = None  # behind NAT: be reached through these public peers
    wait_timeout: float = 3.0
    bootstrap_timeout: float | None = None
    # members only: the swarm's secret (collabopt keygen), text or a parsed SwarmKey; never shown in a repr
    swarm_key: str | SwarmKey | None = field(default=None, repr=False)

    def validate(self) -> None:
        """Refuse options that cannot work together, each error with its fixes as data (they lead to valid options
        as far as these checks go)."""
        swarm_key_from(self.swarm_key, environment=False)  # (a malformed key: ConfigurationError naming swarm_key)
        if self.relay_peers is not None:
            relay_peers = peer_maddrs(self.relay_peers, "relay_peers")
            if not relay_peers:
                raise ConfigurationError("relay_peers", "is empty", "pass the address of a public peer, or drop "
                                         "relay_peers", fixes=[{"relay_peers": DROP}])
            if self.client_mode:
                raise ConfigurationError(
                    "client_mode", "cannot be combined with relay_peers: a client-mode peer accepts no connections, "
                    "relayed or not", "keep client_mode=True and drop relay_peers (client mode needs one training "
                    "peer that accepts connections), or drop client_mode to be reached through the relays",
                    fixes=[{"relay_peers": DROP}, {"client_mode": DROP}])
            if not self.use_relay:
                raise ConfigurationError(
                    "use_relay", "cannot be combined with relay_peers: relaying needs use_relay=True",
                    "drop use_relay=False, or drop relay_peers", fixes=[{"use_relay": DROP}, {"relay_peers": DROP}])
        if self.identity_path is not None and not isinstance(self.identity_path, (str, os.PathLike)):
            raise ConfigurationError("identity_path", f"must be a path to a private key file, got "
                                     f"{type(self.identity_path).__name__}", "pass e.g. identity_path='peer.key' (a "
                                     "file, created if missing), or drop identity_path for a new peer id at each start",
                                     fixes=[{"identity_path": "peer.key"}, {"identity_path": DROP}])
        for name, example in (("wait_timeout", 3.0), ("bootstrap_timeout", DROP), ("startup_timeout", 30.0)):
            value = getattr(self, name, None)
            if value is None and name != "wait_timeout":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                fix = (f"pass a positive number of seconds, e.g. {name}={example} (the default)" if example is not DROP
                       else f"drop {name} (hivemind's default), or pass a positive number of seconds")
                raise ConfigurationError(name, f"must be a positive number of seconds, got {value!r}", fix,
                                         fixes=[{name: example}])


@dataclass(frozen=True, kw_only=True)
class SwarmOptions(DhtOptions):
    """Everything needed to start this peer's DHT node (``initial_peers`` parsed). See :func:`start_dht`."""

    startup_timeout: float = 30.0
    record_validators: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def start_dht(options: SwarmOptions):
    """Start a hivemind DHT node in a background process; join the swarm of ``options.initial_peers``.

    Raises :class:`SwarmConnectionError` with advice when no initial peer answers, :class:`SwarmKeyError` when
    they refuse this peer's swarm key (another one, none where the swarm has one, or one where it has none).
    """
    kwargs = dict(
        initial_peers=options.initial_peers or None,
        host_maddrs=options.host_maddrs if options.host_maddrs is not None else list(DEFAULT_HOST_MADDRS),
        client_mode=options.client_mode,
        use_ipfs=options.use_ipfs,
        use_relay=options.use_relay,
        use_auto_relay=options.use_auto_relay,
        wait_timeout=options.wait_timeout,
        startup_timeout=options.startup_timeout,
        record_validators=options.record_validators,
        **options.extra,
    )
    if options.announce_maddrs is not None:
        kwargs["announce_maddrs"] = options.announce_maddrs
    if options.relay_peers is not None:
        kwargs.update(relay_options(peer_maddrs(options.relay_peers, "relay_peers"), options.announce_maddrs))
    if options.identity_path is not None:
        kwargs["identity_path"] = str(options.identity_path)
    if options.bootstrap_timeout is not None:
        kwargs["bootstrap_timeout"] = options.bootstrap_timeout
    key = swarm_key_from(options.swarm_key, environment=False)
    if key is not None:  # every DHT request and answer signed with the key: outsiders neither read nor store
        kwargs["authorizer"] = SwarmKeyAuthorizer(key)
    check_ports_free(kwargs["host_maddrs"])  # a port held here: said now, not as silent initial peers later
    try:
        return p2p.start_dht(**kwargs)
    except Exception as e:
        if options.initial_peers and ("bootstrap" in str(e) or "initial_peers" in str(e)):
            # a swarm key's refusal looks like silence to hivemind's bootstrap: ask the initial peers why
            verdict = _refusal(options.initial_peers, kwargs.get("authorizer"))
            if verdict is not None:
                raise SwarmKeyError(verdict) from e
            raise SwarmConnectionError(
                f"none of the initial peers answered: {options.initial_peers}. Check that the first peer is "
                "still running, that the address (IP, port, peer id) is the one it printed, and that its port is "
                "reachable from this machine. `collabopt doctor --initial-peers ...` on this machine checks each of "
                "these and says what to change."
            ) from e
        raise


def _refusal(initial_peers: Any, authorizer: Any) -> str | None:
    """Why the initial peers refused this peer (:func:`collabopt.engine.p2p.membership_verdict`), or None where the
    probe cannot tell: it failed, or this thread runs an event loop (``asyncio.run`` is not allowed there); the
    connection error then stands as it was."""
    try:
        asyncio.get_running_loop()
        return None
    except RuntimeError:
        pass
    try:
        return asyncio.run(p2p.membership_verdict(initial_peers, authorizer))
    except Exception as e:  # (a probe that fails must not hide the bootstrap's error)
        logger.debug("collabopt: the membership probe failed: %r", e)
        return None


def _is_loopback(maddr: str) -> bool:
    parts = str(maddr).split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(parts[2]).is_loopback
        except ValueError:
            return False
    return False


# modules whose ``python -m`` launch is no training command to repeat (a notebook's kernel)
NOT_A_COMMAND = ("ipykernel_launcher", "ipykernel", "IPython", "jupyter", "colab_kernel_launcher")


def command_line(orig_argv: Sequence[str] | None = None, executable: str | None = None) -> str:
    """The command that started this process, ready to paste into a shell of a machine set up the same way.

    The interpreter is the one running (``sys.executable``, a virtual environment's included: the paste needs no
    activated environment), with its options, then the script (``python train.py --lr 0.1``), the module
    (``python -m pkg.train``) or, for a console script with a ``#!`` line, the script alone. Paths are relative to
    the working directory when under it (a clone at another path works from its root), else absolute; every word
    is quoted for a POSIX shell. A process started otherwise (``-c``, stdin, a notebook) gets
    ``<interpreter> your_script.py``.

    >>> command_line(["python3", "train.py", "--lr", "0.1"], executable="/usr/bin/python3")
    '/usr/bin/python3 train.py --lr 0.1'
    """
    if orig_argv is None:
        orig_argv = getattr(sys, "orig_argv", None) or [sys.executable or "python", *sys.argv]
    interpreter = _path_to_paste(executable if executable is not None else sys.executable or "python", run=True)
    launch = _launch(list(orig_argv))
    if launch is None:
        return shlex.join([interpreter, "your_script.py"])
    options, module, script, args = launch
    if module is not None:
        if module.split(".")[0] in NOT_A_COMMAND:
            return shlex.join([interpreter, "your_script.py"])
        return shlex.join([interpreter, *options, "-m", module, *args])
    if not options and _runs_itself(script):  # a console script: its #! line names the interpreter
        return shlex.join([_path_to_paste(script, run=True), *args])
    return shlex.join([interpreter, *options, _path_to_paste(script), *args])


def _launch(orig_argv: list[str]) -> tuple[list[str], str | None, str, list[str]] | None:
    """``(interpreter options, module, script, arguments)`` of an interpreter's command line, or None for ``-c``,
    stdin or an interactive interpreter."""
    options, i = [], 1
    while i < len(orig_argv):
        word = orig_argv[i]
        if word in ("-W", "-X", "--check-hash-based-pycs"):  # an option with a separate value
            options += orig_argv[i:i + 2]
            i += 2
        elif word == "-m" or (word.startswith("-m") and not word.startswith("--")):
            module = word[2:] or (orig_argv[i + 1] if i + 1 < len(orig_argv) else "")
            rest = orig_argv[i + (1 if word[2:] else 2):]
            return (options, module, "", rest) if module else None
        elif word.startswith("-c") or word in ("-", "--") or word.startswith("-i"):
            return None  # a command string, stdin, or interactive: nothing to repeat
        elif word.startswith("-"):
            options.append(word)
            i += 1
        else:
            return options, None, word, orig_argv[i + 1:]
    return None


def _path_to_paste(path: str, run: bool = False) -> str:
    """``path`` relative to the working directory when it lies under it, else absolute (``./`` before a file that
    the shell is to ``run`` from the working directory); a bare name that is no file here (found on PATH) as it
    is."""
    if os.path.basename(path) == path and not os.path.exists(path):
        return path
    absolute = os.path.abspath(path)
    with contextlib.suppress(ValueError):  # another drive on Windows
        relative = os.path.relpath(absolute)
        if not relative.startswith(".."):
            return os.path.join(".", relative) if run and os.path.basename(relative) == relative else relative
    return absolute


def _runs_itself(path: str) -> bool:
    """Whether ``path`` is an executable file starting with ``#!`` (a console script), which a shell runs as it is."""
    if path.endswith(".py") or not os.access(path, os.X_OK) or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as file:
            return file.read(2) == b"#!"
    except OSError:
        return False


def join_message(visible_maddrs: Sequence[Any], run_id: str, client_mode: bool = False, command: str | None = None,
                 constructor: str = "CollaborativeOptimizer", members_only: bool = False) -> str:
    """The helper text telling how other machines join this run: ``command`` (default: this process's own command
    line) with ``INITIAL_PEERS`` set, or ``constructor(..., initial_peers=...)``, and whether the swarm is open."""
    addresses = [str(m) for m in visible_maddrs]
    public = [m for m in addresses if not _is_loopback(m)]
    shown = public or addresses
    membership = f"\n  {membership_line(members_only)}"
    if client_mode or not shown:
        return (
            f"collabopt: joined run_id={run_id!r} in client mode (this peer accepts no incoming connections);"
            " start other peers with the INITIAL_PEERS of a non-client peer." + membership
        )
    where = "" if public else " (loopback only: peers on this machine can join; pass host_maddrs to listen publicly)"
    return (
        f"collabopt: run_id={run_id!r}; other peers can join with{where}:\n"
        f"    INITIAL_PEERS={','.join(shown)} {command or command_line()}\n"
        f"  or {constructor}(..., initial_peers={shown!r})" + membership
    )


def print_join_message(dht: Any, run_id: str, client_mode: bool, stream: TextIO | None = None,
                       constructor: str = "CollaborativeOptimizer") -> None:
    """Print :func:`join_message` for a running DHT."""
    message = join_message(dht.get_visible_maddrs(), run_id, client_mode, constructor=constructor,
                           members_only=swarm_key_of(dht) is not None)
    print(message, file=stream or sys.stderr, flush=True)
