"""One member of an all-gather exchange (collabopt.engine.gather_exchange), run as its own OS process by
tests/swarm/test_gather_exchange.py.

Usage: ``python gather_worker.py config.json`` (INITIAL_PEERS in the environment). Config: ``run_id`` (the service's
prefix), ``group_size``, ``seed``, ``size`` (payload bytes), ``weight``, ``phase_timeout``, ``out`` and ``role``:
"honest"; "equivocate" (test-only fault: a payload to the first other member of its group, another, also signed, to
the rest); "victim" (sends its payload to the first other member of its group only, then SIGKILLs itself).
Writes ``<out>.json``: its peer id, the group, whether it applied, the applied set (peer ids, payloads in base64,
weights), the excluded members, the error, its bytes sent and received and the round's seconds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import sys
from pathlib import Path

from collabopt.engine.gather_exchange import ExchangeService
from collabopt.engine.gather_round import ExchangeRound
from collabopt.engine.p2p import start_dht


def payload_of(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


async def equivocate(self, payload, weight, digest, signature, deadline):
    others = [m for m in range(len(self.members)) if m != self.me]
    other = payload[::-1] + b"x"
    _, other_signature = self.sign(other, weight)

    async def send(member, data, sig):
        try:
            await self._call(member, "rpc_offer", deadline, data, weight, sig)
        except Exception as e:
            print(f"offer to {member} failed: {e!r}", flush=True)

    await asyncio.gather(*(send(m, payload, signature) if i == 0 else send(m, other, other_signature)
                           for i, m in enumerate(others)))


async def die_after_one_offer(self, payload, weight, digest, signature, deadline):
    first = next(m for m in range(len(self.members)) if m != self.me)
    await self._call(first, "rpc_offer", deadline, payload, weight, signature)
    print(f"sent to {self.members[first]} only; dying", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    role = cfg.get("role", "honest")
    if role == "equivocate":
        ExchangeRound.send_offers = equivocate
    elif role == "victim":
        ExchangeRound.send_offers = die_after_one_offer
    peers = [p for p in os.environ.get("INITIAL_PEERS", "").split(",") if p]
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    n = cfg["group_size"]
    service = ExchangeService(dht, prefix=cfg["run_id"], target_group_size=n, min_group_size=n,
                              matchmaking_time=cfg.get("matchmaking_time", 3.0), request_timeout=1.0,
                              phase_timeout=cfg.get("phase_timeout", 3.0), max_payload_bytes=cfg.get("max", 2**20))
    result = service.exchange(payload_of(cfg["seed"], cfg["size"]), weight=cfg.get("weight", 1.0),
                              timeout=cfg.get("timeout", 30.0), gather=dict(seed=cfg["seed"]))
    record = dict(me=dht.peer_id.to_base58(), applied=result.applied, error=result.error,
                  group=[peer.to_base58() for peer in result.group],
                  gathered={peer.to_base58(): value for peer, value in result.gathered.items()},
                  excluded=[peer.to_base58() for peer in result.excluded],
                  applied_set=None if result.applied_set is None else [
                      [c.peer.to_base58(), base64.b64encode(c.payload).decode(), c.weight]
                      for c in result.applied_set],
                  sent_bytes=result.sent_bytes, received_bytes=result.received_bytes,
                  round_seconds=result.round_seconds)
    Path(f"{cfg['out']}.json").write_text(json.dumps(record))
    print(f"exchange done: applied={result.applied} error={result.error} sent={result.sent_bytes} "
          f"received={result.received_bytes} round={result.round_seconds:.2f} s", flush=True)
    service.close()
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
