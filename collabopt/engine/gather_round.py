"""One round of the all-gather exchange among an assembled group (:mod:`collabopt.engine.gather_exchange`): every
member sends its signed payload to every other, the members exchange what they hold, fetch what they lack, and
confirm the set they decided (the rules: :mod:`collabopt.engine.gather_protocol`).

Rules, and why:

* Three phases of ``phase_timeout`` seconds each, counted from the round's start; a phase ends early once every
  member it waits for answered. (1) offers: a member's payload, weight and signature to each other member;
  (2) digests: the statements a member holds (frozen as it sends its digest, so that what it told the others is
  what it decides by); (3) confirmations of the decision hash, while payloads it lacks are fetched from a member
  whose digest holds them (checked against the signed hash).
* Everything from the network is checked before it counts: the sender is a member (its authenticated libp2p peer
  id), a payload is at most ``max_payload_bytes``, a weight is finite and >= 0 (not -0.0), a signature verifies
  under the key the sender announced. What fails is refused with a logged reason, never raised in the service. At
  most two statements of a sender are kept (two prove it equivocated), so a hostile member cannot grow a member's
  memory.
* Messages are unary calls (msgpack in ``DownloadData.metadata``): a payload must fit one daemon message
  (:data:`MAX_PAYLOAD_LIMIT`).
* A message for a group this member has not registered yet (the leader's last matchmaking message may come after a
  fast member's offer) waits for the registration only while this member assembles a group, only within the size
  of an offer, at most :data:`REGISTRATION_WAIT` seconds and at most :data:`PENDING_LIMIT` messages at once (more
  are refused): any peer may send messages, and each holds a payload's memory while it waits.
* A member whose gathered data this member cannot use (unreadable, no Ed25519 key) is absent from the round: it
  counts in the group's size for the majority and none of its messages count.
* Where the group has more than ``max_contributors`` present members, only the round's contributors
  (:func:`~collabopt.engine.gather_protocol.contributors`) send a payload; the others send the empty one with their
  weight (they still confirm the set, and apply it), and a statement of a payload from them is refused. A statement
  of weight 0 counts only for the empty payload, which every member holds without fetching it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine import gather_protocol as protocol
from collabopt.engine.streams import VERDICT_LINGER, serve_until_the_caller_closes

logger = logging.getLogger(__name__)

# A payload and its envelope must fit one message of the daemon's persistent connection (hivemind: 4 MiB)
MAX_PAYLOAD_LIMIT = 3 * 2**20
# How long a message for a group this member has not registered yet waits for the registration
REGISTRATION_WAIT = 5.0
# How many messages may wait for a registration at once (memory: up to one payload each)
PENDING_LIMIT = 16
# What a message holds beyond its payload (a digest: about 230 bytes a member)
MESSAGE_OVERHEAD = 2**16
HASH_BYTES, SIGNATURE_BYTES = 32, 64


def _message(*fields: Any) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(list(fields)))


def _is_weight(weight: Any) -> bool:
    """A finite number >= 0, not -0.0 (which equals 0.0 in a set but not in a decision's hash: a member signing
    each to different members would make every honest member refuse the round without being excluded)."""
    return isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight) and \
        math.copysign(1.0, weight) > 0


class Refused(Exception):
    """A message from the network that does not count (the reason is logged and answered)."""


def _public_key(raw: bytes | None) -> Ed25519PublicKey | None:
    try:
        return None if raw is None else Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return None


class ExchangeRound:
    """One member's side of one round. ``keys``: the Ed25519 public key each member announced (raw, 32 bytes; None
    for a member whose gathered data does not do: absent, see the module's rules); ``gathered``: each member's
    gathered data as this member received it (raw bytes; in the view the members confirm, see
    :func:`~collabopt.engine.gather_protocol.view_hash`); ``stub_for(peer)``: the member's
    :class:`ExchangeServicer` stub; ``max_contributors``: see the module's rules (None: every member contributes)."""

    def __init__(self, *, group_id: bytes, members: Sequence[PeerID], me: int, keys: Sequence[bytes | None],
                 gathered: Sequence[bytes], signing_key: Ed25519PrivateKey, stub_for: Callable[[PeerID], Any],
                 phase_timeout: float, max_payload_bytes: int, max_contributors: int | None = None):
        self.group_id, self.members, self.me = group_id, tuple(members), me
        self.signing_key, self.stub_for = signing_key, stub_for
        self.phase_timeout, self.max_payload_bytes = phase_timeout, max_payload_bytes
        self.view = protocol.view_hash(group_id, [m.to_bytes() for m in self.members], [k or b"" for k in keys],
                                       [bytes(data) for data in gathered])
        self.keys = [_public_key(key) for key in keys]
        self.absent = frozenset(m for m, key in enumerate(self.keys) if key is None)
        if me in self.absent:
            raise ValueError("this member's own key is not among the group's keys")
        self.present = [m for m in range(len(self.members)) if m != me and m not in self.absent]  # (the others)
        self.contributors = protocol.contributors(group_id, [m.to_bytes() for m in self.members], max_contributors,
                                                  self.absent)
        self.held: dict[int, dict[tuple[bytes, float], bytes]] = {}  # sender -> statement -> signature (direct)
        self.payloads: dict[int, dict[bytes, bytes]] = {}  # sender -> payload hash -> payload
        self.digests: dict[int, list[tuple[int, bytes, float]]] = {}  # member -> the statements it holds
        self.confirmations: dict[int, bytes] = {}
        self.problems: dict[int, str] = {}  # member -> what went wrong with it
        self.sent_bytes = self.received_bytes = 0
        self._changed = asyncio.Event()
        self._sending: list[asyncio.Task] = []

    # ---------------------------------------------------------------- checks
    def _verified(self, sender: int, digest: Any, weight: Any, signature: Any) -> tuple[bytes, float]:
        if not (isinstance(digest, bytes) and len(digest) == HASH_BYTES and _is_weight(weight)
                and isinstance(signature, bytes) and len(signature) == SIGNATURE_BYTES):
            raise Refused("a malformed statement")
        if self.keys[sender] is None:
            raise Refused(f"a statement of {self.members[sender]}, absent from this round (no usable key)")
        if digest != protocol.EMPTY_HASH and sender not in self.contributors:
            raise Refused(f"a payload from {self.members[sender]}, not one of this round's {len(self.contributors)} "
                          f"contributors")
        if weight == 0 and digest != protocol.EMPTY_HASH:
            raise Refused(f"a statement of weight 0 from {self.members[sender]} for a payload that is not empty")
        statement = protocol.statement_bytes(self.group_id, self.members[sender].to_bytes(), digest, float(weight))
        try:
            self.keys[sender].verify(signature, statement)
        except InvalidSignature:
            raise Refused(f"a statement of {self.members[sender]} whose signature does not verify") from None
        return digest, float(weight)

    def _keep(self, sender: int, digest: bytes, weight: float, signature: bytes) -> None:
        statements = self.held.setdefault(sender, {})
        if (digest, weight) in statements or len(statements) < 2:  # (two prove an equivocation)
            statements.setdefault((digest, weight), signature)

    def sign(self, payload: bytes, weight: float) -> tuple[bytes, bytes]:
        digest = protocol.payload_hash(payload)
        statement = protocol.statement_bytes(self.group_id, self.members[self.me].to_bytes(), digest, weight)
        return digest, self.signing_key.sign(statement)

    # ---------------------------------------------------------------- what others send (ExchangeServicer)
    def on_offer(self, sender: int, fields: list) -> None:
        payload, weight, signature = fields
        if not isinstance(payload, bytes) or len(payload) > self.max_payload_bytes:
            raise Refused(f"a payload that is no bytes or over max_payload_bytes={self.max_payload_bytes}")
        digest, weight = self._verified(sender, protocol.payload_hash(payload), weight, signature)
        self._keep(sender, digest, weight, signature)
        stored = self.payloads.setdefault(sender, {})
        if len(stored) < 2:
            stored.setdefault(digest, payload)
        self._changed.set()

    def on_digest(self, member: int, fields: list) -> None:
        (entries,) = fields
        if member in self.digests:
            raise Refused("a second digest")
        if not isinstance(entries, list) or len(entries) > 2 * len(self.members):
            raise Refused("a digest that is no list or holds more than two statements a member")
        verified = []
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 4 and type(entry[0]) is int
                    and 0 <= entry[0] < len(self.members)):
                raise Refused("a digest entry that names no member")
            verified.append((entry[0], *self._verified(*entry)))
        self.digests[member] = verified
        self._changed.set()

    def on_confirm(self, member: int, fields: list) -> None:
        (digest,) = fields
        if not isinstance(digest, bytes) or len(digest) != HASH_BYTES or member in self.confirmations:
            raise Refused("a malformed or second confirmation")
        self.confirmations[member] = digest
        self._changed.set()

    def on_fetch(self, fields: list) -> bytes:
        sender, digest = fields
        payload = self.payloads.get(sender, {}).get(digest) if isinstance(sender, int) else None
        if payload is None:
            raise Refused("a fetch of a payload this member does not hold")
        return payload

    # ---------------------------------------------------------------- this member's side
    async def _call(self, member: int, rpc: str, deadline: float, *fields: Any) -> list:
        request = _message(self.group_id, *fields)
        self.sent_bytes += request.ByteSize()
        timeout = max(0.1, deadline - time.monotonic())
        answer = await getattr(self.stub_for(self.members[member]), rpc)(request, timeout=timeout)
        self.received_bytes += answer.ByteSize()
        ok, value = MSGPackSerializer.loads(answer.metadata)
        if not ok:
            raise ConnectionError(f"{rpc} refused: {value}")
        return value

    def _tell_all(self, rpc: str, deadline: float, *fields: Any) -> dict[int, asyncio.Task]:
        """Send one message to every other member, each in a task of its own (a failure is that member's, logged at
        debug level): a member gone does not hold up the messages to the others."""
        async def send(member: int) -> None:
            try:
                await self._call(member, rpc, deadline, *fields)
            except Exception as e:
                self.problems.setdefault(member, f"{rpc}: {e!r}")
                logger.debug("collabopt: %s to %s failed: %r", rpc, self.members[member], e)
        tasks = {m: asyncio.create_task(send(m)) for m in self.present}
        self._sending.extend(tasks.values())  # (a task the loop alone refers to may be collected before its end)
        return tasks

    async def send_offers(self, payload: bytes, weight: float, digest: bytes, signature: bytes,
                          deadline: float) -> None:
        """Phase 1's sending (a test's fault injection replaces it)."""
        await asyncio.gather(*self._tell_all("rpc_offer", deadline, payload, weight, signature).values())

    def _log_phase(self, what: str, members: Any, start: float) -> None:
        logger.debug("collabopt: exchange: %s of members %s after %.2f s", what, sorted(members),
                     time.monotonic() - start)

    async def _until(self, done: Callable[[], bool], deadline: float) -> None:
        while not done() and time.monotonic() < deadline:
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))

    async def _fetch(self, sender: int, digest: bytes, holders: list[int], deadline: float) -> None:
        for holder in holders:
            try:
                payload = await self._call(holder, "rpc_fetch", deadline, sender, digest)
            except Exception as e:
                logger.debug("collabopt: fetching %s's payload from %s failed: %r", sender, holder, e)
                continue
            if isinstance(payload, bytes) and protocol.payload_hash(payload) == digest:
                self.payloads.setdefault(sender, {})[digest] = payload
                return
            logger.warning("collabopt: %s sent a payload of %s that does not match its signed hash",
                           self.members[holder], self.members[sender])

    async def run(self, payload: bytes, weight: float, start: float) -> tuple[protocol.Decision | None, str | None]:
        """The round from this member's side: its decision, and why it must not apply it (None: it may). A member
        that is not one of the round's contributors sends the empty payload with its ``weight`` (it waits: the
        others count it, :func:`~collabopt.engine.gather_protocol.contributors`); weight 0 sends the empty payload."""
        others = self.present
        if self.me not in self.contributors or weight == 0:
            payload = b""
        digest, signature = self.sign(payload, weight)
        self._keep(self.me, digest, weight, signature)
        self.payloads[self.me] = {digest: payload}
        sending = asyncio.create_task(self.send_offers(payload, weight, digest, signature,
                                                       start + self.phase_timeout))
        sending.add_done_callback(lambda task: task.cancelled() or task.exception())
        await self._until(lambda: all(m in self.held for m in others), start + self.phase_timeout)
        self._log_phase("offers", self.held, start)
        frozen = {sender: dict(statements) for sender, statements in self.held.items()}
        entries = [[sender, d, w, sig] for sender, statements in frozen.items() for (d, w), sig in statements.items()]
        self._tell_all("rpc_digest", start + 2 * self.phase_timeout, entries)
        await self._until(lambda: all(m in self.digests for m in others), start + 2 * self.phase_timeout)
        self._log_phase("digests", self.digests, start)
        sending.cancel()
        evidence: dict[int, set[tuple[bytes, float]]] = {s: set(st) for s, st in frozen.items()}
        for statements in self.digests.values():
            for sender, d, w in statements:
                evidence.setdefault(sender, set()).add((d, w))
        decision = protocol.decide(evidence)
        for sender in decision.excluded:
            logger.warning("collabopt: %s signed two different contributions to this round: excluded",
                           self.members[sender])
        mine = protocol.decision_hash(self.view, decision)
        end = start + 3 * self.phase_timeout
        for sender, digest, _ in decision.applied:  # (every member holds the empty payload)
            if digest == protocol.EMPTY_HASH:
                self.payloads.setdefault(sender, {})[digest] = b""
        fetches = [asyncio.create_task(self._fetch(s, d, [m for m in self.digests if (s, d, w) in self.digests[m]],
                                                   end)) for s, d, w in decision.applied
                   if d not in self.payloads.get(s, {})]
        confirming = [m for m in self.digests if m not in decision.excluded]  # (the others sent no digest: gone)
        telling = self._tell_all("rpc_confirm", end, mine)
        await self._until(lambda: all(m in self.confirmations for m in confirming), end)
        self._log_phase("confirmations", self.confirmations, start)
        # (a member whose digest came must get this confirmation; those that sent none are taken for gone)
        await asyncio.gather(*fetches, *(telling[m] for m in confirming))
        reason = protocol.refusal(decision, self.me, len(self.members), mine, self.confirmations)
        lacking = [self.members[s] for s, d, _ in decision.applied if d not in self.payloads.get(s, {})]
        if reason is None and lacking:
            reason = f"the payloads of {lacking} could not be fetched from any member that holds them"
        if reason is not None:
            logger.warning("collabopt: this member does not apply the exchange of its group: %s", reason)
        return decision, reason


