"""The run's address book: every training peer of a run publishes the addresses it is reachable at, and connects to
the run's peers whose addresses the others published.

Rules, and why:

* hivemind's DHT hands peer ids around, not addresses: a peer knows the addresses of the peers it connected to (its
  initial peers first) and asks libp2p's own routing for the others'. That routing keeps only peers whose addresses
  it deems public (or private, on a LAN): on machines whose only address lies in a reserved range such as
  ``192.0.2.0/24`` it finds nothing ("Connect failed. msg=routing: not found"), and two peers that joined through one
  initial peer never reach each other: no round of them all, partial rounds, no download from each other.
* So each peer that others can reach stores ``{peer_id, maddrs}`` under ``<run_id>_addresses`` (a key per run: runs
  that share a DHT never dial each other's peers), subkey its progress records' signed key (``[ed25519:...]``,
  :mod:`collabopt.engine.record_signing`: nobody else can write or replace it), again every :data:`PUBLISH_EVERY`
  seconds, on the key's replicas (:mod:`collabopt.engine.replicas`). Each peer reads the key soon after it starts and
  connects to at most :data:`DIALS_PER_LOOK` peers it is not connected to. Then, every :data:`LOOK_EVERY` seconds
  (spaced out as the swarm grows, :func:`look_period`), it checks its connections to the peers the book named (a local
  question to its p2p daemon, nothing on the wire) and reads the book again at once if one is missing; only while the
  last read found other training peers' progress records, and every one of them in the book and connected, does it
  wait :data:`QUIET_READ` seconds for the next read (new peers dial in themselves: their first looks find this one). A
  peer whose link was cut is thus reached again within seconds of its return, and a swarm whose peers are all
  connected reads the book rarely: every node asked answers with every peer's signed record.
* A record counts only where the same key's progress record names the same peer id (:func:`published_peers`), and
  only for addresses of that peer id, which libp2p checks when it connects: a false record costs a failed dial,
  never a connection to someone else, and an outsider makes no peer dial more than a few addresses per look.
* :class:`AddressRecordValidator` refuses, under the key, anything but a dictionary entry (one plain value with a
  later expiration would replace the whole book) and expirations beyond :data:`LONGEST_RECORD` from now (a record
  that outlives its owner's renewals); the schema bounds every record's size.
* It runs in the DHT's process (``DHT.run_coroutine``), one per run, until :func:`stop_address_book` or the DHT ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, Extra, conbytes, conlist, constr

from collabopt.engine.p2p import connect_to
from collabopt.engine.record_signing import BytesWithOwner, owners_in
from collabopt.engine.replicas import RIDE_ALONG, _store_on_replicas, read_replicas

logger = logging.getLogger(__name__)

PUBLISH_EVERY, RECORD_SECONDS = 20.0, 60.0  # (older peers refuse records of over 90 s: a margin for clocks)
LONGEST_RECORD = 2 * RECORD_SECONDS  # the latest expiration a record may have, from now (clocks differ a little)
FIRST_LOOKS = (0.5, 1.0, 2.0, 3.0)  # seconds after the start: peers that start together find each other at once
LOOK_EVERY, LONGEST_LOOK, PEERS_PER_LOOK = 5.0, 60.0, 16  # see look_period
QUIET_READ = 30.0  # seconds between two reads of the book while every peer it named is connected
DIALS_PER_LOOK = 4
CONNECT_TIMEOUT = 5.0
MAX_MADDRS, MAX_MADDR_CHARS = 8, 256

PeerIdBytes = conbytes(strict=True, min_length=1, max_length=64)
Maddrs = conlist(constr(strict=True, min_length=1, max_length=MAX_MADDR_CHARS), min_items=1, max_items=MAX_MADDRS)


class AddressRecord(BaseModel):
    """A peer's record: its peer id and full multiaddrs."""

    peer_id: PeerIdBytes
    maddrs: Maddrs

    class Config:
        extra = Extra.forbid


class AddressesSchema(BaseModel):
    """The key's records: each under its owner's signed key."""

    addresses: dict[BytesWithOwner, AddressRecord]


def addresses_key(run_id: str) -> str:
    return f"{run_id}_addresses"


class AddressRecordValidator(RecordValidatorBase):
    """Under the keys of ``run_ids``' address books: refuses anything but a dictionary entry under a signed subkey
    (a plain value, whose subkey names no owner, would replace the whole book) and an expiration beyond
    :data:`LONGEST_RECORD` from now. Several instances merge into one."""

    def __init__(self, run_ids: list[str]):
        self.key_ids = {DHTID.generate(source=addresses_key(run_id)).to_bytes() for run_id in run_ids}

    def validate(self, record: Any) -> bool:
        if record.key not in self.key_ids:
            return True
        if not owners_in(record.subkey or b""):
            return False  # a plain value (its subkey names no owner), or an entry anyone may write
        return record.expiration_time <= get_dht_time() + LONGEST_RECORD

    @property
    def priority(self) -> int:
        return 20  # before the signatures' 11 and 10 (higher runs first): cheaper

    def merge_with(self, other: Any) -> bool:
        if not isinstance(other, AddressRecordValidator):
            return False
        self.key_ids |= other.key_ids
        return True


