"""Members only in averaging: the matchmaking, all-reduce and state-download checks of a swarm key (issue 35;
docs/design/trust.md, section 2). Without a key (an open swarm) nothing here changes what hivemind does.

A member proves itself with a :class:`~collabopt.membership.MemberToken` bound to its libp2p peer id, which every
check matches with the caller's authenticated peer id:

* matchmaking: each member's token travels in its gathered data, a fourth entry after hivemind's ``[bandwidth,
  mode, metadata]``. A leader refuses a join request without a valid token (:class:`MemberMatchmaking`), and every
  member checks every member's token, the leader's too, before the all-reduce starts (followers take the leader's
  member list on trust in hivemind 1.1.12);
* state download (collabopt's state service, :mod:`collabopt.engine.state_service`): hivemind's ``DownloadRequest``
  has no fields, so a downloader stores its token in the DHT record ``<prefix>.members`` (which only key holders can
  read or write) before it downloads (:func:`store_member_token`), and the serving member refuses a caller whose
  token it does not find there (:func:`download_refusal`; the download challenge too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hivemind.averaging import averager, matchmaking
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.membership import MemberToken, SwarmKey, member_token_refusal, swarm_key_of

logger = get_logger(__name__)

_TOKEN_ENTRY = 3  # the token's index in a member's gathered data, after hivemind's [bandwidth, mode, metadata]


def with_token(data: bytes, key: SwarmKey, scope: str, peer_id: bytes) -> bytes:
    """A member's gathered data (hivemind's serialized ``[bandwidth, mode, metadata]``) with a new token appended."""
    entry = MSGPackSerializer.loads(data)
    return MSGPackSerializer.dumps([*entry[:_TOKEN_ENTRY], MemberToken.issue(key, scope, peer_id).to_bytes()])


def gathered_refusal(data: Any, key: SwarmKey, scope: str, peer_id: bytes) -> str | None:
    """Why the gathered ``data`` of the member ``peer_id`` does not prove it a member; None where it does."""
    try:
        entry = MSGPackSerializer.loads(data)
        if not isinstance(entry, (list, tuple)) or len(entry) != _TOKEN_ENTRY + 1:
            return "it sent no member token (no swarm key, or a peer without collabopt's membership checks)"
        token = MemberToken.from_bytes(entry[_TOKEN_ENTRY])
    except Exception:
        return "its member token cannot be read"
    return member_token_refusal(key, scope, token, peer_id)


def without_token(data: bytes) -> bytes:
    """Gathered data as hivemind reads it: ``[bandwidth, mode, metadata]``."""
    return MSGPackSerializer.dumps(MSGPackSerializer.loads(data)[:_TOKEN_ENTRY])


class MemberMatchmaking(matchmaking.Matchmaking):
    """hivemind's matchmaking, whose leader refuses a join request that carries no valid member token of the
    caller (``PROTOCOL_VIOLATION``: hivemind has no code for it) where the swarm has a key."""

    def _check_reasons_to_reject(self, request: averaging_pb2.JoinRequest,
                                 context: P2PContext) -> averaging_pb2.MessageFromLeader | None:
        reason = super()._check_reasons_to_reject(request, context)
        key = swarm_key_of(self.group_key_manager.dht)
        if reason is not None or key is None:
            return reason
        refusal = gathered_refusal(request.gather, key, self.group_key_manager.prefix, context.remote_id.to_bytes())
        if refusal is None:
            return None
        logger.warning(f"collabopt: refused {context.remote_id} in matchmaking: {refusal}")
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)


MEMBERS_RECORD = "{prefix}.members"


class MemberChecks:
    """A mixin for collabopt's averagers, placed before the other averaging mixins (it removes the tokens before
    they read the gathered data): the member checks of this module, active where the averager's DHT was started
    with a swarm key (:func:`~collabopt.membership.swarm_key_of`). The tokens' scope is the averager's prefix
    (``<run_id>_grad_averager``, ...): a token made for one averager or run passes for no other."""

    def run(self) -> None:
        averager.Matchmaking = MemberMatchmaking  # (this averager's own process; read as its matchmaking starts)
        super().run()  # type: ignore[misc]

    @property
    def _member_key(self) -> SwarmKey | None:
        return swarm_key_of(self.dht)  # type: ignore[attr-defined]

    async def _step(self, *, step: Any, **kwargs: Any) -> Any:
        key = self._member_key
        if key is not None:  # (the averager's process) this member's token joins the data its group gathers:
            # hivemind's StepControl offers no setter, and this process's copy is the one its matchmaking reads
            step._data_for_gather = with_token(step.data_for_gather, key, self.prefix,  # type: ignore[attr-defined]
                                               self.peer_id.to_bytes())  # type: ignore[attr-defined]
        return await super()._step(step=step, **kwargs)  # type: ignore[misc]

    async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        key = self._member_key
        if key is not None:
            for peer_id, data in zip(group_info.peer_ids, group_info.gathered, strict=True):
                refusal = gathered_refusal(data, key, self.prefix, peer_id.to_bytes())  # type: ignore[attr-defined]
                if refusal is not None:
                    raise AllreduceException(f"collabopt: {peer_id} of this group is no member of the swarm "
                                             f"({refusal}): the round is refused before any part is sent")
            group_info = dataclasses.replace(group_info, gathered=tuple(map(without_token, group_info.gathered)))
        return await super()._aggregate_with_group(group_info, *args, **kwargs)  # type: ignore[misc]


async def download_refusal(dht: Any, prefix: str, key: SwarmKey, caller: bytes) -> str | None:
    """Why the peer ``caller`` gets no state (nor challenge answer) of the state averager ``prefix``: it stored no
    valid member token in ``<prefix>.members`` (:func:`store_member_token`); None where it did."""
    found = await dht.get(MEMBERS_RECORD.format(prefix=prefix), latest=True, return_future=True)
    entry = found.value.get(caller) if found is not None and isinstance(found.value, dict) else None
    if not isinstance(entry, ValueWithExpiration):
        return "it stored no member token (no swarm key, or a peer without collabopt's membership checks)"
    try:
        token = MemberToken.from_bytes(entry.value)
    except ValueError:
        return "its member token cannot be read"
    return member_token_refusal(key, prefix, token, caller)


def store_member_token(dht: Any, prefix: str) -> None:
    """(before a download, where the swarm has a key) Store this peer's member token in ``<prefix>.members``: the
    members it downloads from find it there. A failed store is logged: the download is tried all the same."""
    key = swarm_key_of(dht)
    if key is None:
        return
    me = dht.peer_id.to_bytes()
    token = MemberToken.issue(key, prefix, me)
    try:
        stored = dht.store(MEMBERS_RECORD.format(prefix=prefix), subkey=me, value=token.to_bytes(),
                           expiration_time=token.expires)
    except Exception as e:
        logger.warning(f"collabopt: this peer's member token could not be stored ({e!r})")
        stored = False
    if not stored:
        logger.warning("collabopt: this peer's member token was not stored: members may refuse its download")


__all__ = ["MEMBERS_RECORD", "MemberChecks", "MemberMatchmaking", "download_refusal", "gathered_refusal",
           "store_member_token", "with_token", "without_token"]
