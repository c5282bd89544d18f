"""Counting one peer's DHT traffic apart from its averaging traffic (benchmark B7, :mod:`benchmarks.scale`).

Both go through the same ``p2pd`` daemon, so the interfaces' byte counters cannot split them. What is counted here
is the DHT protocol itself: the serialized size of every ``DHTProtocol`` RPC (``rpc_ping``, ``rpc_store``,
``rpc_find``) this peer's DHT node sends or receives, as a client (request sent, response received) and as a server
(request received, response sent), by the key it is about (its progress record, its metrics record, matchmaking,
the lists of peers that serve their state, and the rest: pings and node lookups).

Rule: call :func:`install` before the peer's DHT starts. Why: hivemind's DHT is a forked process; it inherits the
patched ``P2P`` and ``DHTID`` classes and the counters, which live in shared memory (a ``RawArray``), so that the
peer's training process reads what its DHT process counted (:func:`snapshot`). The counts are protobuf payload
bytes: libp2p's framing, encryption and TCP/IP headers are not in them (a few dozen bytes per call; the calls are
counted too).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import AsyncIterable
from typing import Any

CATEGORIES = ("progress", "metrics", "matchmaking", "state_lists", "routing")
# as a client: requests sent, responses received, RPCs made; as a server: requests received, responses sent, RPCs served
FIELDS = ("requests_sent", "responses_received", "calls_out", "requests_received", "responses_sent", "calls_in")
_DHT_RPC = "DHTProtocol.rpc_"
_MAX_NAMES = 100_000

_counters: Any = None  # RawArray of len(CATEGORIES) x len(FIELDS) doubles, shared with the forked DHT process
_names: dict[bytes, str] = {}  # DHT key id -> the key it was hashed from (keys of this run only; in the DHT process)
_run_id = ""


def category(key: str | None, run_id: str) -> str:
    """The category of a DHT key of run ``run_id`` (None: a key this node never hashed, e.g. a node id)."""
    if key is None or not key.startswith(run_id):
        return "routing"
    rest = key[len(run_id):]
    if rest == "_progress":
        return "progress"
    if rest == "_metrics":
        return "metrics"
    if rest.endswith(".all_averagers"):
        return "state_lists"
    if ".0b" in rest:  # hivemind's group keys: f"{prefix}.0b{group_bits}"
        return "matchmaking"
    return "routing"


def _slot(request: Any) -> int:
    keys = getattr(request, "keys", None)
    name = _names.get(bytes(keys[0])) if keys else None
    return CATEGORIES.index(category(name, _run_id))


def _add(slot: int, field: str, value: float) -> None:
    _counters[slot * len(FIELDS) + FIELDS.index(field)] += value


def install(run_id: str) -> None:
    """Count the DHT protocol's RPCs of this process and of the processes it forks from now on (see the module)."""
    global _counters, _run_id
    if _counters is not None:
        return
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import P2P

    _counters = multiprocessing.RawArray("d", len(CATEGORIES) * len(FIELDS))
    _run_id = run_id
    generate = DHTID.generate.__func__

    def named_generate(cls: Any, source: Any = None, nbits: int = 255) -> Any:
        result = generate(cls, source, nbits)
        if isinstance(source, str) and source.startswith(run_id) and len(_names) < _MAX_NAMES:
            _names[result.to_bytes()] = source
        return result

    DHTID.generate = classmethod(named_generate)
    call, add_handler = P2P.call_protobuf_handler, P2P.add_protobuf_handler

    async def counted_call(self: Any, peer_id: Any, name: str, input: Any, output_type: Any) -> Any:
        if _DHT_RPC not in name or isinstance(input, AsyncIterable):
            return await call(self, peer_id, name, input, output_type)
        slot = _slot(input)
        _add(slot, "requests_sent", input.ByteSize())
        _add(slot, "calls_out", 1)
        response = await call(self, peer_id, name, input, output_type)
        _add(slot, "responses_received", response.ByteSize())
        return response

    async def counted_add_handler(self: Any, name: str, handler: Any, input_type: Any, **kwargs: Any) -> Any:
        if _DHT_RPC in name and not kwargs.get("stream_input") and not kwargs.get("stream_output"):
            serve = handler

            async def handler(request: Any, context: Any) -> Any:
                slot = _slot(request)
                _add(slot, "requests_received", request.ByteSize())
                _add(slot, "calls_in", 1)
                response = await serve(request, context)
                if response is not None:
                    _add(slot, "responses_sent", response.ByteSize())
                return response

        return await add_handler(self, name, handler, input_type, **kwargs)

    P2P.call_protobuf_handler, P2P.add_protobuf_handler = counted_call, counted_add_handler


_calls: dict[str, int] = {}  # "get progress", "store metrics", ...: DHT calls of this process (the training process)


def count_calls(run_id: str) -> None:
    """Count this process's ``DHT.get`` / ``DHT.store`` calls by key category (:func:`calls`): the progress tracker's
    fetches and reports and the metrics reporter's stores run in the training process."""
    from hivemind import DHT

    from collabopt.engine.replicas import ReplicaRecords

    def counted(verb: str, method: Any) -> Any:
        def call(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
            name = f"{verb} {category(key if isinstance(key, str) else None, run_id)}"
            _calls[name] = _calls.get(name, 0) + 1
            return method(self, key, *args, **kwargs)
        return call

    DHT.get, DHT.store = counted("get", DHT.get), counted("store", DHT.store)
    ReplicaRecords.store = counted("store", ReplicaRecords.store)  # per-peer records: not through DHT.store


def calls() -> dict[str, int]:
    return dict(_calls)


def snapshot() -> dict[str, dict[str, float]]:
    """The counts so far: ``{category: {field: value}}`` (all zero before :func:`install`)."""
    values = list(_counters) if _counters is not None else [0.0] * (len(CATEGORIES) * len(FIELDS))
    return {cat: {field: values[i * len(FIELDS) + j] for j, field in enumerate(FIELDS)}
            for i, cat in enumerate(CATEGORIES)}


def sent(counts: dict[str, float]) -> float:
    """Bytes sent, of one category's counts: requests as a client, responses as a server."""
    return counts["requests_sent"] + counts["responses_sent"]


def received(counts: dict[str, float]) -> float:
    return counts["responses_received"] + counts["requests_received"]


def difference(end: dict[str, dict[str, float]], start: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``end - start``, per category and field."""
    return {cat: {field: end[cat][field] - start[cat][field] for field in FIELDS} for cat in CATEGORIES}