def peers_to_dial(published: dict[PeerID, list[list[str]]], connected: set[PeerID],
                  limit: int = DIALS_PER_LOOK) -> dict[PeerID, list[str]]:
    """At most ``limit`` peers (chosen at random) to connect to, with their addresses, of the ``published`` ones
    (:func:`published_peers`) not ``connected`` already. Where several owners name one peer id, one record is chosen
    at random each time: a false one shadows the peer's own at most for a look."""
    candidates = {peer: maddrs for peer, maddrs in published.items() if peer not in connected}
    chosen = random.sample(sorted(candidates, key=PeerID.to_bytes), min(limit, len(candidates)))
    return {peer: random.choice(candidates[peer]) for peer in chosen}  # (one record of a peer named by several)


def published_peers(found: Any, progress: Any, own: PeerID) -> dict[PeerID, list[list[str]]]:
    """The peers of ``found`` (the value read under the run's address key) and ``progress`` (under its progress
    key), but this one (``own``), each with the address lists its records give: a record counts where the progress
    record of its owner names the same peer id; only addresses of that peer id count, at most :data:`MAX_MADDRS`."""
    training = {owner: getattr(entry, "value", None) for owner, entry in _entries(progress).items()}
    candidates: dict[PeerID, list[list[str]]] = {}
    for owner, entry in _entries(found).items():
        record = getattr(entry, "value", None)
        peer_bytes = record.get("peer_id") if isinstance(record, dict) else None
        maddrs = record.get("maddrs") if isinstance(record, dict) else None
        named = training.get(owner)
        if not isinstance(peer_bytes, bytes) or not isinstance(maddrs, list) or not isinstance(named, dict) \
                or named.get("peer_id") != peer_bytes:
            continue
        try:
            peer = PeerID(peer_bytes)
        except Exception:
            continue
        if peer == own:
            continue
        suffix = f"/p2p/{peer.to_base58()}"  # (addresses of the record's peer only)
        kept = [m for m in maddrs[:MAX_MADDRS] if isinstance(m, str) and len(m) <= MAX_MADDR_CHARS
                and m.endswith(suffix)]
        if kept:
            candidates.setdefault(peer, []).append(kept)
    return candidates


def training_peers(progress: Any, own: PeerID) -> set[PeerID]:
    """The peer ids of the progress records (``progress``, read under the run's progress key) of peers not in client
    mode, but this one (``own``)."""
    peers = set()
    for entry in _entries(progress).values():
        record = getattr(entry, "value", None)
        if isinstance(record, dict) and not record.get("client_mode") and isinstance(record.get("peer_id"), bytes):
            with contextlib.suppress(Exception):
                peers.add(PeerID(record["peer_id"]))
    return peers - {own}


def _entries(found: Any) -> dict[Any, Any]:
    value = getattr(found, "value", None)
    return value if isinstance(value, dict) else {}


def look_period(peers: int) -> float:
    """Seconds between two looks at the book in a swarm of ``peers``: :data:`LOOK_EVERY` up to
    :data:`PEERS_PER_LOOK` peers, then longer in proportion (the key's replicas answer every peer's looks), up to
    :data:`LONGEST_LOOK`."""
    return min(LONGEST_LOOK, LOOK_EVERY * max(1.0, peers / PEERS_PER_LOOK))


Connect = Callable[[Any, PeerID, list[str]], Awaitable[None]]
_BOOKS: dict[str, asyncio.Task] = {}  # in the DHT's process: run id -> its running book


def start_address_book(dht: Any, run_id: str, owner: bytes, publish: bool) -> None:
    """Start ``run_id``'s book in ``dht``'s process (replacing one running there for the run), with the validators
    of its records. ``owner``: the signed key of this peer's progress records (its DHT signs with it); ``publish``:
    this peer is reachable (not a client)."""
    dht.add_validators([SchemaValidator(AddressesSchema, prefix=run_id), AddressRecordValidator([run_id])])
    dht.run_coroutine(functools.partial(keep_peers_connected, run_id, owner, publish, connect_to),
                      return_future=True)


def stop_address_book(dht: Any, run_id: str) -> None:
    """Stop ``run_id``'s book in ``dht``'s process (without waiting; nothing if it runs none or has stopped)."""
    with contextlib.suppress(Exception):
        dht.run_coroutine(functools.partial(_stop, run_id), return_future=True)


async def _stop(run_id: str, _dht: Any, _node: Any) -> None:
    task = _BOOKS.pop(run_id, None)
    if task is not None:
        task.cancel()


