"""One peer behind NAT for test_nat.py: starts a DHT as collabopt does (``relay_peers`` from argv, or none), writes its
peer id and addresses to ``<dir>/<name>.json``, waits for ``<dir>/<other>.json`` and pings that peer's DHT; writes
the outcome to ``<dir>/<name>.result.json``.

    python relay_worker.py DIR NAME OTHER HOST INITIAL_PEERS [RELAY_PEERS]
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

from hivemind.p2p import PeerID

from collabopt import swarm


def write_json(path: Path, value: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value))
    os.replace(path.with_suffix(".tmp"), path)


async def ping(peer_id: PeerID, _dht, node) -> bool:
    return await node.protocol.call_ping(peer_id) is not None


def main() -> None:
    workdir, name, other, host, initial_peers, *relay = sys.argv[1:]
    workdir = Path(workdir)
    options = swarm.SwarmOptions(initial_peers=[initial_peers], host_maddrs=[f"/ip4/{host}/tcp/0"],
                                 relay_peers=relay[0] if relay else None)
    dht = swarm.start_dht(options)
    write_json(workdir / f"{name}.json", dict(peer_id=dht.peer_id.to_base58(),
                                              maddrs=[str(m) for m in dht.get_visible_maddrs()]))
    deadline = time.monotonic() + 60
    while not (workdir / f"{other}.json").exists():
        assert time.monotonic() < deadline, f"{other} never started"
        time.sleep(0.2)
    other_id = PeerID.from_base58(json.loads((workdir / f"{other}.json").read_text())["peer_id"])

    answered = False
    for _ in range(5):  # a relay reservation takes a moment after start
        answered = dht.run_coroutine(functools.partial(ping, other_id))
        print(f"{name} pinged {other}: {'answered' if answered else 'no answer'}", flush=True)
        if answered:
            break
        time.sleep(2)
    write_json(workdir / f"{name}.result.json", dict(answered=answered))
    deadline = time.monotonic() + 15  # stay up while the other one pings (until it wrote its answer)
    while not (workdir / f"{other}.result.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    dht.shutdown()


if __name__ == "__main__":
    main()
