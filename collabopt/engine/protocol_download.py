"""The synchronous mode's re-sync path, decided in one place: after a download of the swarm's state, whether this
peer is current, downloads again, or goes on from what it holds, and what a download ends of a pending re-sync.

Pure functions of what the peer saw, as in :mod:`collabopt.engine.protocol`; :mod:`collabopt.engine.sync_download`
gathers the evidence and carries the decision out.

    >>> after_download(DownloadEvidence(local_epoch=7, swarm_epoch=8, time_left=0.0)).action
    'relabel'
"""

from __future__ import annotations

from dataclasses import dataclass

# what a download leaves this peer to do (DownloadDecision.action)
DOWNLOAD_ACTIONS = (
    "current",  # it holds the swarm's epoch (or a later one): done
    "again",  # an older epoch's state came, or none: download again in a second, until the deadline
    "relabel",  # the deadline passed one epoch behind: go on from that state as the swarm's epoch (hivemind's rule)
    "behind",  # the deadline passed two or more epochs behind the records, or behind its gradient round's peers
    # only: go on at its epoch; the next step or round shows it behind again
)
# what a download ends of a pending lineage re-sync (ResyncDecision.resync)
RESYNC_ACTIONS = (
    "done",  # another lineage's parameters came: the re-sync is over and the peer no longer apart
    "retry",  # its own parameters are still installed (the group's peers had not served the state yet): again later
    "give up",  # the re-sync's time is over: go on with its own parameters (the next gradient round checks again)
)


@dataclass(frozen=True)
class DownloadEvidence:
    """After one download: this peer's epoch, the swarm's (as the progress records tell it), the seconds left until
    the download's deadline (``averaging_timeout`` after it began) and ``round_epoch``: the epoch the peers of this
    peer's gradient round step to, where a round showed it behind them (-1: none), which the records may not say
    yet."""

    local_epoch: int
    swarm_epoch: int
    time_left: float
    round_epoch: int = -1


@dataclass(frozen=True)
class DownloadDecision:
    action: str  # one of DOWNLOAD_ACTIONS
    reason: str


def after_download(e: DownloadEvidence) -> DownloadDecision:
    """A state older than the swarm's is downloaded again until the deadline: relabelling it at once (hivemind 1.1.12's
    rule) left the peer one update apart from the others for good. Past the deadline, a state one epoch older than
    the progress records say is still relabelled as a last resort, so that a peer whose group never serves the new
    state is not stuck; never to a ``round_epoch`` the records do not show (the group's update would be missing from
    parameters labelled as holding it: the peer goes on at its own epoch, and the next round shows it behind again)."""
    swarm_epoch = max(e.swarm_epoch, e.round_epoch)
    if e.local_epoch >= swarm_epoch:
        return DownloadDecision("current", f"holds epoch {e.local_epoch}, the swarm is at {swarm_epoch}")
    if e.time_left > 0:
        return DownloadDecision("again", f"epoch {e.local_epoch}'s state, the swarm is at {swarm_epoch}")
    if e.local_epoch >= e.swarm_epoch:
        return DownloadDecision("behind", f"epoch {e.local_epoch}'s state, the peers of its gradient round are at "
                                          f"{e.round_epoch}: it goes on at its epoch until a round or a download "
                                          f"brings it theirs")
    if e.local_epoch == e.swarm_epoch - 1:
        return DownloadDecision("relabel", f"no peer served the swarm's epoch {e.swarm_epoch} in time: this peer goes "
                                           f"on from epoch {e.local_epoch}'s state as epoch {e.swarm_epoch}")
    return DownloadDecision("behind", f"epoch {e.local_epoch}'s state, the swarm is at {e.swarm_epoch}: the next step "
                                      f"downloads again")


@dataclass(frozen=True)
class ResyncEvidence:
    """After a download: whether a lineage re-sync was pending (:class:`~collabopt.engine.lineage_check.Resync`),
    whether this peer was apart (a partial round), whether the parameters changed (another lineage's state was
    installed: their fingerprint moved) and the seconds left of the re-sync's time."""

    resyncing: bool
    apart: bool
    moved: bool
    time_left: float = 0.0


@dataclass(frozen=True)
class ResyncDecision:
    resync: str | None  # one of RESYNC_ACTIONS; None where no re-sync was pending
    apart: bool  # whether this peer is still apart from its group


def resync_after_download(e: ResyncEvidence) -> ResyncDecision:
    """Only a change of parameters ends a re-sync or a peer's being apart: a download that installed this peer's own
    state again (the group's peers ending their epoch, serving none) shows nothing of the group's."""
    if not e.resyncing:
        return ResyncDecision(None, e.apart and not e.moved)
    if e.moved:
        return ResyncDecision("done", False)
    return ResyncDecision("retry" if e.time_left > 0 else "give up", e.apart)


__all__ = ["DOWNLOAD_ACTIONS", "RESYNC_ACTIONS", "DownloadDecision", "DownloadEvidence", "ResyncDecision",
           "ResyncEvidence", "after_download", "resync_after_download"]
