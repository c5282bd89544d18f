"""The swarm's address book: every DHT of collabopt publishes the addresses its peer is reachable at, and connects to
the peers whose addresses the others published.

Rules, and why:

* hivemind's DHT hands peer ids around, not addresses: a peer knows the addresses of the peers it connected to (its
  initial peers first) and asks libp2p's own routing for the others'. That routing keeps only peers whose addresses
  it deems public (or private, on a LAN): on machines whose only address lies in a reserved range such as
  ``192.0.2.0/24`` it finds nothing ("Connect failed. msg=routing: not found"), and two peers that joined through one
  initial peer never reach each other: no round of them all, partial rounds, no download from each other.
* So each peer that others can reach stores its visible multiaddrs under :data:`ADDRESSES_KEY` (subkey: its peer
  id; at most :data:`MAX_MADDRS`), again every :data:`PUBLISH_EVERY` seconds, and each peer reads the key soon after
  it starts and then every :data:`LOOK_EVERY` seconds, and connects to the peers it is not connected to. A peer that
  lost its connection (a cut link) is thus reached again at the addresses it published, within seconds of its
  return.
* A record names addresses for the peer id of its subkey only, and libp2p checks that id when it connects: a false
  record costs a failed dial, never a connection to someone else.
* It runs in the DHT's process (``DHT.run_coroutine``) and ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

ADDRESSES_KEY = "collabopt_addresses"
PUBLISH_EVERY, RECORD_SECONDS = 10.0, 45.0
FIRST_LOOKS = (0.5, 1.0, 2.0, 3.0)  # seconds after the start: peers that start together find each other at once
LOOK_EVERY = 5.0
CONNECT_TIMEOUT = 5.0
MAX_MADDRS, MAX_MADDR_CHARS, MAX_PEERS = 8, 256, 256


def addresses_in(found: Any, own: PeerID) -> dict[PeerID, list[str]]:
    """The peers and multiaddrs of a DHT value read under :data:`ADDRESSES_KEY` (a dictionary value: subkey a peer
    id's bytes, value a list of full multiaddr strings of that peer); malformed entries, addresses of another peer
    and this peer's own are left out."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return {}
    peers: dict[PeerID, list[str]] = {}
    for subkey, entry in list(value.items())[:MAX_PEERS]:
        maddrs = getattr(entry, "value", None)
        if not isinstance(subkey, bytes) or not isinstance(maddrs, (list, tuple)):
            continue
        try:
            peer = PeerID(subkey)
        except Exception:
            continue
        suffix = f"/p2p/{peer.to_base58()}"  # (addresses of the subkey's peer only)
        kept = [m for m in maddrs[:MAX_MADDRS] if isinstance(m, str) and len(m) <= MAX_MADDR_CHARS
                and m.endswith(suffix)]
        if peer != own and kept:
            peers[peer] = kept
    return peers


Connect = Callable[[Any, PeerID, list[str]], Awaitable[None]]


async def keep_peers_connected(publish: bool, connect: Connect, _dht: Any, node: Any) -> None:
    """Run the address book in the DHT's process (``dht.run_coroutine(partial(keep_peers_connected, publish,
    connect), return_future=True)``) until the DHT shuts down; ``publish``: this peer is reachable (no client);
    ``connect(p2p, peer, maddrs)`` opens a connection."""
    with contextlib.suppress(asyncio.CancelledError):
        published_at, looks = -PUBLISH_EVERY, 0
        while True:
            if publish and get_dht_time() - published_at >= PUBLISH_EVERY:
                published_at = get_dht_time()
                await _publish(node)
            await _connect_to_published(node, connect)
            await asyncio.sleep(FIRST_LOOKS[looks] if looks < len(FIRST_LOOKS) else LOOK_EVERY)
            looks += 1


async def _publish(node: Any) -> None:
    try:
        maddrs = [str(m) for m in await node.p2p.get_visible_maddrs(latest=True)][:MAX_MADDRS]
        await node.store(ADDRESSES_KEY, maddrs, get_dht_time() + RECORD_SECONDS, subkey=node.peer_id.to_bytes())
    except Exception as e:  # (no address yet, or the DHT is stopping: the next turn tries again)
        logger.debug("collabopt: could not publish this peer's addresses: %r", e)


async def _connect_to_published(node: Any, connect: Connect) -> None:
    try:
        found = await node.get(ADDRESSES_KEY, latest=True)
        connected = {info.peer_id for info in await node.p2p.list_peers()}
    except Exception as e:
        logger.debug("collabopt: could not read the swarm's addresses: %r", e)
        return
    missing = {peer: maddrs for peer, maddrs in addresses_in(found, node.peer_id).items() if peer not in connected}
    if not missing:
        return

    async def reach(peer: PeerID, maddrs: list[str]) -> None:
        try:
            await asyncio.wait_for(connect(node.p2p, peer, maddrs), CONNECT_TIMEOUT)
            logger.debug("collabopt: connected to %s at its published addresses", peer)
        except Exception as e:  # (gone, or unreachable from here: the others' rounds go on without it)
            logger.debug("collabopt: could not connect to %s at %s: %r", peer, maddrs, e)

    await asyncio.gather(*(reach(peer, maddrs) for peer, maddrs in missing.items()))
