"""Downloads of the state most of the swarm holds, and of no other (``aggregation="centered_clip"``; issue 35).

hivemind downloads from the peer that stores the highest priority, and installs what it sends: one hostile member
could hand every joiner a model of its own. Here each training peer *votes* for the state it serves: the epoch and
its parameters' fingerprint (:func:`collabopt.lineage.fingerprint`), in a record signed by its key under
``<run_id>_fingerprints`` (one vote per key; with a swarm key only members store records). A peer about to download
reads the votes, tries first the peers whose vote is the fingerprint most voters hold (:func:`majority`), and
installs a state only if its own parameters' fingerprint is the majority's at the epoch the state says it is
(:func:`refusal`) and it passes a secret challenge (:mod:`collabopt.engine.download_challenge`): other voters of
that fingerprint answer random projections of what they serve. A hostile server can lie in its vote, and craft a
state with the public fingerprint's three sums (a permutation of the honest parameters); not one that agrees with
projections drawn after it was sent. A refused state is not installed; the next peer is tried, and a source refused
for what it sent is tried last in the next :data:`REMEMBERED_DOWNLOADS` downloads. Each vote is its signing key's
(one vote per key) and names one canonical peer id: a peer is a source or an answerer only through a vote naming it,
never an answerer for a source whose vote its key signed (:func:`sources`, :func:`voters_of`). With fewer than
:data:`MIN_VOTES` votes (the swarm's first epochs) the download is unverified, and the log says so; votes
that disagree download nothing. The download itself: :class:`collabopt.engine.downloads.StateDownloads`.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from hivemind.p2p import PeerID

from collabopt.engine.compat import dht_time
from collabopt.engine.records import read_run_records
from collabopt.lineage import fingerprint, same_fingerprint, valid_fingerprint

logger = logging.getLogger(__name__)

VOTE_TTL = 300.0  # seconds a vote lives on the DHT; renewed at half of that while its peer trains
MIN_VOTES = 2  # one peer's fingerprint is no majority: it could be the hostile one's
READ_TIMEOUT = 10.0  # seconds a read of the votes may take
REMEMBERED_DOWNLOADS = 3  # downloads after this one that try last a source whose state was refused


class VotesUnreadable(RuntimeError):
    """The swarm's votes could not be read: the download is tried again rather than made unverified."""


class Vote(NamedTuple):
    """One peer's vote: it serves the state of ``epoch``, whose parameters have this ``fingerprint``."""

    peer_id: str
    epoch: int
    fingerprint: list[float]
    key: bytes | None = None  # the key that signed it (None: its peer id stands for it)


def canonical(peer_id: str) -> bool:
    """Whether ``peer_id`` is a base58 peer id as it is written back: ``PeerID.from_base58`` strips whitespace, so
    "X " dials X but is another name."""
    try:
        return PeerID.from_base58(peer_id).to_base58() == peer_id
    except Exception:
        return False


def signer(vote: Vote) -> bytes | str:
    return vote.key if vote.key is not None else vote.peer_id


def majority(votes: Sequence[Vote], epoch: int) -> list[float] | None:
    """The fingerprint that more than half of the votes at ``epoch`` hold, at least :data:`MIN_VOTES` of them (None
    if no fingerprint does)."""
    at_epoch = [vote.fingerprint for vote in votes if vote.epoch == epoch]
    for candidate in at_epoch:
        holders = sum(same_fingerprint(candidate, other) for other in at_epoch)
        if valid_fingerprint(candidate) and holders >= MIN_VOTES and 2 * holders > len(at_epoch):
            return candidate
    return None


def newest_majority(votes: Sequence[Vote]) -> tuple[int, list[float]] | None:
    """The newest epoch at which the votes have a :func:`majority`, and its fingerprint (None: no epoch has one)."""
    for epoch in sorted({vote.epoch for vote in votes}, reverse=True):
        found = majority(votes, epoch)
        if found is not None:
            return epoch, found
    return None


def voters_of(votes: Sequence[Vote], epoch: int, expected: list[float], keys: Collection[Any] = ()) -> set[str]:
    """The peers (canonical ids) whose vote is ``expected`` at ``epoch``, but no vote signed by ``keys``."""
    return {vote.peer_id for vote in votes if vote.epoch == epoch and same_fingerprint(vote.fingerprint, expected)
            and canonical(vote.peer_id) and signer(vote) not in keys}


