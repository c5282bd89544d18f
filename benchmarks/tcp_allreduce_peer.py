"""One B3 peer of a plain-TCP all-reduce: the bed's own ceiling, beside collabopt's runner and raw hivemind.

The same traffic as a butterfly all-reduce of ``grad_bytes`` among N peers, and nothing else: no libp2p, no
encryption, no serialization, no arithmetic. The bytes are split into N equal parts, part ``j`` reduced by peer ``j``.
Each pair of peers shares one TCP connection, as libp2p's streams between two peers share one: each side writes on
it, in chunks, its part for the other and its own part's results for the other, and a reducer answers a chunk as soon
as each sender's copy of it has arrived. So parts and results flow at the same time, both ways on every connection,
as in hivemind's ``rpc_aggregate_part`` streams.

Rounds run one after the other, each after ``idle_seconds`` of idle links (the compute between real rounds) and a
barrier: every peer writes one byte to every other and reads one from each. A round's trigger is the barrier's end; it
is done when the peer has every result and has answered every chunk. Records use the format that
:func:`benchmarks.swarmrun.allreduce_seconds` reads, and each round's event counts the bytes this peer wrote.

Usage: ``python -m benchmarks.tcp_allreduce_peer config.json``; writes ``config['out']`` (JSON).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

PART, RESULT = b"p", b"r"  # each chunk's first byte: what follows


def read_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the other peer closed its connection mid-round")
        view = view[got:]


def connect(addrs: list[str], index: int, port: int) -> dict[int, socket.socket]:
    """One connection with each other peer: opened by the lower index, whose first byte is its index."""
    listener = socket.create_server((addrs[index], port), backlog=len(addrs))
    conns: dict[int, socket.socket] = {}
    for j in range(index + 1, len(addrs)):
        deadline = time.monotonic() + 30
        while True:
            try:
                conns[j] = socket.create_connection((addrs[j], port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        conns[j].settimeout(None)
        conns[j].sendall(bytes([index]))
    while len(conns) < len(addrs) - 1:
        conn, _ = listener.accept()
        hello = bytearray(1)
        read_exactly(conn, memoryview(hello))
        conns[hello[0]] = conn
    listener.close()
    for sock in conns.values():
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conns


def chunk_sizes(size: int, chunk: int) -> list[int]:
    return [min(chunk, size - start) for start in range(0, size, chunk)]


def part_sizes(grad_bytes: int, n: int) -> list[int]:
    """The bytes of each peer's part: ``grad_bytes`` split into ``n`` parts as equal as bytes allow."""
    return [grad_bytes // n + (1 if j < grad_bytes % n else 0) for j in range(n)]


def write_record(out: Path, events: list[dict], grad_bytes: int) -> None:
    """The peer's record, written whole (a runner polls for the file). No benchmarks.common here: it imports torch."""
    out.with_suffix(".tmp").write_text(json.dumps(dict(averaging=events, grad_bytes=grad_bytes)))
    out.with_suffix(".tmp").replace(out)


def one_round(index: int, sizes: list[int], chunk: int, conns: dict[int, socket.socket]) -> int:
    """Write this peer's part for every other peer and read their results; answer every other peer's chunks of this
    peer's part, a chunk once every sender's copy of it has arrived. Returns the bytes this peer wrote."""
    own = chunk_sizes(sizes[index], chunk)
    arrived = {k: 0 for k in conns}
    changed = threading.Condition()
    errors: list[BaseException] = []
    written: list[int] = []  # (list.append is atomic across threads)
    locks = {k: threading.Lock() for k in conns}  # a chunk is written whole: parts and results interleave by chunk
    messages = {kind: memoryview(kind + bytes(chunk)) for kind in (PART, RESULT)}  # (one write: one segment)

    def write(k: int, kind: bytes, size: int) -> None:
        with locks[k]:
            conns[k].sendall(messages[kind][:1 + size])
        written.append(size)

    def write_part(k: int) -> None:
        for size in chunk_sizes(sizes[k], chunk):
            write(k, PART, size)

    def answer(k: int) -> None:
        for c, size in enumerate(own):
            with changed:
                changed.wait_for(lambda c=c: errors or min(arrived.values()) > c)
                if errors:
                    return
            write(k, RESULT, size)

    def read(k: int) -> None:
        parts, results = own, chunk_sizes(sizes[k], chunk)
        got_parts = got_results = 0
        kind, buffer = bytearray(1), memoryview(bytearray(chunk))
        while got_parts < len(parts) or got_results < len(results):
            read_exactly(conns[k], memoryview(kind))
            if kind == PART:
                read_exactly(conns[k], buffer[:parts[got_parts]])
                got_parts += 1
                with changed:
                    arrived[k] = got_parts
                    changed.notify_all()
            else:
                read_exactly(conns[k], buffer[:results[got_results]])
                got_results += 1

    def guarded(fn, k: int) -> threading.Thread:
        def run() -> None:
            try:
                fn(k)
            except BaseException as e:  # reported by the round, which then fails
                errors.append(e)
                with changed:
                    changed.notify_all()
        return threading.Thread(target=run, daemon=True)

    threads = [guarded(fn, k) for k in conns for fn in (write_part, answer, read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sum(written)


def barrier(conns: dict[int, socket.socket]) -> None:
    for sock in conns.values():
        sock.sendall(b"\x01")
    for sock in conns.values():
        read_exactly(sock, memoryview(bytearray(1)))


def mlp_bytes(cfg: dict) -> int:
    """The gradient bytes of B3's MLP (benchmarks.peer's); torch is imported only here."""
    from benchmarks.common import make_mlp

    return sum(p.numel() * p.element_size()
               for p in make_mlp(cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"]).parameters())


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    index, addrs = cfg["index"], cfg["addrs"]
    grad_bytes = cfg.get("grad_bytes") or mlp_bytes(cfg)
    n = len(addrs)
    sizes = part_sizes(grad_bytes, n)
    conns = connect(addrs, index, cfg["port"])
    Path(cfg["ready_file"]).touch()
    wait_until = time.monotonic() + 120
    while not Path(cfg["go_file"]).exists() and time.monotonic() < wait_until:
        time.sleep(0.05)
    events = []
    for _ in range(cfg["rounds"]):
        time.sleep(cfg.get("idle_seconds", 0.0))
        called = time.time()
        barrier(conns)
        trigger = time.time()
        written = one_round(index, sizes, cfg.get("part_size_bytes", 2**19), conns)
        events.append(dict(called=called, trigger=trigger, done=time.time(), ok=True, error=None, received=1.0,
                           written=written))
    write_record(Path(cfg["out"]), events, grad_bytes)
    for sock in conns.values():
        sock.close()


if __name__ == "__main__":
    main(sys.argv[1])