async def keep_peers_connected(run_id: str, owner: bytes, publish: bool, connect: Connect, _dht: Any,
                               node: Any) -> None:
    """Run ``run_id``'s book in the DHT's process until it is stopped or the DHT shuts down; ``connect(p2p, peer,
    maddrs)`` opens a connection."""
    this = asyncio.current_task()
    previous, _BOOKS[run_id] = _BOOKS.get(run_id), this
    if previous is not None:
        previous.cancel()
    key, progress_key = addresses_key(run_id), f"{run_id}_progress"
    try:
        with contextlib.suppress(asyncio.CancelledError):
            loop = asyncio.get_running_loop()
            next_publish = next_look = next_read = loop.time()
            looks, peers, named, renewals, published = 0, 0, set(), set(), False
            while True:
                if publish and loop.time() >= next_publish:
                    if not published:  # the first record goes out now; a renewal may wait for a ride
                        published = await _publish(node, key, owner, may_wait=0.0)
                    else:  # (in the background: the looks go on meanwhile)
                        renewal = asyncio.ensure_future(_publish(node, key, owner, may_wait=RIDE_ALONG))
                        renewals.add(renewal)
                        renewal.add_done_callback(renewals.discard)
                    next_publish = loop.time() + PUBLISH_EVERY
                if loop.time() >= next_look:
                    if looks < len(FIRST_LOOKS) or loop.time() >= next_read or await _any_missing(node, named):
                        read = await _connect_to_published(node, key, progress_key, connect)
                        if read is not None:
                            peers, named, all_connected = read
                        # (a failed read, or a peer to dial: the next look reads again)
                        next_read = loop.time() + QUIET_READ if read is not None and all_connected else -float("inf")
                    next_look = loop.time() + (FIRST_LOOKS[looks] if looks < len(FIRST_LOOKS) else look_period(peers))
                    looks += 1
                await asyncio.sleep(max(0.0, min(next_look, next_publish if publish else next_look) - loop.time()))
    finally:
        if _BOOKS.get(run_id) is this:
            del _BOOKS[run_id]


async def _publish(node: Any, key: str, owner: bytes, may_wait: float) -> bool:
    """Store this peer's record (``may_wait``: see :func:`~collabopt.engine.replicas._store_on_replicas`): True if
    a replica took it."""
    try:
        maddrs = [str(m) for m in await node.p2p.get_visible_maddrs(latest=True)][:MAX_MADDRS]
        maddrs = [m for m in maddrs if len(m) <= MAX_MADDR_CHARS]
        if maddrs:
            record = dict(peer_id=node.peer_id.to_bytes(), maddrs=maddrs)
            return await _store_on_replicas(key, owner, record, get_dht_time() + RECORD_SECONDS, None, node, may_wait)
    except Exception as e:  # (no address yet, or the DHT is stopping: the next turn tries again)
        logger.debug("collabopt: could not publish this peer's addresses: %r", e)
    return False


async def _any_missing(node: Any, named: set[PeerID]) -> bool:
    """Whether a peer of ``named`` is not connected to this one (or the p2p daemon did not say)."""
    try:
        connected = {info.peer_id for info in await node.p2p.list_peers()}
    except Exception:
        return True
    return not named <= connected


async def _connect_to_published(node: Any, key: str, progress_key: str,
                                connect: Connect) -> tuple[int, set[PeerID], bool] | None:
    """Connect to a few of the published peers this one misses; return how many training peers the run has, the
    peers the book names, and whether every training peer of the progress records (client-mode peers publish no
    address) is in the book and was connected already (None: the book could not be read)."""
    try:
        read = await read_replicas(node, [key, progress_key])  # (one request to a replica for both keys)
        found, progress = read[key], read[progress_key]
        connected = {info.peer_id for info in await node.p2p.list_peers()}
    except Exception as e:
        logger.debug("collabopt: could not read the run's addresses: %r", e)
        return None
    published = published_peers(found, progress, node.peer_id)
    named = set(published)
    missing = peers_to_dial(published, connected)
    others = training_peers(progress, node.peer_id)  # (none yet: peers that start together look again soon)
    everyone_in = bool(others) and others <= named & connected

    async def reach(peer: PeerID, maddrs: list[str]) -> None:
        try:
            await asyncio.wait_for(connect(node.p2p, peer, maddrs), CONNECT_TIMEOUT)
            logger.debug("collabopt: connected to %s at its published addresses", peer)
        except Exception as e:  # (gone, or unreachable from here: the others' rounds go on without it)
            logger.debug("collabopt: could not connect to %s at %s: %r", peer, maddrs, e)

    await asyncio.gather(*(reach(peer, maddrs) for peer, maddrs in missing.items()))
    return len(_entries(progress)), named, everyone_in and not missing
