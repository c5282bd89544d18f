"""The dial-back check: a peer asks another to open TCP connections back to it, to learn whether it is reachable.

Every collabopt DHT that is not a client serves it (:func:`collabopt.engine.p2p.start_dht`); ``collabopt doctor``
asks it. Only the host the caller's connection comes from is dialed, at most a few ports, with a short timeout.
In a swarm with a key, request and answer each carry a proof of the key (:func:`dialback_proof`) bound to both
peer ids and the caller's nonce: a member answers members only, and the doctor believes members only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import time
from typing import Any

from collabopt.membership import DIALBACK, SwarmKey

logger = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "collabopt.dialback/1"
DIAL_TIMEOUT = 3.0  # seconds the dialing peer waits for a TCP connection back
_MAX_TARGETS = 8  # addresses one dial-back request may ask for
_MAX_REQUEST_BYTES = 4096
ANSWER_READ_WAIT = 10.0  # seconds the serving peer keeps the stream open for the caller to read its answer


def dialback_proof(key: SwarmKey, direction: str, caller: bytes, server: bytes, nonce: str, body: Any = None) -> str:
    """The proof of the swarm key in a dial-back ``direction`` ("request" or "answer"): an HMAC of the key's dial-back
    sub-key over both peer ids, the caller's nonce and the answer's ``body`` (hex)."""
    message = json.dumps([direction, caller.hex(), server.hex(), nonce, body], sort_keys=True).encode()
    return hmac.new(key.derive(DIALBACK), message, hashlib.sha256).hexdigest()


async def serve_dialback(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                         key: SwarmKey | None = None, own_id: bytes = b"") -> None:
    """Serve one dial-back request (a hivemind binary stream handler, registered in every collabopt DHT's process).

    Request: JSON ``{"ports": [tcp ports the caller listens on], "announce": [multiaddrs it announces]}``. Answer:
    JSON ``{"observed": "ip:port", "results": [{"address", "reachable", "error", "seconds"}], "note"}``. Only the
    host the caller's connection comes from is dialed, at most a few ports, with a short timeout. With ``key`` (this
    peer's swarm key; ``own_id`` its peer id) a request without the key's proof gets ``{"refused": why}``, and an
    answer carries its own proof.
    """
    try:
        request = json.loads(await asyncio.wait_for(read_message(reader, _MAX_REQUEST_BYTES), 10))
        if key is None:
            answer = await dial_back(str(stream_info.addr), request)
        else:
            caller, nonce = stream_info.peer_id.to_bytes(), str(request.get("nonce", ""))
            if not hmac.compare_digest(str(request.get("proof", "")),
                                       dialback_proof(key, "request", caller, own_id, nonce)):
                answer = dict(refused="this swarm admits members only: the request carries no proof of its key")
            else:
                answer = await dial_back(str(stream_info.addr), request)
                answer["proof"] = dialback_proof(key, "answer", caller, own_id, nonce, answer)
        await write_message(writer, json.dumps(answer).encode())
        # the caller closes first, once it has the answer: the daemon may drop an answer in flight on a stream
        # whose server end closed first (see collabopt.engine.streams)
        with contextlib.suppress(Exception):  # (its end closed, reset or silent: the answer is out)
            await asyncio.wait_for(reader.read(), ANSWER_READ_WAIT)
    except Exception as e:  # (the caller then reports "cannot tell": say why here, in the serving peer's log)
        logger.warning("collabopt: a dial-back request from %s failed: %r", getattr(stream_info, "addr", "?"), e)
    finally:
        writer.close()


async def write_message(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One message: its length (4 bytes, big-endian), then the bytes."""
    writer.write(len(data).to_bytes(4, "big") + data)
    await writer.drain()


async def read_message(reader: asyncio.StreamReader, limit: int) -> bytes:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > limit:
        raise ValueError(f"a message of {size} bytes (at most {limit})")
    return await reader.readexactly(size)


async def dial_back(observed: str, request: dict[str, Any]) -> dict[str, Any]:
    """Try TCP connections to the caller whose connection comes from multiaddr ``observed`` (its IP only)."""
    host = ip_of(observed)
    if host is None:
        return dict(observed="", results=[], note=f"the connection comes through a relay ({observed})")
    targets: list[tuple[str, int]] = []
    notes = []
    for port in request.get("ports", [])[:_MAX_TARGETS]:
        if isinstance(port, int) and 0 < port < 65536:
            targets.append((host, port))
    for maddr in request.get("announce", [])[:_MAX_TARGETS]:
        ip, port = ip_of(str(maddr)), tcp_port(str(maddr))
        if ip is None or not port:
            continue
        if ip != host:
            notes.append(f"announced {maddr} is not the address this peer sees ({host}); not dialed")
            continue
        targets.append((ip, port))
    targets = list(dict.fromkeys(targets))[:_MAX_TARGETS]
    results = await asyncio.gather(*(_dial(ip, port) for ip, port in targets))
    return dict(observed=host_port(host, tcp_port(observed)), results=list(results), note="; ".join(notes))


async def _dial(host: str, port: int) -> dict[str, Any]:
    address = host_port(host, port)
    started = time.perf_counter()
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT)
    except asyncio.TimeoutError:
        return dict(address=address, reachable=False, error=f"no answer in {DIAL_TIMEOUT:.0f} s", seconds=None)
    except OSError as e:
        return dict(address=address, reachable=False, error=e.strerror or type(e).__name__, seconds=None)
    seconds = time.perf_counter() - started
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return dict(address=address, reachable=True, error="", seconds=seconds)


# ------------------------------------------------------------------ addresses


def ip_of(maddr: str) -> str | None:
    """The IP of ``/ip4/<ip>/tcp/...`` (or ip6); None for anything else (relay circuits, DNS names)."""
    parts = str(maddr).split("/")
    if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


def tcp_port(maddr: str) -> int | None:
    parts = str(maddr).split("/")
    if "p2p-circuit" in parts:
        return None
    for i, part in enumerate(parts[:-1]):
        if part == "tcp" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def host_of(address: str) -> str:
    """The host of ``ip:port`` / ``[ip6]:port``."""
    return address.rsplit(":", 1)[0].strip("[]") if address.count(":") == 1 or "]" in address else address


def host_port(host: str, port: int | None) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port else host


def short_error(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:200]
