"""collabopt's averaging service: ``average(tensors, weight, timeout)`` with the peers of a swarm, and the evidence
of what happened, from a background thread with its own asyncio loop.

Rules, and why:

* It is composed of hivemind's transport, not derived from its averagers: the DHT's libp2p daemon (a connection of
  its own, :func:`~collabopt.engine.p2p.own_replica`), ``ServicerBase`` handlers
  (:class:`~collabopt.engine.allreduce.AllReduceService`),
  hivemind's ``Matchmaking`` to assemble a group (finding the others through
  :class:`~collabopt.engine.group_search.SearchDHT`; a follower waits for its leader's verdict up to
  ``sender_timeout``: :class:`~collabopt.engine.group_search.RoundMatchmaking`, its one override), and collabopt's
  own runner and part reducers (:mod:`collabopt.engine.allreduce`). What a round does is thus readable here and
  there, not in overrides.
* It runs in a thread of the calling process (no averager process, no shared-memory buffers): the tensors it is handed
  are copied into the round, and the result comes back as new tensors.
* A round's outcome is a value (:class:`AveragingResult`): the group, what each member gathered, the averaged tensors
  and the round's evidence (:class:`~collabopt.engine.allreduce.RoundEvidence`); no group, a timeout or a lost member
  are reported there, never raised. :mod:`collabopt.engine.protocol` judges it.
* Members must all use the same ``prefix``, ``aggregation``, compression and part size, and tensors of the same
  shapes and dtypes: the matchmaking key hashes them all (:func:`~collabopt.engine.round_schema.round_schema`), so
  peers that differ never form a group (a reducer also refuses a part in another compression than its own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine.allreduce import AllReduceRound, AllReduceService, RoundEvidence
from collabopt.engine.clipping import MIN_CLIPPED_GROUP
from collabopt.engine.group_search import (
    DeclarationService,
    PeerHints,
    RoundMatchmaking,
    SearchDHT,
    answered_in_time,
    declared_expiration,
    verdict_patience,
)
from collabopt.engine.member_checks import entry_token_refusal
from collabopt.engine.p2p import own_replica
from collabopt.engine.part_reducer import AGGREGATES
from collabopt.engine.replicas import ReplicaRecords
from collabopt.engine.round_schema import round_schema
from collabopt.engine.service_thread import ScheduledWork, ServiceThread
from collabopt.engine.streams import MemberStub
from collabopt.membership import MemberToken, SwarmKey, swarm_key_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AveragingResult:
    """One call of :meth:`AveragingService.average`: ``tensors`` (None where no group was assembled), the ``group``
    (members in the round's order, empty without one), what each member ``gathered`` (its ``gather`` argument), the
    round's ``evidence`` (None without a group) and ``error`` (why no round ran, or None)."""

    tensors: list[torch.Tensor] | None
    group: tuple[PeerID, ...]
    gathered: dict[PeerID, Any]
    evidence: RoundEvidence | None
    error: str | None = None


@dataclasses.dataclass
class _Search:
    """What hivemind's ``Matchmaking.look_for_group`` reads of its ``StepControl`` (when to begin, when to give up,
    the bytes to gather), and the rule this peer's gate applies while it leads (:meth:`AveragingService.schedule`)."""

    scheduled_time: float
    deadline: float
    data_for_gather: bytes
    admits: Callable[[Any], bool] | None = None

    def get_timeout(self) -> float:
        return max(0.0, self.deadline - get_dht_time())


class AveragingService(ServiceThread):
    """Averages tensors with the peers of ``dht`` that run a service of the same ``prefix``.

    ``target_group_size`` / ``min_group_size``: the group matchmaking assembles (``aggregation="centered_clip"``
    needs at least 3: CenteredClip bounds a hostile member only where honest members outnumber it).
    ``matchmaking_time``: how long a peer gathers a group; ``request_timeout``: how long it waits for a leader's
    answer. ``sender_timeout`` / ``reducer_timeout``: how long a reducer waits for a sender's next part and a sender
    for a reducer's next result, before leaving it out. ``client_mode``: reduce nothing (peers that others cannot
    reach). ``on_group``: called in the service's thread with each assembled group (for logs and tests)."""

    def __init__(self, dht: Any, *, prefix: str, target_group_size: int | None = None, min_group_size: int = 2,
                 matchmaking_time: float = 5.0, request_timeout: float = 3.0, sender_timeout: float = 5.0,
                 reducer_timeout: float = 10.0, aggregation: str = "mean",
                 compression: CompressionBase = NoCompression(), part_size_bytes: int = 2**19,
                 client_mode: bool = False, on_group: Callable[[tuple[PeerID, ...]], None] | None = None,
                 start_timeout: float = 60.0):
        if not prefix or "." in prefix:
            raise ValueError(f"prefix must be a non-empty string without '.', got {prefix!r} (use the run id)")
        if aggregation not in AGGREGATES:
            raise ValueError(f"aggregation must be one of {tuple(AGGREGATES)}, got {aggregation!r}")
        if aggregation == "centered_clip" and min_group_size < MIN_CLIPPED_GROUP:
            raise ValueError(f"min_group_size must be at least {MIN_CLIPPED_GROUP} with aggregation='centered_clip' "
                             f"(got {min_group_size}): in a smaller group a hostile member pulls as hard as the rest")
        if min_group_size < 2 or (target_group_size is not None and target_group_size < min_group_size):
            raise ValueError(f"min_group_size must be >= 2 and target_group_size >= min_group_size, got "
                             f"{min_group_size} and {target_group_size}")
        if not reducer_timeout > sender_timeout:
            raise ValueError(f"reducer_timeout ({reducer_timeout}) must exceed sender_timeout ({sender_timeout})")
        self.dht, self.prefix, self.aggregation = dht, prefix, aggregation
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.matchmaking_time, self.request_timeout = matchmaking_time, request_timeout
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self.compression, self.part_size_bytes, self.client_mode = compression, part_size_bytes, client_mode
        self.on_group = on_group
        self.p2p: Any = None
        self.servicer = AllReduceService(self._matchmaking_for)
        self.declarations = DeclarationService(self._declaration)  # (peers met before find each other without the DHT)
        self._hints = PeerHints()
        self._matchmakings: dict[bytes, Matchmaking] = {}
        self._busy: asyncio.Lock | None = None
        self._key = swarm_key_of(dht)  # (with a swarm key: only members that prove it join a group)
        self._start_thread(f"collabopt-averaging-{prefix}", start_timeout)

    # ---------------------------------------------------------------- the thread
    async def _start(self) -> None:
        self._busy = asyncio.Lock()
        self.p2p = await own_replica(self.dht)
        await self.servicer.add_p2p_handlers(self.p2p, namespace=self.prefix)
        await self.declarations.add_p2p_handlers(self.p2p, namespace=self.prefix)

    async def _stop(self) -> None:
        """Remove the handlers, then leave (:meth:`ServiceThread._leave`)."""
        with contextlib.suppress(Exception):  # (the DHT may be gone already: nothing left to remove)
            await self.servicer.remove_p2p_handlers(self.p2p, namespace=self.prefix)
            await self.declarations.remove_p2p_handlers(self.p2p, namespace=self.prefix)
        await self._leave(self.p2p)

    # ---------------------------------------------------------------- rounds
    def average(self, tensors: Sequence[torch.Tensor], weight: float = 1.0, timeout: float = 30.0,
                gather: Any = None) -> AveragingResult:
        """Average ``tensors`` (by ``weight``, e.g. this peer's sample count) with a group of peers, within
        ``timeout`` seconds for matchmaking and the round together (the round gets at least ``reducer_timeout``).
        ``gather``: any msgpack-able value every member of the group receives (``AveragingResult.gathered``)."""
        _check_weight(weight)
        scheduled = self.schedule(tensors, timeout=timeout, gather=gather)
        scheduled.run(tensors, weight)
        return scheduled.result()

    def schedule(self, template: Sequence[torch.Tensor], timeout: float = 30.0, gather: Any = None,
                 scheduled_time: float | None = None, contributes: Callable[[dict[PeerID, Any]], bool] | None = None,
                 target_group_size: Any = ..., admits: Callable[[Any], bool] | None = None,
                 infos: Sequence[CompressionInfo] | None = None) -> ScheduledRound:
        """Begin a round now whose tensors come later (:meth:`ScheduledRound.run`): matchmaking assembles a group
        for tensors shaped like ``template`` until ``scheduled_time`` (DHT time; default: ``matchmaking_time`` from
        now) and gives up ``timeout`` seconds from now; the all-reduce begins once the group is assembled and the
        tensors are handed over. ``contributes(gathered)``: asked once the group is known; False: this member takes
        part with weight 0 and zeros (its values must not count in this group, e.g. they belong to another epoch).
        ``admits(theirs)``: asked, while this peer leads, of each peer that asks to join (what it gathers); False
        refuses it (it looks for another leader; a client-mode peer, which can lead none, is never refused so).
        ``target_group_size``: this round's (default: the service's); ``infos``: the tensors' compression infos."""
        if self._closed:
            raise RuntimeError("this AveragingService is closed")
        _check_tensors(template)
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        shapes = [(t.shape, t.dtype) for t in template]
        schema = round_schema(shapes, self.compression, self.part_size_bytes, self.aggregation, infos)
        now = get_dht_time()
        search = _Search(scheduled_time=now + self.matchmaking_time if scheduled_time is None else scheduled_time,
                         deadline=now + timeout, data_for_gather=b"", admits=admits)
        scheduled = ScheduledRound(self, shapes, float(timeout), infos)
        scheduled._trigger = self._event_loop.create_future()  # (set and read in the service's thread only)
        scheduled._future = asyncio.run_coroutine_threadsafe(
            self._scheduled(scheduled, schema, search, gather, contributes,
                            self.target_group_size if target_group_size is ... else target_group_size),
            self._event_loop)
        return scheduled

    def _matchmaking_for(self, schema_hash: bytes) -> Any:
        matchmaking = self._matchmakings.get(schema_hash)
        return None if matchmaking is None else _MemberGate(matchmaking, self._key, self.prefix)

    def _matchmaker(self, schema_hash: bytes) -> Matchmaking:
        if schema_hash not in self._matchmakings:
            search_dht = SearchDHT(ReplicaRecords(self.dht), self.p2p, schema_hash=schema_hash, prefix=self.prefix,
                                   hints=self._hints, entry=lambda: self._my_entry(None),  # (engine.group_search)
                                   matchmaking_time=self.matchmaking_time)  # (declarations on the key's replicas)
            self._matchmakings[schema_hash] = RoundMatchmaking(
                self.p2p, schema_hash, search_dht, servicer_type=AllReduceService, prefix=self.prefix,
                target_group_size=self.target_group_size, min_group_size=self.min_group_size,
                min_matchmaking_time=self.matchmaking_time, request_timeout=self.request_timeout,
                client_mode=self.client_mode,
                patience=verdict_patience(self.sender_timeout, self.matchmaking_time, self.request_timeout))
        return self._matchmakings[schema_hash]

    def _declaration(self, request: averaging_pb2.JoinRequest, context: P2PContext) -> float | None:
        return declaration_for(request, context, self._matchmakings.get(request.schema_hash), self._hints,
                               self._key, self.prefix)

    def _stub_for(self, peer: PeerID) -> Any:
        stub = AllReduceService.get_stub(self.p2p, peer, namespace=self.prefix)
        return MemberStub(stub, {"rpc_aggregate_part": self.reducer_timeout}, self.p2p.peer_id.to_bytes(), peer)

    def _my_entry(self, gather: Any) -> bytes:
        token = None if self._key is None else \
            MemberToken.issue(self._key, self.prefix, self.p2p.peer_id.to_bytes()).to_bytes()
        return MSGPackSerializer.dumps([not self.client_mode, gather, token])

    async def _scheduled(self, scheduled: ScheduledRound, schema: bytes, search: _Search, gather: Any,
                         contributes: Callable[[dict[PeerID, Any]], bool] | None,
                         target_group_size: int | None = None) -> AveragingResult:
        assert self._busy is not None
        start = time.monotonic()
        search.data_for_gather = self._my_entry(gather)
        async with self._busy:  # (one matchmaking at a time; an all-reduce may overlap the next one's)
            try:
                matchmaking = self._matchmaker(schema)
                matchmaking.target_group_size = target_group_size
                group = await matchmaking.look_for_group(search)
            except Exception as e:
                return AveragingResult(None, (), {}, None, f"matchmaking failed: {e!r}")
        if group is None:
            logger.debug("collabopt: no group assembled within %.1f s", scheduled.timeout)
            return AveragingResult(None, (), {}, None, f"no group assembled within {scheduled.timeout:.1f} s")
        members = tuple(group.peer_ids)
        logger.debug("collabopt: group %s assembled after %.1f s: %s", group.group_id.hex()[:8],
                     time.monotonic() - start, [str(member)[-6:] for member in members])
        scheduled.group = members
        self._hints.add(members)  # (the peers met: SearchDHT asks them directly, never this peer itself)
        if self.on_group is not None:
            self.on_group(members)
        try:
            entries = [MSGPackSerializer.loads(data) for data in group.gathered]
            fractions = [1.0 if entry[0] else 0.0 for entry in entries]
            gathered = {peer: entry[1] for peer, entry in zip(members, entries, strict=True)}
        except Exception as e:  # (a member of another version, or a hostile one: no round with it)
            return AveragingResult(None, members, {}, None, f"unreadable gathered data: {e!r}")
        refusal = self._refusal(members, entries)
        if refusal is not None:
            logger.warning("collabopt: %s: the round is refused before any part is sent", refusal)
            return AveragingResult(None, members, gathered, None, refusal)
        if not any(fractions):
            return AveragingResult(None, members, gathered, None, "every member is a client")
        assert scheduled._trigger is not None
        try:  # (the others' parts wait for this member's registration: REGISTRATION_WAIT)
            tensors, weight = await asyncio.wait_for(asyncio.shield(scheduled._trigger),
                                                     max(0.0, start + scheduled.timeout - time.monotonic()))
        except (asyncio.TimeoutError, asyncio.CancelledError):
            return AveragingResult(None, members, gathered, None, "this member handed no tensors to its group")
        try:  # (whatever goes wrong from here is an outcome too: a bug, or a member's data no check caught)
            if contributes is not None and not contributes(gathered):
                tensors, weight = [torch.zeros_like(t) for t in tensors], 0.0
            round_ = AllReduceRound(
                group_id=group.group_id, members=members, me=members.index(self.p2p.peer_id),
                tensors=tensors, weight=weight, stub_for=self._stub_for, fractions=fractions,
                aggregate=AGGREGATES[self.aggregation], compression=self.compression,
                part_size_bytes=self.part_size_bytes, sender_timeout=self.sender_timeout,
                reducer_timeout=self.reducer_timeout, tensor_infos=scheduled.infos)
            scheduled.began_allreduce = True
            with self.servicer.registered(round_):
                deadline = max(start + scheduled.timeout, time.monotonic() + self.reducer_timeout)
                outputs, evidence = await round_.run(deadline)
        except Exception as e:
            logger.warning("collabopt: the round of group %s failed: %r", members, e)
            return AveragingResult(None, members, gathered, None, f"round failed: {e!r}")
        logger.debug("collabopt: group %s's round ended after %.1f s: received %.3f, errors %s",
                     group.group_id.hex()[:8], time.monotonic() - start, evidence.received, evidence.errors)
        return AveragingResult(outputs, members, gathered, evidence)

    def _refusal(self, members: tuple[PeerID, ...], entries: list[Any]) -> str | None:
        """With a swarm key: why a member of the assembled group is no member of the swarm (every member checks
        every token, the leader's too: followers take its member list as it sends it); None where all are."""
        if self._key is None:
            return None
        for peer, entry in zip(members, entries, strict=True):
            refusal = entry_token_refusal(entry, self._key, self.prefix, peer.to_bytes())
            if refusal is not None:
                return f"{peer} of this group is no member of the swarm ({refusal})"
        return None


class ScheduledRound(ScheduledWork):
    """A round of :meth:`AveragingService.schedule`: matchmaking runs, the all-reduce waits for :meth:`run`.

    ``group``: the members, once assembled (None before). ``triggered``: :meth:`run` was called. ``infos``: the
    tensors' compression infos (None: the default, :class:`~collabopt.engine.slices.Slices`).
    ``began_allreduce``: the all-reduce began (this member's tensors are in the round)."""

    def __init__(self, service: AveragingService, shapes: list[tuple[torch.Size, torch.dtype]], timeout: float,
                 infos: Sequence[CompressionInfo] | None = None):
        self.service, self.shapes, self.timeout, self.infos = service, shapes, timeout, infos
        self.group: tuple[PeerID, ...] | None = None
        self.triggered = self.began_allreduce = False
        self._future: Any = None
        self._trigger: asyncio.Future | None = None  # (the tensors and weight; set in the service's thread)

    def run(self, tensors: Sequence[torch.Tensor], weight: float = 1.0) -> None:
        """Hand this member's ``tensors`` (copied now) and ``weight`` to the round. Once only."""
        _check_tensors(tensors)
        if [(t.shape, t.dtype) for t in tensors] != self.shapes:
            raise ValueError("tensors must have the shapes and dtypes of the round's template")
        _check_weight(weight)
        if self.triggered:
            raise RuntimeError("this round has its tensors already")
        self.triggered = True
        copies = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
        self.service._event_loop.call_soon_threadsafe(self._set_trigger, (copies, float(weight)))

    def tag_along(self) -> None:
        """Take part with nothing: zeros, weight 0 (leaving a group already assembled makes its members wait)."""
        self.run([torch.zeros(shape, dtype=dtype) for shape, dtype in self.shapes], 0.0)

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the round ends (in the service's thread; at once where it has)."""
        self._future.add_done_callback(lambda _: callback())

    def result(self, timeout: float | None = None) -> AveragingResult:
        """The round's result (waits up to ``timeout``, default: as long as the round may take)."""
        if timeout is None:
            timeout = self.timeout + self.service.reducer_timeout + 30
        try:
            return self._future.result(timeout)
        except concurrent.futures.CancelledError:
            return AveragingResult(None, self.group or (), {}, None, "cancelled")


class _MemberGate:
    """The matchmaking of one tensor schema, behind the swarm key and the search's own rule: a join request without
    the caller's valid member token is refused before hivemind's matchmaking reads it (``PROTOCOL_VIOLATION``), so is
    one this peer's search does not admit (``BAD_GROUP_KEY``), and a late acceptance is withdrawn (answered_in_time)."""

    def __init__(self, matchmaking: Matchmaking, key: SwarmKey | None, scope: str):
        self.matchmaking, self.key, self.scope = matchmaking, key, scope

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        arrived, entry = time.monotonic(), _loads(request.gather)
        if self.key is not None:
            refusal = entry_token_refusal(entry, self.key, self.scope, context.remote_id.to_bytes())
            if refusal is not None:
                logger.warning("collabopt: refused %s in matchmaking: %s", context.remote_id, refusal)
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
        admits = getattr(getattr(self.matchmaking, "step_control", None), "admits", None)  # (None: not leading)
        if admits is not None and not request.client_mode and isinstance(entry, (list, tuple)) and len(entry) == 3 \
                and not admits(entry[1]):
            logger.debug("collabopt: this search does not admit %s (%r)", context.remote_id, entry[1])
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
            return
        async for message in answered_in_time(self.matchmaking, request, context, arrived):
            yield message


def declaration_for(request: averaging_pb2.JoinRequest, context: P2PContext, matchmaking: Matchmaking | None,
                    hints: PeerHints, key: SwarmKey | None, prefix: str) -> float | None:
    """A service's declaration for a member that asks (:class:`~collabopt.engine.group_search.SearchDHT`), given its
    ``matchmaking`` for the request's tensors (None: tensors it never matched, and the caller is no hint); with a
    swarm ``key``, only for a caller whose member token proves it a member."""
    if matchmaking is None or (key is not None and entry_token_refusal(_loads(request.gather), key, prefix,
                                                                       context.remote_id.to_bytes())):
        return None
    hints.add_caller(context.remote_id)
    return declared_expiration(matchmaking, request.group_key)


def _loads(data: bytes) -> Any:
    try:
        return MSGPackSerializer.loads(data)
    except Exception:
        return None


def _check_tensors(tensors: Sequence[torch.Tensor]) -> None:
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("tensors must be a non-empty sequence of torch.Tensor")


def _check_weight(weight: Any) -> None:
    if not (isinstance(weight, (int, float)) and weight >= 0 and weight == weight and weight != float("inf")):
        raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