class ExchangeServicer(ServicerBase):
    """The handlers of the exchange on one peer: join requests (handed to the matchmaking of the request's schema,
    ``matchmaking_for``) and the messages of the rounds registered (:meth:`register`) in ``rounds``.
    ``assembling``: how many of this member's matchmakings run (:meth:`assembled` at each one's end, after its
    registration); only then may a message wait for its group (the module's rules)."""

    def __init__(self, matchmaking_for: Callable[[bytes], Any], max_payload_bytes: int = MAX_PAYLOAD_LIMIT):
        self.matchmaking_for = matchmaking_for
        self.max_message_bytes = max_payload_bytes + MESSAGE_OVERHEAD
        self.rounds: dict[bytes, ExchangeRound] = {}
        self.assembling = self.pending = 0
        self._waiting: dict[bytes, list] = {}  # group id -> [its registration's event, how many wait for it]

    def register(self, group_id: bytes, round_: ExchangeRound) -> None:
        self.rounds[group_id] = round_
        if (waiting := self._waiting.pop(group_id, None)) is not None:
            waiting[0].set()

    def assembled(self) -> None:
        """One matchmaking of this member ended (its group registered, or none): with none left, a message still
        waiting is for no group of this member's."""
        self.assembling -= 1
        if not self.assembling:
            for event, _ in self._waiting.values():
                event.set()
            self._waiting.clear()

    async def _round_for(self, group_id: bytes) -> ExchangeRound:
        if group_id not in self.rounds:
            if not self.assembling:
                raise Refused("a message for a group this member is not in")
            if self.pending >= PENDING_LIMIT:
                raise Refused(f"a message for a group not registered yet while {PENDING_LIMIT} others wait")
            self.pending += 1
            waiting = self._waiting.setdefault(group_id, [asyncio.Event(), 0])
            waiting[1] += 1
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(waiting[0].wait(), REGISTRATION_WAIT)
            finally:
                self.pending -= 1
                waiting[1] -= 1
                if not waiting[1] and self._waiting.get(group_id) is waiting:
                    del self._waiting[group_id]
        round_ = self.rounds.get(group_id)
        if round_ is None:
            raise Refused("a message for a group this member is not in")
        return round_

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        matchmaking = self.matchmaking_for(request.schema_hash)
        if matchmaking is None:  # (no exchange of this schema here now)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for message in serve_until_the_caller_closes(matchmaking.rpc_join_group(request, context),
                                                            VERDICT_LINGER):
            yield message

    async def _handle(self, kind: str, request: averaging_pb2.DownloadData, context: P2PContext,
                      arity: int) -> averaging_pb2.DownloadData:
        """Check a message's envelope and sender and hand it to its round; whatever fails is logged and answered."""
        try:
            if len(request.metadata) > self.max_message_bytes:
                raise Refused(f"a message of {len(request.metadata)} bytes, over {self.max_message_bytes}")
            try:
                fields = MSGPackSerializer.loads(request.metadata)
            except Exception:
                raise Refused("an unreadable message") from None
            if not isinstance(fields, list) or len(fields) != arity + 1 or not isinstance(fields[0], bytes):
                raise Refused("a malformed message")
            round_ = await self._round_for(fields[0])
            if context.remote_id not in round_.members or context.remote_id == round_.members[round_.me]:
                raise Refused("a message from a peer that is no other member of the group")
            sender = round_.members.index(context.remote_id)
            if sender in round_.absent:
                raise Refused("a message from a member absent from this round (its gathered data does not do)")
            round_.received_bytes += request.ByteSize()
            if kind == "fetch":
                answer = _message(True, round_.on_fetch(fields[1:]))
            else:
                getattr(round_, f"on_{kind}")(sender, fields[1:])
                answer = _message(True, None)
            round_.sent_bytes += answer.ByteSize()
            return answer
        except Refused as e:
            logger.warning("collabopt: refused %s from %s in the exchange: %s", kind, context.remote_id, e)
            return _message(False, str(e))
        except Exception as e:  # (a bug, or data no check caught: never the service's end)
            logger.warning("collabopt: %s from %s failed in the exchange: %r", kind, context.remote_id, e)
            return _message(False, repr(e))

    async def rpc_offer(self, request: averaging_pb2.DownloadData,
                        context: P2PContext) -> averaging_pb2.DownloadData:
        return await self._handle("offer", request, context, 3)

    async def rpc_digest(self, request: averaging_pb2.DownloadData,
                         context: P2PContext) -> averaging_pb2.DownloadData:
        return await self._handle("digest", request, context, 1)

    async def rpc_confirm(self, request: averaging_pb2.DownloadData,
                          context: P2PContext) -> averaging_pb2.DownloadData:
        return await self._handle("confirm", request, context, 1)

    async def rpc_fetch(self, request: averaging_pb2.DownloadData,
                        context: P2PContext) -> averaging_pb2.DownloadData:
        return await self._handle("fetch", request, context, 2)
