"""Downloading the swarm's state in the synchronous mode, without relabelling an older state as the swarm's epoch,
and from the peers of the group's lineage first when the lineage check asks for it."""

from __future__ import annotations

import logging
import time
from typing import Any

from hivemind.averaging import DecentralizedAverager
from hivemind.utils import get_dht_time

from collabopt import lineage
from collabopt.engine import protocol_download
from collabopt.engine.lineage_check import resync_outcome
from collabopt.engine.progress import forget_stale_progress
from collabopt.errors import ModelMismatchError

logger = logging.getLogger(__name__)

DOWNLOAD_ATTEMPTS = 5  # downloads that raised, in a row, before a download gives up until the next step


def download_state(optimizer: Any, round_epoch: int = -1, **kwargs: Any) -> None:
    """Download the swarm's state for :class:`~collabopt.engine.sync_round.SyncLoop`.

    A state one epoch older than the swarm's is downloaded again, for up to ``averaging_timeout``, before falling
    back on hivemind 1.1.12's relabelling (which left the peer one update apart for good). A re-synchronization of
    the lineage check downloads from the peers of the group's lineage first. ``round_epoch``: the epoch the peers of
    its gradient round step to, where the round showed this peer behind them: a state older is downloaded again,
    whatever the progress records say yet, and never relabelled to it
    (:func:`~collabopt.engine.protocol_download.after_download`). See docs/decisions.md, "Downloads without
    relabelling"."""
    resync = optimizer.sync_state.resync
    apart = optimizer.sync_state.apart
    before = lineage.fingerprint(optimizer.state_averager.main_parameters) if resync is not None or apart else []
    if resync is not None:  # (the lineage check) a download from a peer of the group's lineage
        optimizer.state_downloads.prefer_sources(resync.peers)
    try:
        _download_until_current(optimizer, round_epoch, **kwargs)
    finally:
        if resync is not None:
            optimizer.state_downloads.prefer_sources([])
    resync_outcome(optimizer, resync, apart, before)


def _download_until_current(optimizer: Any, round_epoch: int = -1, **kwargs: Any) -> None:
    """Download until this peer holds the swarm's epoch or its deadline passed; what then
    (:func:`~collabopt.engine.protocol_download.after_download` decides)."""
    deadline = time.monotonic() + optimizer.averaging_timeout
    while True:
        _download_state_once(optimizer, **kwargs)
        seen = protocol_download.DownloadEvidence(optimizer.local_epoch, optimizer.tracker.global_epoch,
                                                  deadline - time.monotonic(), round_epoch)
        decision = protocol_download.after_download(seen)
        if decision.action != "again":
            break
        if optimizer.state_downloads.handed_on:
            logger.log(optimizer.status_loglevel, "collabopt: the state downloaded is %s: downloading again",
                       decision.reason)
        else:  # (each peer asked was ending an epoch, or had nothing to send: see ConsistentStateAverager.served_state)
            logger.log(optimizer.status_loglevel, "collabopt: no peer sent its state now: downloading again in 1 s")
        with optimizer.tracker.pause_updates():  # fetch the swarm's progress now, then look again
            optimizer.tracker.global_progress.next_fetch_time = get_dht_time()
        optimizer.tracker.global_state_updated.set()
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if decision.action == "relabel" or (decision.action == "behind" and round_epoch >= 0):  # (said, not silent)
        logger.warning("collabopt: %s (within %.0f s)", decision.reason, optimizer.averaging_timeout)
    if decision.action == "relabel":  # hivemind's rule, as a last resort
        optimizer.state_averager.local_epoch = seen.swarm_epoch
        after_download(optimizer)
    forget_stale_progress(optimizer.tracker, optimizer.local_epoch)


def _download_state_once(optimizer: Any, **kwargs: Any) -> None:
    """One download of the state (and of the gradient averager's, if it serves one). A download that raised is
    tried again 1 s later, at most :data:`DOWNLOAD_ATTEMPTS` times in all, each failure logged with its reason; the
    next step downloads again if the peer is still behind. Only ordinary errors are retried: SIGTERM
    (:class:`collabopt.Terminated`, a ``SystemExit``) and Ctrl+C end the wait at once, and a model of other shapes
    (:class:`~collabopt.errors.ModelMismatchError`) stops the peer."""
    control, optimizer.scheduled_grads = optimizer.scheduled_grads, None
    optimizer.state_averager.step(wait_for_delayed_updates=True)  # (first: a delayed step may read the buffers)
    if control is not None and not control.done():
        optimizer.tag_along(control)  # its group may have formed: leaving would make the others match again
    with optimizer.tracker.pause_updates():
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            try:
                optimizer.state_downloads.download(timeout=optimizer.load_state_timeout, **kwargs)
                if installs_a_download(optimizer.grad_averager):
                    optimizer.grad_averager.load_state_from_peers(timeout=optimizer.load_state_timeout, **kwargs)
                break
            except ModelMismatchError:  # (collabopt.model_check) another try would find the same shapes
                raise
            except Exception as e:
                if attempt == DOWNLOAD_ATTEMPTS:
                    logger.warning("collabopt: downloading the swarm's state failed %d times (last: %r): this peer "
                                   "goes on, and downloads again at its next step if it is still behind", attempt, e)
                    break
                logger.warning("collabopt: downloading the swarm's state failed (%r): trying again in 1 s "
                               "(attempt %d of %d)", e, attempt, DOWNLOAD_ATTEMPTS)
                time.sleep(1.0)  # (a failure that came at once, e.g. no DHT node to ask, is not retried in a spin)
        after_download(optimizer)


def installs_a_download(grad_averager: Any) -> bool:
    """Whether ``grad_averager`` installs what it downloads (PowerSGD's: its Q matrices). hivemind's
    ``DecentralizedAverager.load_state_from_peers`` installs nothing: downloading a whole state for it only costs
    bandwidth (unbounded and unverified: the highest-priority peer's)."""
    load = getattr(type(grad_averager), "load_state_from_peers", DecentralizedAverager.load_state_from_peers)
    return grad_averager is not None and load is not DecentralizedAverager.load_state_from_peers


def after_download(optimizer: Any) -> None:
    optimizer.tracker.report_local_progress(local_epoch=optimizer.local_epoch, samples_accumulated=0)
    optimizer.reset_accumulation()
