"""Downloading the swarm's state into this peer's training state: which peers to ask, what to check, what to install.

One download (:meth:`StateDownloads.download`) asks the peers that serve their state through the state service
(:class:`~collabopt.engine.state_service.StateService`), one at a time, and installs the first state that passes:

* where downloads are verified (``aggregation="centered_clip"``: the state averager's ``votes`` are set), the peers
  whose vote is the newest majority's fingerprint first, and a state only if its fingerprint is that majority's and it
  passes the secret challenge (:mod:`collabopt.engine.download_votes`, :mod:`collabopt.engine.download_challenge`);
  a source refused for what it sent is tried last in the next :data:`~collabopt.engine.download_votes.
  REMEMBERED_DOWNLOADS` downloads;
* otherwise by their advertised priority (their epoch), the preferred peers (:meth:`StateDownloads.prefer_sources`:
  those of a round's lineage) first, a tie drawn at random;
* in both, a state whose shapes or dtypes are not this peer's raises :class:`~collabopt.errors.ModelMismatchError`
  before anything of it is installed (:mod:`collabopt.model_check`), and a peer that installed no state of the swarm
  yet serves none meanwhile (its model is not checked yet).

Each peer's failure is logged with its reason and the next peer is tried: a failed stream, a state of another form
than a state's, one whose checks or install raise, or one ``install_state`` refuses (an older epoch, too few tensors,
statistics that do not fit); a download succeeds only where a state was installed, and tries each peer once. The
callers' loops decide when to try again (:mod:`collabopt.engine.sync_download`, ``DiLoCoLoop.load_state_from_peers``).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Collection, Sequence
from typing import Any

from collabopt.engine.download_challenge import (
    MAX_ANSWERERS,
    challenge_refusal,
    challenge_timeout,
    new_seed,
    projection,
)
from collabopt.engine.download_votes import (
    MIN_VOTES,
    REMEMBERED_DOWNLOADS,
    Vote,
    VotesUnreadable,
    majority,
    newest_majority,
    refusal,
    signer,
    sources,
    voters_of,
)
from collabopt.engine.state_service import state_problem
from collabopt.errors import ModelMismatchError
from collabopt.model_check import first_mismatch

logger = logging.getLogger(__name__)

PREFERRED_BOOST = 1e9  # added to the priority of a preferred source (priorities are epochs)


class StateDownloads:
    """Downloads into ``averager`` (a :class:`~collabopt.engine.state.ConsistentStateAverager`: its ``votes`` and
    ``model_names`` are read at each download) through ``service``. :attr:`handed_on`: whether the last download
    handed a state on to be installed."""

    def __init__(self, service: Any, averager: Any):
        self.service, self.averager = service, averager
        self.handed_on = False
        self.installed_once = False  # whether a download ever handed a state on to be installed
        self.holding_state = False  # True during a download before the first install: serve nothing
        self._preferred: set[str] = set()
        self._refused_sources: dict[str, int] = {}  # peer -> downloads it is still tried last in
        service.declines = lambda: self.holding_state

    def prefer_sources(self, peers: Sequence[str]) -> None:
        """Make the next downloads try ``peers`` (base58 peer ids) before any other; none: no preference."""
        self._preferred = set(peers)

    def download(self, timeout: float | None = None) -> bool:
        """Download the swarm's state and install it; returns :attr:`handed_on`: whether a state was installed (a
        source whose state ``install_state`` refused, or whose install raised, is that source's failure: the next
        is tried). ``timeout``: seconds one peer's download may take (the state averager's ``load_state_timeout``)."""
        self.handed_on = installed = False
        self.holding_state = not self.installed_once
        try:
            timeout = float(timeout) if timeout is not None else 600.0
            self.service.announce_download()
            votes = self.averager.votes
            installed = self._unverified(timeout) if votes is None else self._verified(votes, timeout)
        finally:
            self.holding_state = False
        self.handed_on = installed
        self.installed_once = self.installed_once or installed
        return installed

    def _install(self, peer: str, loaded: Any, check: str | None) -> bool:
        """Install the state ``peer`` sent, its model checked first where ``check`` names it (the source named in a
        mismatch). False (logged): not installed, and the next peer is tried. A model of other shapes
        (:class:`~collabopt.errors.ModelMismatchError`) and interrupts (``BaseException``) propagate."""
        try:
            if check is not None:
                self.check_model(loaded[1], check)
            installed = self.averager.install_state(*loaded)
        except ModelMismatchError:
            raise
        except Exception as e:  # (one source's bad state: its failure, not the download's)
            logger.warning(f"collabopt: installing the state {peer} sent failed ({e!r}): trying the next peer")
            return False
        if not installed:  # (install_state logged why: an older epoch, too few tensors, statistics that do not fit)
            logger.warning(f"collabopt: the state {peer} sent was not installed: trying the next peer")
            return False
        logger.info(f"collabopt: downloaded the state of epoch {loaded[0].get('epoch')} from {peer}")
        return True

    # ---------------------------------------------------------------- checks
    def check_model(self, tensors: Any, source: str = "the swarm's state") -> None:
        """Raise :class:`~collabopt.errors.ModelMismatchError` unless the downloaded ``tensors`` begin with this
        peer's parameters' (and extra tensors') shapes and dtypes, before anything of them is installed. The names
        are collabopt's (``model_names``), not hivemind's ``parameter_names`` (the keys of its served state)."""
        averager = self.averager
        local = [p for group in averager.optimizer.param_groups for p in group["params"]]
        names = averager.model_names or [name for group in averager.optimizer.param_groups
                                         for name in group.get("param_names", ())] or None
        extras = list(getattr(averager, "extra_tensors", ()))
        if names is not None and extras:
            names = [*names, *(f"extra tensor {i}" for i in range(len(extras)))]
        mismatch = first_mismatch([*local, *extras], list(tensors) if tensors is not None else [], names, source)
        if mismatch is not None:
            raise mismatch

    def _fetch(self, peer: str, timeout: float) -> Any:
        """``peer``'s state, or None where it sent none, failed, or sent one of another form than a state's
        (:func:`~collabopt.engine.state_service.state_problem`; logged with the reason)."""
        try:
            loaded = self.service.fetch(peer, timeout)
        except Exception as e:  # one peer's failure (a timeout, a broken stream, a dial backoff): try the next
            logger.warning(f"collabopt: downloading the state from {peer} failed ({e!r}): trying the next peer")
            return None
        if loaded is None:
            logger.debug(f"collabopt: {peer} sent no state now (ending an epoch, or not serving): trying the next")
            return None
        problem = state_problem(*loaded) if isinstance(loaded, tuple) and len(loaded) == 2 else "it is no pair"
        if problem is not None:
            logger.warning(f"collabopt: the state {peer} sent is not one ({problem}): trying the next peer")
            return None
        return loaded

    # ---------------------------------------------------------------- the two kinds of download
    def _unverified(self, timeout: float) -> bool:
        """Install the first state a serving peer sends that installs, by priority (preferred peers first); its model
        checked. Returns whether one was installed."""
        me = self.service.dht.peer_id.to_base58()
        order = {peer: (priority + (PREFERRED_BOOST if peer in self._preferred else 0.0), random.random())
                 for peer, priority in self.service.serving_peers().items() if peer != me}
        if not order:
            logger.info("collabopt: no peer serves its state now: nothing downloaded")
            return False
        for peer in sorted(order, key=order.__getitem__, reverse=True):
            loaded = self._fetch(peer, timeout)
            if loaded is not None and self._install(peer, loaded, "the swarm's state"):
                return True
        return False

    def _verified(self, votes: Any, timeout: float) -> bool:
        """Install a state most of the swarm holds (see the module); returns whether one was installed."""
        try:
            ballot = votes.read()
        except VotesUnreadable as e:  # nothing downloaded: the caller's loop tries again later
            logger.warning(f"collabopt: {e}")
            return False
        newest = newest_majority(ballot)
        if newest is None:
            return self._without_majority(ballot, timeout)
        num_parameters = sum(len(group["params"]) for group in self.averager.optimizer.param_groups)
        me = self.service.dht.peer_id.to_base58()
        avoid = set(self._refused_sources)
        self._refused_sources = {peer: left - 1 for peer, left in self._refused_sources.items() if left > 1}
        unanswered = refused_any = False
        serving = {peer: priority + (PREFERRED_BOOST if peer in self._preferred else 0.0)
                   for peer, priority in self.service.serving_peers().items()}
        for peer in sources(ballot, serving, *newest, me=me, avoid=avoid):
            loaded = self._fetch(peer, timeout)
            if loaded is None:
                continue
            try:
                if peer in voters_of(ballot, *newest):  # the majority's state of other shapes: this peer is the odd one
                    self.check_model(loaded[1], f"the state of {peer}, which most of the swarm holds")
                if majority(ballot, loaded[0]["epoch"]) is None:  # the servers moved on: read their new votes
                    with contextlib.suppress(VotesUnreadable):
                        ballot = votes.read()
                reason, no_answer = refusal(*loaded, num_parameters, ballot), False
                if reason is None:
                    reason, no_answer = self._challenge(peer, loaded, ballot, num_parameters, me, serving)
            except ModelMismatchError:
                raise
            except Exception as e:  # (a state the checks cannot read: its source's failure)
                reason, no_answer = f"its check failed: {e!r}", False
            if reason is None:
                if self._install(peer, loaded, None):
                    return True
                continue
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
        return False

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
        pending = self.service.ask_projections(asked, seed, epoch, timeout) if asked else None  # (answered meanwhile)
        own = projection(loaded[1][:num_parameters], seed)
        try:
            answers = {} if pending is None else pending.result(timeout=timeout + 5.0)
        except Exception as e:  # (the service did not answer: no answers)
            logger.debug(f"collabopt: the download challenge got no answers ({e!r})")
            answers = dict.fromkeys(asked)
        return challenge_refusal(answers, epoch, own)

    def _without_majority(self, ballot: Sequence[Vote], timeout: float) -> bool:
        """A download where no fingerprint has a majority. With fewer than :data:`MIN_VOTES` votes (the swarm's
        first epochs, one server) it is unverified; with more, nothing is downloaded now: votes that disagree are a
        handover between epochs or a hostile vote, and an unverified install would let a hostile server's state
        win the next majority (the installer votes for it)."""
        if len(ballot) < MIN_VOTES:
            logger.warning(f"collabopt: {len(ballot)} vote(s) of the swarm's fingerprint, fewer than {MIN_VOTES}: "
                           f"this download is not verified")
            return self._unverified(timeout)
        logger.warning(f"collabopt: the swarm's {len(ballot)} votes hold no fingerprint most of them share: nothing "
                       f"downloaded now (tried again later)")
        return False


__all__ = ["PREFERRED_BOOST", "StateDownloads"]
