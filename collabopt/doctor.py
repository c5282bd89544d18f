"""``collabopt doctor``: can this machine join a swarm? One line per check, what passed or failed and the fix.

Checks, in order: the installed versions (hivemind must be the tested 1.1.12); the addresses given (initial peers,
``--host-maddrs``, ``--announce-maddrs``); each initial peer (a libp2p connection and a DHT ping, with their times
and the clock difference hivemind tolerates); and whether this machine accepts incoming connections, which decides
whether it can join as a full peer or needs client mode (``--client-mode`` with the examples, ``client_mode=True``)
or, where no training peer accepts connections, a relay (``--relay-peers``, ``relay_peers=[...]``).

The last check cannot be made from this machine alone: libp2p reuses the connection this machine opened, so an
initial peer that "pings back" proves nothing. Every collabopt DHT (``collabopt dht`` and every training peer that
starts its own) serves a small *dial-back* protocol instead: the doctor sends the TCP ports it listens on, and the
peer opens a fresh TCP connection to them, at the address it sees the doctor's connection come from (and to no
other host). A plain hivemind bootstrap does not serve it: the answer is then "unknown".

Run it as the newcomer would start a peer::

    collabopt doctor --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...

Exit status: 0 when no check failed, 1 when one did.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import platform
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from collabopt.engine import p2p as engine_p2p
from collabopt.engine.compat import SUPPORTED_HIVEMIND, dht_time
from collabopt.engine.dialback import (
    DIAL_TIMEOUT,
    DIALBACK_PROTOCOL,
    dialback_proof,
    host_of,
    ip_of,
    read_message,
    serve_dialback,
    short_error,
    tcp_port,
    write_message,
)
from collabopt.errors import ConfigurationError
from collabopt.local_ports import PORT_FIX, taken_ports
from collabopt.membership import SwarmKeyAuthorizer
from collabopt.version import __version__

__all__ = ["DIALBACK_PROTOCOL", "Check", "DoctorOptions", "format_report", "run_checks", "serve_dialback"]

logger = logging.getLogger(__name__)

MAX_CLOCK_OFFSET = 3.0  # hivemind's MAX_DHT_TIME_DISCREPANCY_SECONDS: a larger difference fails DHT validation

PASS, FAIL, WARN, SKIP, UNKNOWN = "PASS", "FAIL", "WARN", "SKIP", "UNKNOWN"

# What to pass, as a switch of the examples (collabopt.network_args; `collabopt doctor`'s where it has one) and as
# the option of a script of one's own. Client mode first: behind NAT its traffic takes direct connections (tests/net);
# a relay is needed only where no training peer accepts connections, and hivemind 1.1.12's p2pd limits what it carries.
CLIENT_MODE_FIX = ("join in client mode: --client-mode with the examples, client_mode=True in your own script (it "
                   "trains and averages through the connections it opens; it needs one training peer that "
                   "accepts connections, and its address cannot serve as INITIAL_PEERS)")
FORWARD_FIX = ("to accept connections instead, forward a fixed TCP port to this machine and pass --port 31337 "
               "--announce-maddrs /ip4/<public IP>/tcp/31337 (host_maddrs=['/ip4/0.0.0.0/tcp/31337'], "
               "announce_maddrs=['/ip4/<public IP>/tcp/31337']), then run collabopt doctor again with "
               "--port 31337 --announce-maddrs /ip4/<public IP>/tcp/31337")
RELAY_FIX = ("where no training peer accepts connections, a relay: --relay-peers <initial peer address> "
             "(relay_peers=['<initial peer address>']); hivemind 1.1.12 relays 128 KiB per connection, so for "
             "small models only")
RELAY_OR_CLIENT_FIX = f"{CLIENT_MODE_FIX}; {FORWARD_FIX}; {RELAY_FIX}"


@dataclass
class Check:
    """One line of the report: ``status`` is PASS, FAIL, WARN, SKIP or UNKNOWN; ``fix`` what to do about it."""

    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


@dataclass
class DoctorOptions:
    """What the doctor checks: the options a peer of this machine would start with (strings as given)."""

    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] | None = None
    client_mode: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    timeout: float = 10.0
    swarm_key: Any = field(default=None, repr=False)  # a SwarmKey (--swarm-key-file): pings are signed with it


# ------------------------------------------------------------------ the report


def run_checks(options: DoctorOptions) -> list[Check]:
    """Run every check (starting a libp2p daemon of its own for the network checks) and return them in order.

    >>> checks = run_checks(DoctorOptions(initial_peers=["/ip4/1.2.3/tcp/1"]))  # an invalid address: no network
    >>> [c.status for c in checks if c.name.startswith("initial peer")]
    ['FAIL']
    """
    return _checks(options) + [check_membership(options)]


def _checks(options: DoctorOptions) -> list[Check]:
    checks = [check_versions()]
    peers, address_checks = check_addresses(options)
    checks += address_checks
    if any(c.failed for c in address_checks if not c.name.startswith("initial peer")):
        checks.append(Check("network", SKIP, "not checked: fix the listen/announce addresses first"))
        return checks
    if not peers:
        if not options.initial_peers:
            checks.append(Check("initial peers", SKIP, "none given: a peer started so would begin a new swarm",
                                "pass --initial-peers (or set INITIAL_PEERS) to the address a running peer printed"))
        checks.append(Check("incoming connections", UNKNOWN, "no initial peer to dial back to this machine",
                            "run collabopt doctor with --initial-peers of a running collabopt peer"))
        return checks
    return checks + asyncio.run(_network_checks(peers, options))


def format_report(checks: Sequence[Check]) -> str:
    """The report as text: one line per check (status, name, detail), its fix indented below it, and a verdict.

    >>> print(format_report([Check("versions", "PASS", "python 3.11")]))
    PASS     versions: python 3.11
    all checks passed
    """
    lines = []
    for check in checks:
        lines.append(f"{check.status:<8} {check.name}: {check.detail}")
        if check.fix and check.status != PASS:
            lines.append(f"         fix: {check.fix}")
    failed, warned = sum(c.failed for c in checks), sum(c.status == WARN for c in checks)
    if failed:
        lines.append(f"{failed} check{'s' if failed != 1 else ''} failed")
    elif warned:
        lines.append(f"no check failed; {warned} warning{'s' if warned != 1 else ''}")
    else:
        lines.append("all checks passed")
    return "\n".join(lines)


def report_json(checks: Sequence[Check]) -> str:
    return json.dumps(dict(ok=not any(c.failed for c in checks), checks=[asdict(c) for c in checks]))


# ------------------------------------------------------------------ checks without the network


def check_versions() -> Check:
    import hivemind
    import torch

    detail = (f"python {platform.python_version()}, torch {torch.__version__}, hivemind {hivemind.__version__}, "
              f"collabopt {__version__}")
    if hivemind.__version__ not in SUPPORTED_HIVEMIND:
        supported = " or ".join(SUPPORTED_HIVEMIND)
        return Check("versions", FAIL, f"{detail}: collabopt supports hivemind {supported} only",
                     f"pip install hivemind=={SUPPORTED_HIVEMIND[-1]}")
    return Check("versions", PASS, detail + " (a supported hivemind)")


def check_membership(options: DoctorOptions) -> Check:
    """One line: with a swarm key, this machine joins as a member (its pings below are signed); without, the swarm
    it joins must be an open one."""
    from collabopt.swarm import membership_line

    return Check("membership", PASS, membership_line(options.swarm_key is not None)
                 + (" (pings below signed with the key of --swarm-key-file)" if options.swarm_key is not None else ""))


def check_addresses(options: DoctorOptions) -> tuple[list[str], list[Check]]:
    """Validate every address; return the valid initial peers and one check per problem (or one PASS)."""
    from collabopt.swarm import validate_listen_maddrs, validate_peer_maddr

    checks, peers = [], []
    for maddr in options.initial_peers:
        try:
            validate_peer_maddr(maddr, "--initial-peers")
            peers.append(maddr)
        except ConfigurationError as e:
            checks.append(Check(f"initial peer {maddr}", FAIL, e.problem, e.fix))
    for parameter, maddrs in (("--host-maddrs", options.host_maddrs), ("--announce-maddrs", options.announce_maddrs)):
        for maddr in maddrs or ():
            try:
                validate_listen_maddrs([maddr], parameter)
                if parameter == "--announce-maddrs" and tcp_port(maddr) == 0:
                    raise ConfigurationError(parameter, f"{maddr!r} announces port 0",
                                             "announce the fixed port this machine listens on (and forwards)")
            except ConfigurationError as e:
                checks.append(Check(parameter, FAIL, e.problem, e.fix))
    if not checks:  # a port held here: the daemon would exit, or share it with that process (collabopt.local_ports)
        checks += [Check("--host-maddrs", FAIL, f"{maddr}: this port is already in use on this machine (by a peer "
                         "that runs here, or another program)", PORT_FIX) for maddr in taken_ports(options.host_maddrs)]
    if not checks:
        announced = f", announce {' '.join(options.announce_maddrs)}" if options.announce_maddrs else ""
        checks.append(Check("addresses", PASS, f"{len(peers)} initial peer{'s' if len(peers) != 1 else ''}, "
                                               f"listen on {' '.join(options.host_maddrs)}{announced}"))
    return peers, checks


# ------------------------------------------------------------------ checks over the network


@dataclass
class _PeerResult:
    maddr: str
    connect_s: float | None = None
    ping_s: float | None = None
    clock_offset: float | None = None
    error: str = ""
    dialback: dict[str, Any] | None = None  # the peer's answer, or None when it does not serve the protocol
    dialback_error: str = ""
    refusal: str = ""  # why its DHT refused this machine's ping (the swarm key)


async def _network_checks(peers: list[str], options: DoctorOptions) -> list[Check]:
    try:
        p2p = await engine_p2p.create_p2p(host_maddrs=options.host_maddrs, announce_maddrs=options.announce_maddrs,
                                         use_relay=options.use_relay, use_auto_relay=options.use_auto_relay)
    except Exception as e:
        return [Check("libp2p", FAIL, f"could not start this machine's libp2p daemon: {e}",
                      "check --host-maddrs (is the port free? an address of this machine?) and the hivemind install")]
    try:
        listening = [str(m) for m in await engine_p2p.visible_maddrs(p2p)]
        ports = sorted({port for port in (tcp_port(m) for m in listening) if port})
        results = await asyncio.gather(*(_probe(p2p, maddr, ports, options) for maddr in peers))
    finally:
        with contextlib.suppress(Exception):
            await engine_p2p.shutdown_p2p(p2p)
    checks = [_peer_check(result) for result in results]
    checks.append(_incoming_check(results, listening, options))
    return checks


async def _probe(p2p: Any, maddr: str, ports: list[int], options: DoctorOptions) -> _PeerResult:
    """Connect to one initial peer, ping its DHT, and ask it to dial back."""
    result = _PeerResult(maddr)
    started = time.perf_counter()
    try:
        await asyncio.wait_for(engine_p2p.connect(p2p, maddr), options.timeout)
        result.connect_s = time.perf_counter() - started
        started, sent = time.perf_counter(), dht_time()
        authorizer = SwarmKeyAuthorizer(options.swarm_key) if options.swarm_key is not None else None
        remote_time = await asyncio.wait_for(engine_p2p.dht_ping(p2p, maddr, authorizer=authorizer), options.timeout)
        result.ping_s = time.perf_counter() - started
        result.clock_offset = remote_time - (sent + dht_time()) / 2
    except asyncio.TimeoutError:
        result.error = f"no answer within {options.timeout:.0f} s"
        return result
    except engine_p2p.UnsignedAnswer:
        result.refusal = ("it answered without the swarm key's signature: an open swarm (drop --swarm-key-file "
                          "and swarm_key, or give every peer of the swarm the key)")
        result.error = "an open swarm's peer"
        return result
    except Exception as e:
        if engine_p2p.refused(e):
            result.refusal = (
                "it refused this machine's key: give --swarm-key-file the key the swarm's peers use"
                if options.swarm_key is not None else
                "it refused this machine: the swarm admits members only; pass its key with --swarm-key-file "
                "(and swarm_key= to the peer)")
        if result.refusal:
            result.error = "refused this machine's swarm key"
            return result
        result.error = short_error(e)
        return result
    request: dict[str, Any] = dict(ports=ports, announce=list(options.announce_maddrs or ()))
    caller, server, nonce = p2p.peer_id.to_bytes(), engine_p2p.peer_id_of(maddr).to_bytes(), secrets.token_hex(16)
    if options.swarm_key is not None:  # a member answers members only, and only a member's answer is believed
        request.update(nonce=nonce, proof=dialback_proof(options.swarm_key, "request", caller, server, nonce))
    try:
        answer = await asyncio.wait_for(_ask(p2p, maddr, request), options.timeout + DIAL_TIMEOUT)
        result.dialback = json.loads(answer)
        if "refused" in result.dialback:
            result.dialback_error = f"it refused the dial-back request: {result.dialback.pop('refused')}"
            result.dialback = None
        elif options.swarm_key is not None and not hmac.compare_digest(
                str(result.dialback.pop("proof", "")),
                dialback_proof(options.swarm_key, "answer", caller, server, nonce, result.dialback)):
            result.dialback_error = "its dial-back answer carries no proof of the swarm key: not a member's"
            result.dialback = None
    except asyncio.TimeoutError:
        result.dialback_error = f"no dial-back answer within {options.timeout + DIAL_TIMEOUT:.0f} s"
    except Exception as e:  # most often: the peer does not serve the protocol (plain hivemind)
        result.dialback_error = short_error(e)
    return result


async def _ask(p2p: Any, maddr: str, request: dict[str, Any]) -> bytes:
    reader, writer = await engine_p2p.open_stream(p2p, maddr, DIALBACK_PROTOCOL)
    try:
        await write_message(writer, json.dumps(request).encode())
        return await read_message(reader, 65536)
    finally:
        writer.close()


def _peer_check(result: _PeerResult) -> Check:
    name = f"initial peer {result.maddr}"
    if result.refusal:
        return Check(name, FAIL, f"connected in {result.connect_s * 1000:.0f} ms, but {result.refusal}",
                     "every peer of a swarm passes the same swarm key, or none does (collabopt keygen)")
    if result.error:
        return Check(name, FAIL, f"unreachable: {result.error}", _connect_fix(result.error))
    detail = (f"connected in {result.connect_s * 1000:.0f} ms, DHT ping {result.ping_s * 1000:.0f} ms, "
              f"clock difference {result.clock_offset if abs(result.clock_offset) >= 0.05 else 0.0:+.1f} s")
    if abs(result.clock_offset) > MAX_CLOCK_OFFSET:
        return Check(name, FAIL, f"{detail}: hivemind refuses peers whose clocks differ by more than "
                                 f"{MAX_CLOCK_OFFSET:.0f} s", "synchronize this machine's clock (e.g. timedatectl "
                                                               "set-ntp true)")
    return Check(name, PASS, detail)


def _connect_fix(error: str) -> str:
    lowered = error.lower()
    if "peer id mismatch" in lowered:
        return ("a different peer answers at that address: the peer restarted with a new identity; copy the address "
                "it printed this time (start it with --identity-path to keep one)")
    return ("check that the peer is still running, that the address (IP, port, peer id) is the one it printed, and "
            "that its port is open to this machine (a firewall, or a loopback/private IP used from another network; "
            "start it with --port 31337, host_maddrs=['/ip4/0.0.0.0/tcp/31337'] in your own script, to open a "
            "fixed port)")


def _maddr_of(address: str) -> str:
    """The multiaddr of ``ip:port`` / ``[ip6]:port``."""
    host, port = host_of(address), address.rsplit(":", 1)[1]
    return f"/ip6/{host}/tcp/{port}" if ":" in host else f"/ip4/{host}/tcp/{port}"


def _incoming_check(results: list[_PeerResult], listening: list[str], options: DoctorOptions) -> Check:
    name = "incoming connections"
    answers = [(r, r.dialback) for r in results if r.dialback is not None]
    if not answers:
        errors = sorted({r.dialback_error for r in results if r.dialback_error})
        why = "no initial peer answered" if all(r.error for r in results) else (
            "no initial peer serves collabopt's dial-back check (a plain hivemind peer?)"
            + (f"; the request failed: {'; '.join(errors)}" if errors else ""))
        return Check(name, UNKNOWN, f"cannot tell: {why}",
                     "run `collabopt dht` (or any collabopt peer) as the initial peer; if others cannot connect to "
                     "this machine, " + RELAY_OR_CLIENT_FIX)
    reached, refused, seen_as = [], [], set()
    for result, answer in answers:
        if answer.get("observed"):
            seen_as.add(answer["observed"])
        for target in answer.get("results", []):
            (reached if target.get("reachable") else refused).append((result.maddr, target))
    seen = f"seen as {', '.join(sorted(seen_as))}" if seen_as else "seen through a relay"
    local_ips = {ip for ip in (ip_of(m) for m in listening) if ip}
    if reached and not refused:
        where = ", ".join(sorted({t["address"] for _, t in reached}))
        unlisted = sorted({t["address"] for _, t in reached if local_ips and host_of(t["address"]) not in local_ips})
        if unlisted and not options.announce_maddrs:  # (a 1:1 NAT, port forwarding: libp2p does not learn it)
            maddrs = [_maddr_of(address) for address in unlisted]
            announce = " ".join(maddrs)
            return Check(name, WARN, f"{seen}; initial peers connected back to {where}, an address this machine "
                                     "does not listen on (a 1:1 NAT or port forwarding): other peers learn it only if "
                                     "the peer announces it",
                         f"start the peer with --announce-maddrs {announce} (announce_maddrs="
                         f"{maddrs!r} in your own script), then run collabopt "
                         f"doctor again with --announce-maddrs {announce}")
        return Check(name, PASS, f"{seen}; initial peers connected back to {where}: this machine can be a full peer")
    if not reached and not refused:
        notes = "; ".join(filter(None, (a.get("note", "") for _, a in answers)))
        return Check(name, UNKNOWN, f"{seen}; nothing to dial back{': ' + notes if notes else ''}",
                     RELAY_OR_CLIENT_FIX)
    failures = ", ".join(f"{t['address']} ({t.get('error') or 'refused'})" for _, t in refused)
    nat = bool(local_ips) and any(host_of(s) not in local_ips for s in seen_as) and not options.announce_maddrs
    behind = "behind NAT (seen at another address than it listens on)" if nat else "behind a firewall or NAT"
    if reached:
        detail = (f"{seen}; reached at {', '.join(t['address'] for _, t in reached)} but not at {failures}: "
                  "only some peers can connect to this machine")
        return Check(name, WARN, detail, RELAY_OR_CLIENT_FIX)
    detail = f"{seen}; initial peers could not connect back to {failures}: this machine is {behind}"
    if options.client_mode:
        return Check(name, PASS, detail + "; fine with client_mode=True (you passed --client-mode: pass it, or "
                                          "client_mode=True, to the peer too)")
    if options.use_auto_relay:
        return Check(name, WARN, detail + "; use_auto_relay=True alone finds a relay only once it knows 4 candidate "
                                          "relays or after 3 minutes, and announces relays with public addresses only",
                     f"{CLIENT_MODE_FIX}; {RELAY_FIX}")
    return Check(name, FAIL, detail + ": not reachable from outside", RELAY_OR_CLIENT_FIX)

