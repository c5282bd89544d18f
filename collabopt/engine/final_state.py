"""A peer that finished training serves its final state while live peers are still behind it.

A peer that left as soon as it reached its last epoch stranded a peer one epoch behind: that peer could no longer
download the final state (it dialed the departed peer, or stepped alone to the last epoch on parameters of its own).
So a finished peer stays in the swarm, serving its state through the ordinary download path, while a live peer (a
progress record stored within the last ``live_within`` seconds) is at an earlier epoch; it leaves as soon as none
is, or after ``bound`` seconds. While a download of its state from it is open, it stays too, past the bound by at
most ``download_bound`` (the download's own timeout, ``load_state_timeout``): a large model's download outlasts
``averaging_timeout + matchmaking_time``, and leaving in its middle strands the downloader as leaving before it did.
SIGTERM and Ctrl+C end the wait at once (they raise in the main thread).

    >>> grace_decision(behind=0, elapsed=0.0, bound=35.0)
    'no live peer is behind epoch'
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)


def peers_behind(records: Iterable[tuple[int, float]], final_epoch: int, now: float, live_within: float) -> int:
    """How many of the other peers' progress records (``(epoch, time)`` pairs) are live (stored at most
    ``live_within`` seconds before ``now``) and at an epoch before ``final_epoch``. A record that old belongs to a
    peer that stopped training: it does not hold the finished peer."""
    return sum(1 for epoch, stamp in records if epoch < final_epoch and stamp >= now - live_within)


def grace_decision(behind: int, elapsed: float, bound: float, downloads: int = 0,
                   download_bound: float = 0.0) -> str | None:
    """Why the wait ends now (None: it goes on): no live peer is behind and no download from this peer is open, or
    the ``bound`` has passed (``bound + download_bound`` while ``downloads`` are open)."""
    if downloads:
        if elapsed < bound + download_bound:
            return None
        return f"{downloads} download(s) still open after {bound + download_bound:.0f} s (the bound) at epoch"
    if behind == 0:
        return "no live peer is behind epoch"
    if elapsed >= bound:
        return f"{behind} peer(s) still behind after {bound:.0f} s (the bound) at epoch"
    return None


def other_records(tracker: Any) -> list[tuple[int, float]]:
    """The ``(epoch, time)`` of every other peer's progress record in the DHT now (goodbyes and unreadable records
    skipped)."""
    found = tracker.dht.get(tracker.training_progress_key, latest=True)
    records = found.value if found is not None and isinstance(found.value, dict) else {}
    own_id = tracker.dht.peer_id.to_bytes()
    pairs = []
    for key, record in records.items():
        value = getattr(record, "value", None)
        if key == tracker.local_public_key or not isinstance(value, dict) or value.get("peer_id") == own_id:
            continue
        epoch, stamp = value.get("epoch"), value.get("time")
        if type(epoch) is int and isinstance(stamp, float):
            pairs.append((epoch, stamp))
    return pairs


def open_downloads(loop: Any) -> int:
    """How many downloads of this peer's state are open now (0 where the loop has no state service)."""
    return getattr(getattr(loop, "state_service", None), "open_downloads", 0)


def serve_final_state(loop: Any, bound: float, live_within: float | None = None,
                      download_bound: float | None = None) -> str:
    """Wait (serving this peer's state) until no live peer is behind this peer's epoch and no download from it is
    open, at most ``bound`` seconds (``bound + download_bound`` while a download is open; ``download_bound``
    defaults to the loop's ``load_state_timeout``); returns and logs why it ended. ``live_within`` defaults to
    ``bound``: a peer in a gradient round or a download stores no record for up to a ``matchmaking_time`` or an
    ``averaging_timeout``."""
    tracker, epoch = loop.tracker, loop.local_epoch
    live_within = bound if live_within is None else live_within
    if download_bound is None:
        download_bound = getattr(loop, "load_state_timeout", 0.0)
    period = max(tracker.min_refresh_period, 0.1)
    start, waited = time.monotonic(), False
    while True:
        downloads = open_downloads(loop)
        # while a download from this peer is open, the peers behind do not change the decision: the DHT (every
        # peer's progress record) is read then only for the first log line
        behind = 0
        if not (downloads and waited):
            behind = peers_behind(other_records(tracker), epoch, get_dht_time(), live_within)
        reason = grace_decision(behind, time.monotonic() - start, bound, downloads, download_bound)
        if reason is not None:
            break
        if not waited:
            logger.info("collabopt: training finished at epoch %d; %d live peer(s) behind, %d download(s) open: "
                        "this peer serves its state for them (at most %.0f s, longer while a download is open)",
                        epoch, behind, downloads, bound)
            waited = True
        time.sleep(period)
    if waited:
        logger.info("collabopt: leaves after %.1f s: %s %d", time.monotonic() - start, reason, epoch)
    return f"{reason} {epoch}"
