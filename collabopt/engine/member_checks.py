"""Members only in state downloads: the checks of a swarm key (issue 35; docs/design/trust.md, section 2). Without
a key (an open swarm) nothing here changes anything.

A member proves itself with a :class:`~collabopt.membership.MemberToken` bound to its libp2p peer id, which every
check matches with the caller's authenticated peer id. hivemind's ``DownloadRequest`` has no fields, so a
downloader stores its token in the DHT record ``<prefix>.members`` (which only key holders can read or write) before
it downloads (:func:`store_member_token`), and the serving member refuses a caller whose token it does not find
there (:func:`download_refusal`; the download challenge too). The averaging rounds check the tokens in a group's
gathered data themselves (:func:`entry_token_refusal`).
"""

from __future__ import annotations

from typing import Any

from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.membership import MemberToken, SwarmKey, member_token_refusal, swarm_key_of

logger = get_logger(__name__)

MEMBERS_RECORD = "{prefix}.members"


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


def entry_token_refusal(entry: Any, key: SwarmKey, scope: str, peer_id: bytes) -> str | None:
    """Why a member's gathered ``entry`` in a round's group (``[reduces, gather, token]``) does not prove it a member;
    None if it does."""
    if not isinstance(entry, (list, tuple)) or len(entry) != 3 or entry[2] is None:
        return "it sent no member token (no swarm key, or a peer without collabopt's membership checks)"
    try:
        token = MemberToken.from_bytes(entry[2])
    except Exception:
        return "its member token cannot be read"
    return member_token_refusal(key, scope, token, peer_id)


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


__all__ = ["MEMBERS_RECORD", "download_refusal", "entry_token_refusal", "store_member_token"]
