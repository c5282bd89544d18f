"""One B3 peer of the plain-TCP peer's traffic (:mod:`benchmarks.tcp_allreduce_peer`) over hivemind's transport: the
same bytes in the same butterfly pattern, on byte streams of hivemind's p2p daemon (libp2p: one encrypted,
multiplexed connection per pair of peers) instead of sockets. Nothing of an averager runs: no protobuf, serialization
or arithmetic. Between the plain-TCP row and collabopt's runner, this row says how much of the gap is the transport's.

Each peer opens one stream to each other peer, as hivemind's ``rpc_aggregate_part`` does: it writes its part for that
peer on it and reads the results back; the streams the others open to it carry their parts in and its own part's
results out, a chunk answered once every sender's copy has arrived. Rounds, barrier and records as the plain-TCP
peer's. Peers find each other through files in ``exchange_dir`` (each starts its daemon with the lower indices' as
initial peers: one connection per pair) and leave once every peer wrote its record.

Usage: ``python -m benchmarks.p2p_allreduce_peer config.json``; writes ``config['out']`` (JSON).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from benchmarks.tcp_allreduce_peer import chunk_sizes, mlp_bytes, part_sizes, write_record

STREAM = "b3_allreduce"


async def until_exists(*paths: Path) -> None:
    while not all(path.exists() for path in paths):
        await asyncio.sleep(0.05)


async def one_round(sizes: list[int], own: list[int], chunk: int, outgoing: dict, incoming: dict) -> int:
    """The plain-TCP peer's round on asyncio streams: ``outgoing[j]`` (reader, writer) carries this peer's part for
    ``j`` and its results, ``incoming[k]`` the part of ``k`` and this peer's answers. Returns the bytes written."""
    arrived, changed, written = {k: 0 for k in incoming}, asyncio.Condition(), []
    payload = bytes(chunk)

    async def write(writer: asyncio.StreamWriter, size: int) -> None:
        writer.write(payload[:size])
        await writer.drain()
        written.append(size)

    async def write_part(j: int) -> None:
        for size in chunk_sizes(sizes[j], chunk):
            await write(outgoing[j][1], size)

    async def read_parts(k: int) -> None:
        for c, size in enumerate(own):
            await incoming[k][0].readexactly(size)
            async with changed:
                arrived[k] = c + 1
                changed.notify_all()

    async def answer(k: int) -> None:
        for c, size in enumerate(own):
            async with changed:
                await changed.wait_for(lambda c=c: min(arrived.values()) > c)
            await write(incoming[k][1], size)

    await asyncio.gather(*[write_part(j) for j in outgoing], *[outgoing[j][0].readexactly(sizes[j]) for j in outgoing],
                         *[read_parts(k) for k in incoming], *[answer(k) for k in incoming])
    return sum(written)


async def run(cfg: dict) -> None:
    index, n, work = cfg["index"], len(cfg["addrs"]), Path(cfg["exchange_dir"])
    grad_bytes = cfg.get("grad_bytes") or mlp_bytes(cfg)
    sizes = part_sizes(grad_bytes, n)
    chunk = cfg.get("part_size_bytes", 2**19)
    lower: list[str] = []
    for j in range(index):
        await until_exists(work / f"{j}.id")
        lower += json.loads((work / f"{j}.id").read_text())["maddrs"]
    p2p = await P2P.create(host_maddrs=[f"/ip4/{cfg['addrs'][index]}/tcp/0"], initial_peers=lower or None)
    incoming: dict[int, tuple] = {}
    leaving = asyncio.Event()
    try:
        ids = {}

        async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while info.peer_id not in ids:  # (a peer may open its stream before this one read every id)
                await asyncio.sleep(0.01)
            incoming[ids[info.peer_id]] = (reader, writer)
            await leaving.wait()

        await p2p.add_binary_stream_handler(STREAM, serve)
        me = dict(peer_id=p2p.peer_id.to_base58(), maddrs=[str(m) for m in await p2p.get_visible_maddrs()])
        (work / f"{index}.tmp").write_text(json.dumps(me))
        (work / f"{index}.tmp").replace(work / f"{index}.id")
        await until_exists(*(work / f"{j}.id" for j in range(n)))
        ids.update({PeerID.from_base58(json.loads((work / f"{j}.id").read_text())["peer_id"]): j
                    for j in range(n) if j != index})
        outgoing = {}
        for peer_id, j in ids.items():
            _, reader, writer = await p2p.call_binary_stream_handler(peer_id, STREAM)
            outgoing[j] = (reader, writer)
        while len(incoming) < n - 1:
            await asyncio.sleep(0.01)
        Path(cfg["ready_file"]).touch()
        await until_exists(Path(cfg["go_file"]))
        events = []
        for _ in range(cfg["rounds"]):
            await asyncio.sleep(cfg.get("idle_seconds", 0.0))
            called = time.time()
            for _, writer in outgoing.values():  # the barrier: one byte to every other peer, one from each
                writer.write(b"\x01")
                await writer.drain()
            for reader, _ in incoming.values():
                await reader.readexactly(1)
            trigger = time.time()
            written = await one_round(sizes, chunk_sizes(sizes[index], chunk), chunk, outgoing, incoming)
            events.append(dict(called=called, trigger=trigger, done=time.time(), ok=True, error=None, received=1.0,
                               written=written))
        write_record(Path(cfg["out"]), events, grad_bytes)
        (work / f"{index}.done").touch()  # (a daemon that shuts down resets its streams: leave together)
        await until_exists(*(work / f"{j}.done" for j in range(n)))
    finally:
        leaving.set()
        await p2p.shutdown()


if __name__ == "__main__":
    asyncio.run(run(json.loads(Path(sys.argv[1]).read_text())))
