"""How a round's matchmaking finds the others: hivemind's DHT declarations, bounded in time, and the peers it met
before, asked directly.

Rules, and why:

* hivemind's ``Matchmaking`` finds partners through its ``GroupKeyManager``: each peer stores a declaration (its
  peer id and the time its search ends) under the round's group key and reads the others' back. Both are DHT
  operations that wait for every node on the key's path. A node whose link is cut holds each one up for the DHT's
  ``wait_timeout`` (3 s), twice for a store (its lookup, then the store), until the DHT blacklists the node (5 s,
  then 10 s...), and again after. A declaration made for ``matchmaking_time`` (2 s) then lands after it expired and
  is dropped: the healthy peers saw nobody (hivemind asked the DHT about 150 times a second, found nothing) and
  waited out the round's whole timeout. :class:`SearchDHT` is what ``Matchmaking`` gets as its DHT: a store is
  never awaited (it runs in the background: hivemind awaits the store that ends a search between a group's assembly
  and its round, and a cut node held a follower's round back by the wait), and a search looks again at most every
  :data:`PACE` seconds.
* A search returns one view of the others, as a lookup does: it waits (at most :data:`LOOKUP_WAIT`) for its
  requests to the peers whose last request did not go unanswered and for its lookup, so that every peer orders its
  candidate leaders alike (views taken piecemeal sent three peers' join requests round in a circle, each waiting
  ``request_timeout``, and one missed its round). It does not wait for a lookup while the last one took longer
  than :data:`LOOKUP_WAIT` (a node on the key's path is cut), nor for a peer that did not answer its last request: a
  search that waited out a lookup held up by a cut node handed on each answer a second late, and two healthy peers
  re-declaring every 2 s, an odd number of seconds apart, learned each other's declaration just as it ended, every
  time, and formed no group. A lookup or request still under way answers a later search, and the last lookup's
  declarations count until they end.
* The peers this service met (members of its groups, peers found in the declarations, peers that asked) are asked
  directly for their declaration (:class:`DeclarationService`, one request, :data:`LOOKUP_WAIT` at most), so that
  they find each other without the DHT. An answer is the peer's own declaration, with its real end of search, so
  hivemind's rules (who leads whom, when a group is assembled) stay as they are. A peer is asked again every
  :data:`ASK_EVERY` seconds, and at once when the declaration it answered has ended (it declares anew). A peer that
  does not answer is not asked again for :data:`ASK_BACKOFF` seconds; one whose declaration the DHT returned is not
  asked until it ends.
* An answer's end of search counts up to ``matchmaking_time`` from now plus :data:`CLOCK_ALLOWANCE` (hivemind's
  matchmaking takes the latest declared end as assured: one at infinity or far ahead stalled every search). A peer
  that asks joins the hints only after the averaging service's checks, and then in :data:`CALLERS_KEPT` slots of its
  own: asks from fresh ids never push out the peers met in groups or found in the DHT. What a search remembers of
  the peers it asked is pruned to the hints.
* With a swarm key, a request carries the asker's member token and others are not answered (as join requests).
* A follower waits for its leader's verdict (the group assembled, or disbanded) ``patience`` seconds past the end
  of its own search (:class:`RoundMatchmaking`), not only the join request's timeout as hivemind does. The leader
  gives its verdict at the end of its search, and counts every follower it accepted that is still there; with the
  short request timeout of a short ``matchmaking_time`` (half of it: it breaks two peers' requests to each other,
  which concerns only the first answer), a verdict half a second late (a busy machine: the leader or a p2p daemon
  on the way paused) made the follower give up on a leader whose group counted it. That group then waited
  ``sender_timeout`` for the parts of a member that never came, and averaged without them, while the follower's
  search went on and joined the next epoch's group: it had missed a round and downloaded the swarm's state. Its
  patience is the pause after which a round leaves a member out anyway, at most a search and a request long
  (:func:`verdict_patience`). Both the averaging service's rounds and the all-gather exchange match this way.
* A leader accepts a join request only within half the request timeout of its coming (:func:`answered_in_time`). The
  follower waits ``request_timeout`` for that first answer, and a leader answers none while it asks a leader itself
  (hivemind holds the lock while its request's stream opens and for up to that same timeout): two peers that asked
  each other both gave up, and the one whose lock came free first then accepted the other's request, counting a
  follower already gone. Its group assembled with it (4 peers, 3 rounds of about 200 on B3's bed), waited
  ``sender_timeout`` for its parts, and averaged without them, while the follower searched on and missed the round. A
  late acceptance is withdrawn before any group can count it, and the follower, if still there, hears
  ``BAD_EXPIRATION_TIME`` and asks the next leader.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time

logger = logging.getLogger(__name__)

LOOKUP_WAIT = 1.0  # seconds a search waits for the DHT's declarations and the direct answers
PACE = 0.1  # seconds between two searches (hivemind searches again at once after finding nobody)
ASK_BACKOFF = 4.0  # seconds a peer that did not answer is left alone
ASK_EVERY = 0.5  # seconds between two requests to the same peer (its answer holds meanwhile)
HINTS_KEPT, HINT_SECONDS = 16, 300.0  # the most recent peers met, and for how long
CALLERS_KEPT = 4  # the most recent peers that asked this one (kept apart from those met)
CLOCK_ALLOWANCE = 3.0  # seconds two peers' DHT times may differ (hivemind's MAX_DHT_TIME_DISCREPANCY_SECONDS)


class PeerHints:
    """The peers a service met recently (at most :data:`HINTS_KEPT`, seen within :data:`HINT_SECONDS`), and apart
    from them the peers that asked it (at most :data:`CALLERS_KEPT`)."""

    def __init__(self) -> None:
        self._seen: dict[PeerID, float] = {}
        self._callers: dict[PeerID, float] = {}

    def add(self, peers: Iterable[PeerID]) -> None:
        self._add(self._seen, peers, HINTS_KEPT)

    def add_caller(self, peer: PeerID) -> None:
        if peer not in self._seen:
            self._add(self._callers, [peer], CALLERS_KEPT)

    @staticmethod
    def _add(kept: dict[PeerID, float], peers: Iterable[PeerID], limit: int) -> None:
        now = time.monotonic()
        for peer in peers:
            kept.pop(peer, None)
            kept[peer] = now
        while len(kept) > limit:
            kept.pop(next(iter(kept)))

    def peers(self) -> list[PeerID]:
        oldest = time.monotonic() - HINT_SECONDS
        met = [peer for peer, seen in self._seen.items() if seen >= oldest]
        return met + [peer for peer, seen in self._callers.items() if seen >= oldest and peer not in self._seen]


def declared_expiration(matchmaking: Any, group_key: str) -> float | None:
    """When ``matchmaking``'s declaration under ``group_key`` ends (DHT time); None where it looks for no group
    there (not searching, a client, its group assembled, or declared under another key)."""
    if matchmaking is None or matchmaking.client_mode or not matchmaking.is_looking_for_group:
        return None
    if matchmaking.assembled_group.done():
        return None
    leaders = matchmaking.potential_leaders
    expiration = leaders.declared_expiration_time
    if leaders.declared_group_key != group_key or not math.isfinite(expiration):
        return None
    return float(expiration)


class DeclarationService(ServicerBase):
    """Answers "what is your declaration under this group key, for these tensors?": ``answer(request, context)``
    gives the end of this peer's search (DHT time) or None."""

    def __init__(self, answer: Callable[[averaging_pb2.JoinRequest, P2PContext], float | None]):
        self.answer = answer

    async def rpc_declaration(self, request: averaging_pb2.JoinRequest,
                              context: P2PContext) -> averaging_pb2.JoinRequest:
        expiration = self.answer(request, context)
        return averaging_pb2.JoinRequest(schema_hash=request.schema_hash, group_key=request.group_key,
                                         expiration=0.0 if expiration is None else expiration)


