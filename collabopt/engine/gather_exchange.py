"""collabopt's all-gather exchange: every member of a round receives every contributor's payload (opaque bytes, e.g.
a compressed pseudo-gradient; every other member's up to ``max_contributors``) and aggregates for itself, so that no
member has to trust another's reduction.

Rules, and why:

* Groups form as the averaging service's do (:mod:`collabopt.engine.averager`): hivemind's ``Matchmaking`` behind
  the swarm key's member gate, under a key that hashes this exchange's settings, so that peers of other settings
  never join, finding the others through :class:`~collabopt.engine.group_search.SearchDHT` (bounded, paced DHT
  reads, and the peers met before asked directly: hivemind's matchmaking reads the DHT back to back while it finds
  nobody, and every node asked answers with every declaration). Each member announces in its gathered data a fresh
  Ed25519 key, with which it signs its contribution (:mod:`collabopt.engine.gather_protocol` says why not the
  swarm key).
* The round (:mod:`collabopt.engine.gather_round`) ends with a set every applying member shares: the contributions
  in the group's order, the members that sent two different ones excluded. A member that cannot show agreement
  within the round's time applies nothing; :class:`ExchangeResult` says so, as data, never as an exception. The
  agreement covers every member's gathered data as each received it: members that a leader told different
  metadata (an epoch, an anchor) weigh contributions by different facts, so none of them applies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine.averager import _MemberGate, _Search, declaration_for
from collabopt.engine.gather_round import MAX_PAYLOAD_LIMIT, ExchangeRound, ExchangeServicer, _is_weight
from collabopt.engine.group_search import DeclarationService, PeerHints, RoundMatchmaking, SearchDHT, verdict_patience
from collabopt.engine.member_checks import entry_token_refusal
from collabopt.engine.p2p import own_replica
from collabopt.engine.replicas import ReplicaRecords
from collabopt.engine.service_thread import ScheduledWork, ServiceThread
from collabopt.membership import MemberToken, swarm_key_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Contribution:
    """One member's contribution to a round: its ``payload``, ``weight`` and the payload's SHA-256 (``digest``)."""

    peer: PeerID
    payload: bytes
    weight: float
    digest: bytes


@dataclasses.dataclass(frozen=True)
class ExchangeResult:
    """One exchange: ``applied_set`` (the contributions to aggregate, in the group's order; None where this member
    must not apply the round), ``excluded`` (members that sent different payloads to different members), the
    ``group``, what each member ``gathered``, ``error`` (why nothing is applied, or None), and the bytes this member
    sent and received (``sent_bytes`` / ``received_bytes``: the bodies of requests and answers), how long its
    round took from the payload's hand-over (``round_seconds``), whether this member was one of the round's
    contributors (``contributed``; False: it sent the empty payload with its weight, see ``max_contributors``) and who
    they were (``contributors``; None: every member)."""

    applied_set: tuple[Contribution, ...] | None
    excluded: tuple[PeerID, ...]
    group: tuple[PeerID, ...]
    gathered: dict[PeerID, Any]
    error: str | None = None
    sent_bytes: int = 0
    received_bytes: int = 0
    round_seconds: float = 0.0
    contributed: bool = True
    contributors: tuple[PeerID, ...] | None = None

    @property
    def applied(self) -> bool:
        return self.applied_set is not None


class ExchangeService(ServiceThread):
    """All-gathers opaque payloads with the peers of ``dht`` that run an exchange of the same ``prefix``.

    ``prefix``: the run id and a name of this exchange, without '.' and other than any averaging service's on the
    same DHT (both would find the other's leaders in the DHT and lose matchmaking time asking them).
    ``target_group_size`` / ``min_group_size``, ``matchmaking_time``, ``request_timeout``: as
    :class:`~collabopt.engine.averager.AveragingService`'s. ``phase_timeout``: how long each of the round's three
    phases waits for the other members. ``max_payload_bytes``: the largest payload a member sends or accepts (at
    most :data:`~collabopt.engine.gather_round.MAX_PAYLOAD_LIMIT`). ``max_contributors``: in a group of more members,
    only that many contribute a payload each round (:func:`~collabopt.engine.gather_protocol.contributors`); None:
    every member. Every peer of the exchange must use the same (put it in the ``prefix``)."""

    def __init__(self, dht: Any, *, prefix: str, target_group_size: int | None = None, min_group_size: int = 2,
                 matchmaking_time: float = 5.0, request_timeout: float = 3.0, phase_timeout: float = 5.0,
                 max_payload_bytes: int = 2**20, max_contributors: int | None = None, start_timeout: float = 60.0):
        if not prefix or "." in prefix:
            raise ValueError(f"prefix must be a non-empty string without '.', got {prefix!r} (use the run id)")
        if min_group_size < 2 or (target_group_size is not None and target_group_size < min_group_size):
            raise ValueError(f"min_group_size must be >= 2 and target_group_size >= min_group_size, got "
                             f"{min_group_size} and {target_group_size}")
        if not (isinstance(max_payload_bytes, int) and 0 < max_payload_bytes <= MAX_PAYLOAD_LIMIT):
            raise ValueError(f"max_payload_bytes must be an int in 1..{MAX_PAYLOAD_LIMIT} (one message of the "
                             f"daemon), got {max_payload_bytes!r}")
        if not phase_timeout > 0:
            raise ValueError(f"phase_timeout must be positive, got {phase_timeout!r}")
        if max_contributors is not None and not (type(max_contributors) is int and max_contributors >= 1):
            raise ValueError(f"max_contributors must be None or an int >= 1, got {max_contributors!r}")
        self.dht, self.prefix = dht, prefix
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.matchmaking_time, self.request_timeout = matchmaking_time, request_timeout
        self.phase_timeout, self.max_payload_bytes = phase_timeout, max_payload_bytes
        self.max_contributors = max_contributors
        self.schema = DHTID.generate(source=["collabopt-gather-exchange", 1, max_payload_bytes]).to_bytes()
        self.servicer = ExchangeServicer(self._matchmaking_for, max_payload_bytes)
        self.declarations = DeclarationService(self._declaration)
        self._hints = PeerHints()
        self.p2p: Any = None
        self._matchmaking: Matchmaking | None = None
        self._busy: asyncio.Lock | None = None
        self._key = swarm_key_of(dht)
        self._signing_key = Ed25519PrivateKey.generate()  # (a fresh key a process: nothing to store or leak)
        self._public_key = self._signing_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._start_thread(f"collabopt-exchange-{prefix}", start_timeout)

    async def _start(self) -> None:
        self._busy = asyncio.Lock()
        self.p2p = await own_replica(self.dht)
        await self.servicer.add_p2p_handlers(self.p2p, namespace=self.prefix)
        await self.declarations.add_p2p_handlers(self.p2p, namespace=self.prefix)
        search_dht = SearchDHT(ReplicaRecords(self.dht), self.p2p, schema_hash=self.schema, prefix=self.prefix,
                               hints=self._hints, entry=lambda: self._my_entry(None),
                               matchmaking_time=self.matchmaking_time)  # (declarations on the key's replicas)
        self._matchmaking = RoundMatchmaking(  # (a follower waits for its leader's verdict: group_search)
            self.p2p, self.schema, search_dht, servicer_type=ExchangeServicer, prefix=self.prefix,
            target_group_size=self.target_group_size, min_group_size=self.min_group_size,
            min_matchmaking_time=self.matchmaking_time, request_timeout=self.request_timeout, client_mode=False,
            patience=verdict_patience(self.phase_timeout, self.matchmaking_time, self.request_timeout))

    async def _stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.servicer.remove_p2p_handlers(self.p2p, namespace=self.prefix)
            await self.declarations.remove_p2p_handlers(self.p2p, namespace=self.prefix)
        await self._leave(self.p2p)

    def _matchmaking_for(self, schema: bytes) -> Any:
        return None if schema != self.schema or self._matchmaking is None else \
            _MemberGate(self._matchmaking, self._key, self.prefix)

    def _declaration(self, request: Any, context: Any) -> float | None:
        matchmaking = self._matchmaking if request.schema_hash == self.schema else None
        return declaration_for(request, context, matchmaking, self._hints, self._key, self.prefix)

    # ---------------------------------------------------------------- rounds
    def exchange(self, payload: bytes, weight: float = 1.0, timeout: float = 30.0,
                 gather: Any = None) -> ExchangeResult:
        """All-gather ``payload`` (with ``weight``, e.g. this peer's sample count) with a group, within ``timeout``
        seconds for matchmaking, and the round's three phases after it. ``gather``: any msgpack-able value every
        member receives (``ExchangeResult.gathered``)."""
        scheduled = self.schedule(timeout=timeout, gather=gather)
        scheduled.run(payload, weight)
        return scheduled.result()

    def schedule(self, timeout: float = 30.0, gather: Any = None, scheduled_time: float | None = None,
                 admits: Any = None) -> ScheduledExchange:
        """Begin matchmaking now for a payload that comes later (:meth:`ScheduledExchange.run`): a group forms until
        ``scheduled_time`` (DHT time; default ``matchmaking_time`` from now); matchmaking and the wait for the
        payload give up ``timeout`` seconds from now. ``admits``: as for the averaging service's rounds
        (:meth:`~collabopt.engine.averager.AveragingService.schedule`)."""
        if self._closed:
            raise RuntimeError("this ExchangeService is closed")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        now = get_dht_time()
        search = _Search(scheduled_time=now + self.matchmaking_time if scheduled_time is None else scheduled_time,
                         deadline=now + timeout, data_for_gather=self._my_entry(gather),
                         admits=None if admits is None else lambda theirs: admits(_gathered_of(theirs)))
        scheduled = ScheduledExchange(self, float(timeout))
        scheduled._trigger = self._event_loop.create_future()
        scheduled._future = asyncio.run_coroutine_threadsafe(self._scheduled(scheduled, search), self._event_loop)
        return scheduled

    def _my_entry(self, gather: Any) -> bytes:  # (see _gathered_of)
        token = None if self._key is None else \
            MemberToken.issue(self._key, self.prefix, self.p2p.peer_id.to_bytes()).to_bytes()
        return MSGPackSerializer.dumps([True, [gather, self._public_key], token])

    def _group_of(self, group: Any) -> tuple[dict[PeerID, Any], list[bytes | None]] | str:
        """What each member gathered and the key it announced; or why the group's gathered data does not do.

        A member whose data is unreadable or holds no Ed25519 key is absent (key None, left out of ``gathered``,
        logged): one peer of another version, or a hostile one, must not end the round for the others."""
        members = tuple(group.peer_ids)
        gathered, keys = {}, []
        for peer, data in zip(members, group.gathered, strict=True):
            try:
                entry = MSGPackSerializer.loads(data)
                gather, key = entry[1]
                absent = None if isinstance(key, bytes) and len(key) == len(self._public_key) else \
                    "announced no Ed25519 key"
            except Exception as e:  # (a member of another version, or a hostile one)
                absent = f"unreadable gathered data: {e!r}"
            if peer == self.p2p.peer_id and (absent is not None or key != self._public_key):
                return "the group's data does not hold this member's own key (its leader changed it)"
            if absent is not None:
                logger.warning("collabopt: %s is absent from this exchange round: %s", peer, absent)
                keys.append(None)
                continue
            if self._key is not None and (refusal := entry_token_refusal(entry, self._key, self.prefix,
                                                                         peer.to_bytes())) is not None:
                return f"{peer} of this group is no member of the swarm ({refusal})"
            gathered[peer] = gather
            keys.append(key)
        return gathered, keys

    async def _assemble(self, scheduled: ScheduledExchange,
                        search: _Search) -> tuple[Any, ExchangeRound, dict[PeerID, Any]] | ExchangeResult:
        """Matchmaking, then the group's round registered (the others' offers may come before this member's
        payload); or why there is no round."""
        assert self._busy is not None and self._matchmaking is not None
        async with self._busy:  # (one matchmaking at a time; a round may overlap the next one's)
            try:
                group = await self._matchmaking.look_for_group(search)
            except Exception as e:
                return ExchangeResult(None, (), (), {}, f"matchmaking failed: {e!r}")
        if group is None:
            return ExchangeResult(None, (), (), {}, f"no group assembled within {scheduled.timeout:.1f} s")
        members = scheduled.group = tuple(group.peer_ids)
        self._hints.add(member for member in members if member != self.p2p.peer_id)
        known = self._group_of(group)
        if isinstance(known, str):
            return ExchangeResult(None, (), members, {}, known)
        gathered, keys = known
        try:
            round_ = ExchangeRound(group_id=group.group_id, members=members, me=members.index(self.p2p.peer_id),
                                   keys=keys, gathered=group.gathered, signing_key=self._signing_key,
                                   stub_for=self._stub_for, phase_timeout=self.phase_timeout,
                                   max_payload_bytes=self.max_payload_bytes, max_contributors=self.max_contributors)
        except Exception as e:  # (this member not in the list: a hostile leader)
            return ExchangeResult(None, (), members, gathered, f"the group's data does not do: {e!r}")
        self.servicer.register(group.group_id, round_)
        return group, round_, gathered

    async def _scheduled(self, scheduled: ScheduledExchange, search: _Search) -> ExchangeResult:
        assert scheduled._trigger is not None
        start = time.monotonic()
        self.servicer.assembling += 1
        try:
            assembled = await self._assemble(scheduled, search)
        finally:  # (after the registration: the messages that waited for it go on)
            self.servicer.assembled()
        if isinstance(assembled, ExchangeResult):
            return assembled
        group, round_, gathered = assembled
        members = round_.members
        try:
            try:
                payload, weight = await asyncio.wait_for(asyncio.shield(scheduled._trigger),
                                                         max(0.0, start + scheduled.timeout - time.monotonic()))
            except (asyncio.TimeoutError, asyncio.CancelledError):
                return ExchangeResult(None, (), members, gathered, "this member handed no payload to its group")
            began = time.monotonic()
            try:
                decision, reason = await round_.run(payload, weight, began)
            except Exception as e:  # (a bug, or a member's data no check caught: an outcome, never a raise)
                decision, reason = None, f"round failed: {e!r}"
        finally:  # (the others may still fetch from this member and confirm to it)
            self._event_loop.call_later(self.phase_timeout, self._unregister, group.group_id, round_)
        excluded = () if decision is None else tuple(members[m] for m in decision.excluded)
        applied = None if reason is not None or decision is None else tuple(
            Contribution(members[s], round_.payloads[s][d], w, d) for s, d, w in decision.applied)
        return ExchangeResult(applied, excluded, members, gathered, reason, round_.sent_bytes,
                              round_.received_bytes, time.monotonic() - began,
                              contributed=round_.me in round_.contributors,
                              contributors=tuple(members[m] for m in sorted(round_.contributors)))

    def _unregister(self, group_id: bytes, round_: ExchangeRound) -> None:
        if self.servicer.rounds.get(group_id) is round_:
            del self.servicer.rounds[group_id]

    def _stub_for(self, peer: PeerID) -> Any:
        return ExchangeServicer.get_stub(self.p2p, peer, namespace=self.prefix)


class ScheduledExchange(ScheduledWork):
    """An exchange of :meth:`ExchangeService.schedule`: matchmaking runs, the round waits for :meth:`run`.
    ``group``: the members, once assembled (None before)."""

    def __init__(self, service: ExchangeService, timeout: float):
        self.service, self.timeout = service, timeout
        self.group: tuple[PeerID, ...] | None = None
        self.triggered = False
        self._future: Any = None
        self._trigger: asyncio.Future | None = None

    def run(self, payload: bytes, weight: float = 1.0) -> None:
        """Hand this member's ``payload`` and ``weight`` to the round. Once only. Weight 0, or a round this member
        does not contribute to (``max_contributors``), sends the empty payload instead."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
        if len(payload) > self.service.max_payload_bytes:
            raise ValueError(f"payload is {len(payload)} bytes, over max_payload_bytes="
                             f"{self.service.max_payload_bytes} (raise it, up to {MAX_PAYLOAD_LIMIT})")
        if not _is_weight(weight):
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        if self.triggered:
            raise RuntimeError("this exchange has its payload already")
        self.triggered = True
        value = (bytes(payload), float(weight))
        self.service._event_loop.call_soon_threadsafe(self._set_trigger, value)

    def tag_along(self) -> None:
        """Take part with nothing (an empty payload of weight 0, which no aggregate reads): leaving a group already
        assembled makes its members wait a phase for this member's offer, and counts against their majority."""
        self.run(b"", 0.0)

    def result(self, timeout: float | None = None) -> ExchangeResult:
        """The exchange's result (waits up to ``timeout``, default: as long as the exchange may take)."""
        if timeout is None:
            timeout = self.timeout + 3 * self.service.phase_timeout + 30
        try:
            return self._future.result(timeout)
        except concurrent.futures.CancelledError:
            return ExchangeResult(None, (), self.group or (), {}, "cancelled")


def _gathered_of(entry: Any) -> Any:
    """What a member gathered, from its entry's middle part (``[gather, public key]``); None where unreadable."""
    return entry[0] if isinstance(entry, (list, tuple)) and len(entry) == 2 else None


__all__ = ["Contribution", "ExchangeResult", "ExchangeService", "ScheduledExchange"]
