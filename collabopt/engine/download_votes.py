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
:data:`MIN_VOTES` votes (the swarm's first epochs) the download is hivemind's, unverified, and the log says so; votes
that disagree download nothing (:meth:`VerifiedDownloads._without_majority`).
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

from collabopt.engine.compat import dht_time
from collabopt.engine.download_challenge import (
    MAX_ANSWERERS,
    ProjectionChallenges,
    challenge_refusal,
    challenge_timeout,
    new_seed,
    projection,
)
from collabopt.engine.records import read_run_records
from collabopt.lineage import fingerprint, same_fingerprint, valid_fingerprint
from collabopt.model_check import first_mismatch

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


class VerifiedDownloads(ProjectionChallenges):
    """A mixin of the state averager, right after hivemind's ``TrainingStateAverager`` among its bases (so between
    it and ``DecentralizedAverager``): it sees each downloaded state before ``TrainingStateAverager`` installs it,
    and hands on only one that :func:`refusal` and the challenge pass. Active once :attr:`votes` is set; the class
    it is mixed into provides ``only_sources`` (the averager process downloads from those peers only).
    :attr:`handed_on`: whether the last download handed a state on to be installed."""

    votes: DownloadVotes | None = None
    handed_on = False
    model_names: list[str] | None = None  # the model's names of the parameters (set by the optimizer; hivemind's own
    # parameter_names are the keys of its served state, and stay as they are)
    installed_once = False  # whether a download ever handed a state on to be installed
    holding_state = False  # True during a download before the first install: serve nothing (see model_check)

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        self.handed_on = False
        # a peer that has installed no state of the swarm yet serves none while it downloads one: its model may be
        # another (found only now), and a joiner must not take it for the swarm's
        self.holding_state = not self.installed_once
        try:
            loaded = self._load_verified(wait, timeout)
            if loaded is not None and self.votes is None:
                self._check_model(loaded[1])
        finally:
            self.holding_state = False
        self.handed_on = loaded is not None
        self.installed_once = self.installed_once or self.handed_on
        return loaded

    def _check_model(self, tensors: Any, source: str = "the swarm's state") -> None:
        """Raise :class:`~collabopt.errors.ModelMismatchError` unless the downloaded ``tensors`` begin with this
        peer's parameters' (and extra tensors') shapes and dtypes, before anything of them is installed."""
        local = [p for group in self.optimizer.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        names = self.model_names or [name for group in self.optimizer.param_groups  # type: ignore
                                         for name in group.get("param_names", ())] or None
        extras = list(getattr(self, "extra_tensors", ()))
        if names is not None and extras:
            names = [*names, *(f"extra tensor {i}" for i in range(len(extras)))]
        mismatch = first_mismatch([*local, *extras], list(tensors) if tensors is not None else [], names, source)
        if mismatch is not None:
            raise mismatch

    def _load_verified(self, wait: bool, timeout: float | None) -> Any:
        votes = self.votes
        if votes is None:
            return super().load_state_from_peers(wait=wait, timeout=timeout)  # type: ignore[misc]
        if not wait:
            raise ValueError("a verified download waits for the state (wait=True): it checks it before installing it")
        try:
            ballot = votes.read()
        except VotesUnreadable as e:  # nothing downloaded: the caller's loop tries again later
            logger.warning(f"collabopt: {e}")
            return None
        newest = newest_majority(ballot)
        if newest is None:
            return self._without_majority(ballot, timeout)
        num_parameters = sum(len(group["params"]) for group in self.optimizer.param_groups)  # type: ignore
        me = self.dht.peer_id.to_base58()  # type: ignore[attr-defined]
        refused = vars(self).setdefault("_refused_sources", {})  # peer -> downloads it is still tried last in
        avoid = set(refused)
        self._refused_sources = {peer: left - 1 for peer, left in refused.items() if left > 1}
        unanswered = refused_any = False
        serving = self._serving_peers()
        for peer in sources(ballot, serving, *newest, me=me, avoid=avoid):
            self.only_sources([peer])  # type: ignore[attr-defined]
            try:
                loaded = super().load_state_from_peers(wait=True, timeout=timeout)  # type: ignore[misc]
            except Exception as e:  # one peer's failure (a timeout, a broken stream): the next peer is tried
                logger.warning(f"collabopt: downloading the state from {peer} failed ({e!r}): trying the next peer")
                continue
            finally:
                self.only_sources([])  # type: ignore[attr-defined]
            if loaded is None:
                continue  # it served nothing: hivemind's loop found no other peer to try
            if peer in voters_of(ballot, *newest):  # the majority's state of other shapes: this peer is the odd one
                self._check_model(loaded[1], f"the state of {peer}, which most of the swarm holds")
            epoch = loaded[0].get("epoch") if isinstance(loaded[0], dict) else None
            if type(epoch) is int and majority(ballot, epoch) is None:  # the servers moved on: read their new votes
                with contextlib.suppress(VotesUnreadable):
                    ballot = votes.read()
            reason, no_answer = refusal(*loaded, num_parameters, ballot), False
            if reason is None:
                reason, no_answer = self._challenge(peer, loaded, ballot, num_parameters, me, serving)
            if reason is None:
                return loaded
            if no_answer:  # (the others moved on an epoch: its source may be honest, and is not remembered)
                if not unanswered:
                    logger.info(f"collabopt: the state {peer} sent is not installed: {reason}; trying the next "
                                f"peer (the download is tried again)")
                unanswered = True
                continue
            self._refused_sources[peer], refused_any = REMEMBERED_DOWNLOADS, True
            logger.warning(f"collabopt: refused the state {peer} sent ({reason}): nothing of it is installed; "
                           f"trying the next peer")
        level = logging.INFO if unanswered and not refused_any else logging.WARNING  # (INFO: the swarm moved on)
        logger.log(level, f"collabopt: no peer sent the state most of the swarm holds (epoch {newest[0]}): nothing "
                          f"downloaded")
        return None

    def _challenge(self, source: str, loaded: Any, ballot: Sequence[Vote], num_parameters: int, me: str,
                   serving: Collection[str]) -> tuple[str | None, bool]:
        """The secret challenge of a state ``source`` sent whose fingerprint passed (:func:`challenge_refusal`):
        other voters of the majority's fingerprint at its epoch that serve their state (``serving``; clients answer
        nothing), never ``source`` nor a vote its key signed, answer projections of what they serve. Returns the
        reason to refuse it (None: accepted), and whether that is a want of answers."""
        epoch = loaded[0]["epoch"]
        keys = {signer(vote) for vote in ballot if vote.peer_id == source}  # (one key, one role)
        others = sorted(voters_of(ballot, epoch, majority(ballot, epoch) or [], keys) & set(serving) - {source, me})
        asked = random.sample(others, min(MAX_ANSWERERS, len(others)))
        seed, timeout = new_seed(), challenge_timeout(sum(t.numel() for t in loaded[1][:num_parameters]))
        pending = self.ask_projections(asked, seed, epoch, timeout) if asked else None  # (answered meanwhile)
        own = projection(loaded[1][:num_parameters], seed)
        try:
            answers = {} if pending is None else pending.result(timeout=timeout + 5.0)
        except Exception as e:  # (the averager's process did not answer: no answers)
            logger.debug(f"collabopt: the download challenge got no answers ({e!r})")
            answers = dict.fromkeys(asked)
        return challenge_refusal(answers, epoch, own)

    def _without_majority(self, ballot: Sequence[Vote], timeout: float | None) -> Any:
        """A download where no fingerprint has a majority. With fewer than :data:`MIN_VOTES` votes (the swarm's
        first epochs, one server) it is hivemind's, unverified; with more, nothing is downloaded now: votes that
        disagree are a handover between epochs or a hostile vote, and an unverified install would let a hostile
        server's state win the next majority (the installer votes for it)."""
        if len(ballot) < MIN_VOTES:
            logger.warning(f"collabopt: {len(ballot)} vote(s) of the swarm's fingerprint, fewer than {MIN_VOTES}: "
                           f"this download is not verified")
            loaded = super().load_state_from_peers(wait=True, timeout=timeout)  # type: ignore[misc]
            if loaded is not None:
                self._check_model(loaded[1])
            return loaded
        logger.warning(f"collabopt: the swarm's {len(ballot)} votes hold no fingerprint most of them share: nothing "
                       f"downloaded now (tried again later)")
        return None

    def _serving_peers(self) -> dict[str, float]:
        """The peers that serve their state, with the priority they store (hivemind's record, base58 ids)."""
        found = self.dht.get(f"{self.prefix}.all_averagers", latest=True)  # type: ignore[attr-defined]
        peers: dict[str, float] = {}
        for subkey, info in (found.value.items() if found is not None and isinstance(found.value, dict) else ()):
            try:
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int)):
                    peers[PeerID(subkey).to_base58()] = float(info.value)
            except Exception:  # (a malformed subkey: hivemind skips it too)
                continue
        return peers


__all__ = ["MIN_VOTES", "REMEMBERED_DOWNLOADS", "VOTE_TTL", "DownloadVotes", "VerifiedDownloads", "Vote",
           "VotesUnreadable", "majority", "canonical", "newest_majority", "refusal", "sources", "voters_of"]