class SearchDHT:
    """What hivemind's ``GroupKeyManager`` uses of a DHT (``peer_id``, ``store``, ``get``), for the matchmaking of
    one tensor schema: the DHT's answers within bounded waits, merged with the declarations of the peers in
    ``hints`` asked directly over ``p2p`` (see the module's rules). ``entry()``: this peer's gathered entry (its
    member token) for the requests; ``matchmaking_time``: the longest a declaration lasts (seconds)."""

    def __init__(self, dht: Any, p2p: Any, *, schema_hash: bytes, prefix: str, hints: PeerHints,
                 entry: Callable[[], bytes], matchmaking_time: float):
        self.dht, self.p2p, self.schema_hash, self.prefix = dht, p2p, schema_hash, prefix
        self.hints, self.entry, self.matchmaking_time = hints, entry, matchmaking_time
        self.peer_id = dht.peer_id
        self._background: set[asyncio.Future] = set()  # (asyncio keeps weak references to tasks)
        self._lookups: dict[str, asyncio.Future] = {}
        self._found: dict[str, dict[bytes, ValueWithExpiration]] = {}  # the last lookup's key -> declarations
        self._asking: dict[PeerID, asyncio.Future] = {}  # the requests under way, one a peer
        self._answers: dict[PeerID, tuple[float, float, float | None]] = {}  # peer -> (answered at: monotonic
        # and DHT time, its expiration)
        self._quiet_until: dict[PeerID, float] = {}
        self._silent: set[PeerID] = set()  # peers whose last request went unanswered (not awaited again)
        self._lookup_held = False  # the last lookup took longer than LOOKUP_WAIT (a node on the key's path is cut)
        self._in_dht: dict[PeerID, float] = {}  # peers the last lookup returned -> their expiration
        self._next_search = 0.0
        self._news = asyncio.Event()  # an answer, a silence or a lookup came in since the last search returned

    def _keep(self, future: asyncio.Future) -> asyncio.Future:
        self._background.add(future)
        future.add_done_callback(self._background.discard)
        return future

    async def store(self, key: str, subkey: bytes, value: Any, expiration_time: float, **_: Any) -> bool:
        """Store a declaration in the background; never awaited (see the module's rules)."""
        self._keep(asyncio.ensure_future(self.dht.store(
            key=key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)))
        return True  # (a declaration is advisory, and nothing reads the result)

    async def get(self, key: str, **_: Any) -> ValueWithExpiration | None:
        """The declarations under ``key``, as hivemind's ``DHT.get(key, latest=True)`` returns a dictionary value: the
        last DHT lookup's and the answers of the peers in the hints (one view: see the module's rules)."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, self._next_search - loop.time()))
        self._next_search = loop.time() + PACE
        lookup = self._lookups.get(key)
        awaited: set[asyncio.Future] = set()
        if lookup is None:
            lookup = self._lookups[key] = self._keep(asyncio.ensure_future(self._lookup(key)))
            lookup.add_done_callback(lambda _: self._news.set())
            if not self._lookup_held:
                awaited.add(lookup)
        deadline = loop.time() + LOOKUP_WAIT
        awaited |= self._ask_due(key)
        while not awaited and not self._news.is_set() and not lookup.done() and loop.time() < deadline:
            news = asyncio.ensure_future(self._news.wait())
            try:  # (asyncio.wait, never wait_for: docs/decisions.md, "A search that never ended")
                await asyncio.wait({news}, timeout=min(deadline - loop.time(), self._next_ask_in()))
            finally:
                news.cancel()
            if not self._news.is_set():  # (a peer due meanwhile: its declaration ended, it declares anew)
                awaited = self._ask_due(key)
        if awaited:  # (one view of the peers, as a DHT lookup gives: the order of leaders is everyone's)
            await asyncio.wait(awaited, timeout=max(0.0, deadline - loop.time()))
        self._news.clear()
        self._prune(time.monotonic())
        if lookup.done():
            self._lookups.pop(key, None)
            self._found = {key: self._declarations_in(None if lookup.cancelled() else lookup.result())}
        dht_now = get_dht_time()
        entries = {subkey: entry for subkey, entry in self._found.get(key, {}).items()
                   if entry.expiration_time > dht_now}
        for peer, (_, _, expiration) in self._answers.items():
            if expiration is not None and expiration > dht_now:
                entries[peer.to_bytes()] = ValueWithExpiration(True, expiration)
        if not entries:
            return None
        return ValueWithExpiration(entries, max(entry.expiration_time for entry in entries.values()))

    def _prune(self, now: float) -> None:
        """Forget the answers of peers no longer in the hints, and backoffs that ended: both stay bounded."""
        hinted = set(self.hints.peers())
        self._answers = {peer: answer for peer, answer in self._answers.items() if peer in hinted}
        self._quiet_until = {peer: until for peer, until in self._quiet_until.items() if until > now}
        self._silent &= hinted

    def _ask_due(self, key: str) -> set[asyncio.Future]:
        """Ask the hinted peers that are due (:meth:`_due_in` is 0), in the background; returns the requests the
        search awaits: those to peers whose last request did not go unanswered."""
        awaited = set()
        for peer, due_in in self._due_in().items():
            if due_in <= 0.0:
                self._asking[peer] = self._keep(asyncio.ensure_future(self._ask_in_time(peer, key)))
                if peer not in self._silent:
                    awaited.add(self._asking[peer])
        return awaited

    def _next_ask_in(self) -> float:
        """Seconds until the next hinted peer is due to be asked (inf: none is)."""
        return max(0.0, min(self._due_in().values(), default=math.inf))

    def _due_in(self) -> dict[PeerID, float]:
        """In how many seconds each hinted peer is due to be asked (none under way): every :data:`ASK_EVERY`
        seconds, or at once when the declaration it answered has ended (it declares anew); not while it is quiet or
        its declaration the DHT returned lasts."""
        now, dht_now = time.monotonic(), get_dht_time()
        due = {}
        for peer in self.hints.peers():
            if peer == self.peer_id or peer in self._asking:
                continue
            answered_at, answered_dht, expiration = self._answers.get(peer, (-math.inf, -math.inf, None))
            again = answered_at + ASK_EVERY - now
            if expiration is not None and expiration > answered_dht:  # (one that had ended: ASK_EVERY)
                again = min(again, expiration - dht_now)
            due[peer] = max(again, self._quiet_until.get(peer, 0.0) - now, self._in_dht.get(peer, 0.0) - dht_now)
        return due

    async def _lookup(self, key: str) -> Any:
        started = time.monotonic()
        try:
            return await self.dht.get(key, latest=True, return_future=True)
        except Exception:  # (the DHT is shutting down, or failed: the direct answers still count)
            return None
        finally:
            self._lookup_held = time.monotonic() - started > LOOKUP_WAIT

    async def _ask_in_time(self, peer: PeerID, key: str) -> None:
        """Ask ``peer``; its answer counts when it comes. One that does not answer within :data:`LOOKUP_WAIT` is
        left alone for :data:`ASK_BACKOFF` seconds."""
        task = asyncio.ensure_future(self._ask(peer, key))
        try:
            done, _ = await asyncio.wait({task}, timeout=LOOKUP_WAIT)
        finally:
            task.cancel()  # (a no-op once it answered)
            self._asking.pop(peer, None)
        if done and not task.cancelled() and task.exception() is None:
            self._answers[peer] = (time.monotonic(), get_dht_time(), task.result())
            self._silent.discard(peer)
        else:
            self._quiet_until[peer] = time.monotonic() + ASK_BACKOFF
            self._answers.pop(peer, None)
            self._silent.add(peer)
        self._news.set()

    def _declarations_in(self, found: Any) -> dict[bytes, ValueWithExpiration]:
        value = getattr(found, "value", None)
        self._in_dht.clear()
        if not isinstance(value, dict):
            return {}
        peers = []
        for subkey, entry in value.items():
            try:
                peer = PeerID(subkey)
            except Exception:
                continue
            peers.append(peer)
            if getattr(entry, "value", False):
                self._in_dht[peer] = float(entry.expiration_time)
        self.hints.add(peer for peer in peers if peer != self.peer_id)
        return dict(value)

    async def _ask(self, peer: PeerID, key: str) -> float | None:
        stub = DeclarationService.get_stub(self.p2p, peer, namespace=self.prefix)
        answer = await stub.rpc_declaration(averaging_pb2.JoinRequest(
            schema_hash=self.schema_hash, group_key=key, gather=self.entry()))
        if answer.schema_hash != self.schema_hash or answer.group_key != key or not answer.expiration > 0 \
                or not math.isfinite(answer.expiration):
            return None
        return min(float(answer.expiration), get_dht_time() + self.matchmaking_time + CLOCK_ALLOWANCE)


async def answered_in_time(matchmaking: Any, request: averaging_pb2.JoinRequest, context: P2PContext,
                           arrived: float) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
    """``matchmaking``'s answers to a join request that came at ``arrived`` (``time.monotonic()``), as hivemind's
    ``rpc_join_group`` gives them; an acceptance later than half of ``matchmaking.request_timeout`` after it is
    withdrawn (see the module's rules). hivemind's handler yields its acceptance right after counting the follower,
    under its lock: closing it there lets the follower go before anything else runs."""
    answers = matchmaking.rpc_join_group(request, context)
    try:
        async for message in answers:
            if message.code == averaging_pb2.ACCEPTED and \
                    time.monotonic() - arrived > matchmaking.request_timeout / 2:
                await answers.aclose()
                logger.debug("collabopt: withdrew the acceptance of %s's join request after %.2f s", context.remote_id,
                             time.monotonic() - arrived)
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)
                return
            yield message
    finally:
        await answers.aclose()


def verdict_patience(member_wait: float, matchmaking_time: float, request_timeout: float) -> float:
    """How long past its search a follower waits for its leader's verdict (:class:`RoundMatchmaking`): the round's
    wait for a member's parts (``member_wait``: after that the group leaves a member out anyway), but at most a search
    and a request longer, whatever the model's size (a verdict that late is a leader gone, not paused; meanwhile the
    follower neither leads nor joins another group)."""
    return min(member_wait, matchmaking_time + request_timeout)


class RoundMatchmaking(Matchmaking):
    """hivemind's ``Matchmaking``, whose followers wait for their leader's verdict up to ``patience`` seconds past
    the end of their search (at least ``request_timeout``; see the module's rules and :func:`verdict_patience`).
    hivemind's ``_request_join_group`` reads ``request_timeout`` for the leader's first answer, then, following it
    (``current_leader`` set), for its verdict: only the latter is ``patience``."""

    def __init__(self, *args: Any, patience: float, **kwargs: Any):
        self.patience = patience
        super().__init__(*args, **kwargs)

    @property
    def request_timeout(self) -> float:
        if getattr(self, "current_leader", None) is not None:
            return max(self.patience, self._request_timeout)
        return self._request_timeout

    @request_timeout.setter
    def request_timeout(self, value: float) -> None:
        self._request_timeout = value
