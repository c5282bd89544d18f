"""The rules of the all-gather exchange (:mod:`collabopt.engine.gather_exchange`) as pure functions: what a member
signs, which contributions a round holds, and whether a member may apply it.

Rules, and why:

* A contribution is a *statement* signed by its sender with the Ed25519 key it announced in matchmaking: the round's
  group id, the sender's peer id, the SHA-256 of its payload and its weight (:func:`statement_bytes`). A signature
  proves to any third member what the sender said; a swarm-key HMAC would not (every member holds the key, so a
  hostile one could forge another's second statement and have it excluded).
* Each member's *evidence* is the verified statements it received directly (frozen when it sends its digest) and
  those in the other members' digests. :func:`decide`: a sender with one statement is in the set, a sender with
  two different statements (payload or weight) equivocated and is excluded; a sender nobody holds is left out.
* Members may see different evidence (a member killed while sending its digest). So each member sends the hash of its
  decision (:func:`decision_hash`, which also covers the group's view: members, keys and each member's gathered data)
  to the others, and :func:`refusal` applies a set only where more than half of the group (this member included,
  excluded members not counted) confirmed the same hash and no member confirmed another. Two members that apply thus
  share a member that confirmed one decision to both (majorities of one group intersect), so they apply the same set,
  with or without a member killed mid-round; a member that cannot show that does not apply.
  Left open: a hostile member in both majorities that confirms different decisions to two honest members, where it
  also made their evidence differ (a digest shown to one only) and their confirmations to each other were lost.
* A round's *contributors* (:func:`contributors`): where a group has more present members than the exchange's
  ``max_contributors``, only that many of them, chosen from the group id and the member ids (the same choice on every
  member, a new one every round), send a payload; the others take part with the empty payload (:data:`EMPTY_HASH`)
  and their weight (weight > 0: they wait, and the aggregate counts them), and a statement of a payload from them is
  refused. A statement of weight 0 must be for the empty payload too, so that no member can make the others receive
  or fetch bytes no aggregate reads. Why:
  every member downloads every contribution, so without a bound a member's traffic grows with the group (15 payloads
  a round at 16 members against 3 at 4). Left open: the group id is the leader's draw, so a hostile leader can draw
  until its own peers are among the contributors (see docs/faults.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Collection, Mapping, Sequence

DOMAIN = b"collabopt/gather-exchange/1"


def _framed(*fields: bytes) -> bytes:
    """The fields, each prefixed with its length: no two field lists give the same bytes."""
    return b"".join(struct.pack(">I", len(field)) + field for field in fields)


def payload_hash(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


EMPTY_HASH = payload_hash(b"")  # (a statement of weight 0 is for the empty payload)


def statement_bytes(group_id: bytes, sender: bytes, digest: bytes, weight: float) -> bytes:
    """What a sender signs for its contribution to one round (``sender``: its ``PeerID.to_bytes()``)."""
    return _framed(DOMAIN, b"statement", group_id, sender, digest, struct.pack(">d", weight))


def view_hash(group_id: bytes, members: Sequence[bytes], keys: Sequence[bytes], gathered: Sequence[bytes]) -> bytes:
    """The group as this member knows it: its id, the members in order, the key each announced and each member's
    gathered data as this member received it (raw bytes, e.g. its epoch and anchor). A leader that hands members
    different keys or different metadata of any member makes their views, hence their decision hashes, differ, so
    none applies (otherwise they could weigh one member differently and apply different aggregates unnoticed)."""
    if not len(members) == len(keys) == len(gathered):
        raise ValueError(f"members, keys and gathered must have one entry a member, got {len(members)}, "
                         f"{len(keys)} and {len(gathered)}")
    return hashlib.sha256(_framed(DOMAIN, b"view", group_id, *members, *keys, *gathered)).digest()


def contributors(group_id: bytes, members: Sequence[bytes], limit: int | None,
                 absent: Collection[int] = ()) -> frozenset[int]:
    """The indices of the members whose payloads count in this round: every present member (not in ``absent``)
    where ``limit`` is None or at most ``limit`` are present; else the ``limit`` present members of the lowest
    SHA-256 of (group id, member id)."""
    present = [m for m in range(len(members)) if m not in absent]
    if limit is None or len(present) <= limit:
        return frozenset(present)
    ranked = sorted(present,
                    key=lambda m: hashlib.sha256(_framed(DOMAIN, b"contributor", group_id, members[m])).digest())
    return frozenset(ranked[:limit])


@dataclasses.dataclass(frozen=True)
class Decision:
    """The set a member's evidence gives: ``applied``, (member index, payload hash, weight) in the group's order,
    and ``excluded``, the indices of the members that signed two different statements."""

    applied: tuple[tuple[int, bytes, float], ...]
    excluded: tuple[int, ...]

    @property
    def senders(self) -> tuple[int, ...]:
        return tuple(sender for sender, _, _ in self.applied)


def decide(evidence: Mapping[int, Collection[tuple[bytes, float]]]) -> Decision:
    """The set of one round from ``evidence``: per member index, the distinct (payload hash, weight) statements of
    that member seen anywhere (each signature verified before). One statement: in the set; more than one: excluded
    (it sent different contributions to different members); none: left out."""
    applied, excluded = [], []
    for sender in sorted(evidence):
        statements = set(evidence[sender])
        if len(statements) == 1:
            digest, weight = next(iter(statements))
            applied.append((sender, digest, weight))
        elif len(statements) > 1:
            excluded.append(sender)
    return Decision(tuple(applied), tuple(excluded))


def decision_hash(view: bytes, decision: Decision) -> bytes:
    """What members confirm to each other: their view of the group and the set they decided."""
    fields = [DOMAIN, b"decision", view]
    for sender, digest, weight in decision.applied:
        fields += [struct.pack(">I", sender), digest, struct.pack(">d", weight)]
    fields += [b"excluded", *(struct.pack(">I", sender) for sender in decision.excluded)]
    return hashlib.sha256(_framed(*fields)).digest()


def refusal(decision: Decision, me: int, group_size: int, mine: bytes,
            confirmations: Mapping[int, bytes]) -> str | None:
    """Why member ``me`` must not apply ``decision`` (its hash: ``mine``) given the ``confirmations`` (member index
    -> decision hash) it received; None where it may. The confirmations of excluded members do not count."""
    if me not in decision.senders:
        return "this member's own contribution is not in the set"
    counted = {member: digest for member, digest in confirmations.items()
               if member != me and member not in decision.excluded}
    other = sorted(member for member, digest in counted.items() if digest != mine)
    if other:
        return f"members {other} decided another set"
    agreeing = 1 + len(counted)
    if 2 * agreeing <= group_size:
        return (f"only {agreeing} of {group_size} members confirmed this set: applying needs more than half (two "
                f"members that each applied with a minority could apply different sets)")
    return None