def sources(votes: Sequence[Vote], priorities: dict[str, float], epoch: int, expected: list[float],
            me: str, avoid: Collection[str] = ()) -> list[str]:
    """The peers to download from, in order: those that serve their state (``priorities``: hivemind's, by base58
    peer id) and that a vote names (its key's role: no vote, no source), but not ``me``; first those whose vote is
    ``expected`` at ``epoch``, each group by priority (a tie drawn at random). A peer whose vote is another is still
    tried last: its state is checked as any other. Peers in ``avoid`` (whose state was refused lately) come after
    all others."""
    claims, voters = voters_of(votes, epoch, expected), {vote.peer_id for vote in votes if canonical(vote.peer_id)}
    order = {peer: (peer not in avoid, peer in claims, priority, random.random())
             for peer, priority in priorities.items() if peer != me and peer in voters}
    return sorted(order, key=order.__getitem__, reverse=True)


def refusal(metadata: Any, tensors: Sequence[Any], num_parameters: int, votes: Sequence[Vote]) -> str | None:
    """Why a downloaded state (hivemind's ``metadata`` and tensors, the parameters first) must not be installed, or
    None: its parameters' fingerprint is the :func:`majority` of the votes at the epoch the state says it is."""
    epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
    if type(epoch) is not int:
        return "its state names no epoch"
    expected = majority(votes, epoch)
    if expected is None:
        return f"the swarm's votes hold no majority fingerprint at epoch {epoch}, the epoch of its state"
    if len(tensors) < num_parameters:
        return f"it sent {len(tensors)} tensors for {num_parameters} parameters"
    if not same_fingerprint(fingerprint(tensors[:num_parameters]), expected):
        return f"its parameters are not those most of the swarm holds at epoch {epoch} (another fingerprint)"
    return None


class DownloadVotes:
    """This peer's vote (stored through ``records_dht``, signed with ``public_key``, the key of its progress
    records) and everyone's (read from ``dht``) under ``<run_id>_fingerprints``."""

    def __init__(self, dht: Any, records_dht: Any, run_id: str, public_key: bytes):
        self.dht, self.records_dht, self.run_id, self.public_key = dht, records_dht, run_id, public_key
        self.key = f"{run_id}_fingerprints"
        self._last: tuple[int, list[float]] | None = None
        self._voted_at = 0.0

    serves = True  # False (a client-mode peer): it serves no state nor answers challenges, so it never votes

    def vote(self, epoch: int, value: Sequence[float]) -> None:
        """Vote (without waiting for the store) for the state of ``epoch``, whose parameters' fingerprint is
        ``value``; nothing where this peer does not serve its state."""
        if not self.serves:
            return
        if type(epoch) is not int or epoch < 0 or not valid_fingerprint(list(value)):
            raise ValueError(f"a vote needs an epoch (int >= 0) and a finite fingerprint, got {epoch!r}, {value!r}")
        self._last, self._voted_at = (epoch, [float(x) for x in value]), time.monotonic()
        record = dict(peer_id=self.dht.peer_id.to_base58(), epoch=epoch, fingerprint=self._last[1])
        self.records_dht.store(key=self.key, subkey=self.public_key, value=record,
                               expiration_time=dht_time() + VOTE_TTL, return_future=True)

    def keep_alive(self) -> None:
        """Store the last vote again once half of its life has passed (called at every local step)."""
        if self._last is not None and time.monotonic() - self._voted_at > VOTE_TTL / 2:
            self.vote(*self._last)

    def read(self) -> list[Vote]:
        """Every peer's newest vote, each record checked on its own (signature, size, schema). Raises
        :class:`VotesUnreadable` if no other DHT node answered within :data:`READ_TIMEOUT`: a read that failed is
        not an empty ballot, which would let the download go unverified."""
        found = read_run_records(self.dht, self.run_id, READ_TIMEOUT, kinds=("fingerprints",))
        if found.sources == 0:
            raise VotesUnreadable(f"no DHT node answered the read of {self.key} within {READ_TIMEOUT:.0f} s: the "
                                  f"download waits for the swarm's votes (it tries again)")
        return [Vote(record["peer_id"], record["epoch"], record["fingerprint"], key)
                for key, (record, _expiration) in found.fingerprints.items() if record is not None]


__all__ = ["MIN_VOTES", "REMEMBERED_DOWNLOADS", "VOTE_TTL", "DownloadVotes", "Vote", "VotesUnreadable", "canonical",
           "majority", "newest_majority", "refusal", "signer", "sources", "voters_of"]
