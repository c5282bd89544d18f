"""The live state of a run, as ``collabopt monitor`` shows it: read from the peers' records on the DHT.

:class:`SwarmMonitor` reads the run's progress and metrics records (see :mod:`collabopt.metrics`) every
``interval`` seconds through a read-only DHT client and keeps a :meth:`~SwarmMonitor.state`: a verdict (training /
stalled / diverging), the global epoch and its ETA, the swarm's samples/s and loss, one row per peer, a history
for plots, and how many records under the run's keys it refused (unsigned, bad signature, malformed, oversized).
:mod:`collabopt.status_page` serves that state as a page, JSON and Prometheus metrics.

Per peer:

* ``sync``: ``in sync``; ``catching up`` when its epoch is more than one behind the swarm's, or behind it for
  longer than :data:`CATCH_UP_GRACE` seconds (one behind is normal for a moment around each global step);
  ``stale`` when its record stopped changing (no record for three publication intervals: killed, frozen, cut
  off); ``left`` when it withdrew its records (closed cleanly).
* ``reachability``: ``client`` (client mode: accepts no connections), ``relayed`` (reached through a relay),
  ``reachable`` (announces direct addresses).

The state (``/api/state``): ``verdict`` and ``verdict_reason``; ``global_epoch``, ``target_batch_size``,
``samples_accumulated`` toward the next epoch and ``eta_seconds``; ``samples_per_second`` and ``loss`` of the live
peers; ``num_peers`` (live) and ``peers_known``; ``peers``, one row each (``id``, ``epoch``, ``samples_per_second``,
``share`` of the samples contributed, ``loss``, ``last_seen`` seconds, ``sync``, ``reachability``, ``versions``,
``updated``: the time of the record its numbers come from, ``expires_at``: when its newest record expires on the
DHT); ``rejected``: records refused, counted once each, by ``"<record>/<reason>"``; ``history``: the values above
at every read, for plots.

Verdict: ``diverging`` when a live peer reported non-finite losses since the previous read, or the swarm's loss
(mean of the last 5 reads) is more than :data:`DIVERGENCE_FACTOR` times its lowest such mean; ``stalled`` when no
peer is live, or neither the global epoch nor the samples accumulated toward it moved for ``stall_after`` seconds;
``training`` otherwise.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import Counter, deque
from typing import Any

from collabopt.engine.compat import dht_time
from collabopt.engine.records import read_run_records

__all__ = ["CATCH_UP_GRACE", "DIVERGENCE_FACTOR", "SwarmMonitor"]

CATCH_UP_GRACE = 10.0  # seconds a peer may stay one epoch behind before it counts as catching up
DIVERGENCE_FACTOR = 2.0  # the swarm's loss this many times its lowest (5-read means) counts as diverging
STALE_INTERVALS = 3  # a peer whose record did not change for this many publication intervals (+ 2 s) is stale
PROGRESS_ONLY_STALE_AFTER = 45.0  # the same for a peer publishing only hivemind's progress record (every ~30 s idle)
FORGET_AFTER = 600.0  # seconds a peer that is gone stays on the page
_LOSS_WINDOW = 5
_MAX_FINGERPRINTS = 100_000


class SwarmMonitor:
    """Reads a run's records from ``dht`` (any running hivemind DHT; ``collabopt monitor`` uses a client-mode one
    that never counts as a peer) and keeps the run's state.

    Example::

        monitor = SwarmMonitor(dht, "my_run", interval=2.0)
        state = monitor.refresh()          # one read; or monitor.start() to read every interval in a thread
        print(state["verdict"], state["global_epoch"], [p["sync"] for p in state["peers"]])
    """

    def __init__(self, dht: Any, run_id: str, interval: float = 2.0, stall_after: float = 60.0,
                 history: int = 1800, read_timeout: float = 10.0):
        self.dht, self.run_id = dht, run_id
        self.interval, self.stall_after, self.read_timeout = interval, stall_after, read_timeout
        self.started = time.time()
        self._lock = threading.Lock()
        self._peers: dict[str, dict[str, Any]] = {}  # by owner-key id: the last row of every peer seen
        self._behind_since: dict[str, float] = {}
        self._nonfinite_seen: dict[str, int] = {}
        self._rejected_fingerprints: set[bytes] = set()
        self._rejected: Counter[tuple[str, str]] = Counter()
        self._bad_responses = 0
        self._history: dict[str, deque] = {name: deque(maxlen=history) for name in
                                           ("time", "samples_per_second", "loss", "num_peers", "global_epoch")}
        self._progress_marker: tuple[int, int] | None = None
        self._progress_time = time.time()
        self._reads = 0
        self._state: dict[str, Any] = self._build([], time.time(), 0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ reading

    def refresh(self) -> dict[str, Any]:
        """Read the records once, update the state and return it."""
        records = read_run_records(self.dht, self.run_id, self.read_timeout)
        now = time.time()
        dht_now = dht_time()
        with self._lock:
            for kind, fingerprint, reason in records.rejected:
                if fingerprint in self._rejected_fingerprints:
                    continue  # the same record, seen again (on another node or in a later read)
                if len(self._rejected_fingerprints) < _MAX_FINGERPRINTS:
                    self._rejected_fingerprints.add(fingerprint)
                self._rejected[kind, reason] += 1
            self._bad_responses += records.bad_responses
            for owner in set(records.progress) | set(records.metrics):
                progress, progress_expires = records.progress.get(owner, (None, 0.0))
                metrics, metrics_expires = records.metrics.get(owner, (None, 0.0))
                self._update_peer(_owner_id(owner), progress, metrics, max(progress_expires, metrics_expires),
                                  dht_now)
            for peer_id in [p for p, row in self._peers.items() if dht_now - row["seen"] > FORGET_AFTER]:
                del self._peers[peer_id]
            rows = [self._row(peer_id, row, dht_now) for peer_id, row in self._peers.items()]
            self._reads += 1
            self._state = self._build(rows, now, records.sources, self._reads)
            return self._state

    def _update_peer(self, peer_key: str, progress: dict | None, metrics: dict | None, expires: float,
                     now: float) -> None:
        row = self._peers.setdefault(peer_key, dict(progress=None, metrics=None, seen=now, left=False))
        row["expires"] = expires
        if progress is None and metrics is None:
            row["left"] = True  # both withdrawn: it closed cleanly
            return
        row["left"] = False
        if progress is not None:
            row["progress"] = progress
        if metrics is not None:
            row["metrics"] = metrics
        times = [r["time"] for r in (row["progress"], row["metrics"]) if r is not None]
        row["seen"] = max(times) if times else now

    def _row(self, peer_key: str, row: dict[str, Any], now: float) -> dict[str, Any]:
        progress, metrics = row["progress"] or {}, row["metrics"]
        source = metrics or progress
        interval = metrics["interval"] if metrics else None
        stale_after = STALE_INTERVALS * interval + 2.0 if interval else PROGRESS_ONLY_STALE_AFTER
        last_seen = max(0.0, now - row["seen"])
        client = bool(source.get("client_mode"))
        relayed = bool(metrics and metrics["relayed"])
        return dict(
            key=peer_key,
            id=source.get("peer_id", "?"),
            epoch=int(source.get("epoch", 0)),
            samples_per_second=float(source.get("samples_per_second", 0.0)),
            samples_accumulated=int(progress.get("samples_accumulated", 0)),
            samples_reported=int(metrics["samples_reported"]) if metrics else None,
            samples_skipped=int(metrics["samples_skipped"]) if metrics else None,
            nonfinite_steps=int(metrics["nonfinite_steps"]) if metrics else None,
            loss=metrics["loss"] if metrics else None,
            nonfinite_losses=int(metrics["nonfinite_losses"]) if metrics else None,
            target_batch_size=int(metrics["target_batch_size"]) if metrics else None,
            last_round=metrics["last_round"] if metrics else None,
            last_seen=last_seen,
            updated=float(source.get("time", row["seen"])),
            expires_at=row.get("expires"),
            live=not row["left"] and last_seen <= stale_after,
            left=row["left"],
            reachability="client" if client else "relayed" if relayed else "reachable",
            auxiliary=bool(metrics and metrics["auxiliary"]),
            versions={name: metrics[f"{name}_version"] for name in ("collabopt", "hivemind", "torch", "python")}
            if metrics else {},
        )

    # ------------------------------------------------------------------ the state

    def _build(self, rows: list[dict[str, Any]], now: float, sources: int, reads: int) -> dict[str, Any]:
        live = [r for r in rows if r["live"]]
        trainers = [r for r in live if not r["auxiliary"]]
        epoch_rows = [r for r in trainers if r["reachability"] != "client"] or trainers or rows
        global_epoch = max((r["epoch"] for r in epoch_rows), default=0)
        speed = sum(r["samples_per_second"] for r in trainers)
        accumulated = sum(r["samples_accumulated"] for r in trainers if r["epoch"] == global_epoch)
        targets = Counter(r["target_batch_size"] for r in rows if r["target_batch_size"])
        target = targets.most_common(1)[0][0] if targets else None
        eta = max(0.0, target - accumulated) / speed if target and speed > 0 else None
        losses = [r["loss"] for r in trainers if r["loss"] is not None]
        loss = sum(losses) / len(losses) if losses else None
        contributed = sum(r["samples_reported"] or 0 for r in rows)
        for r in rows:
            r["share"] = (r["samples_reported"] or 0) / contributed if contributed else None
            r["sync"] = self._sync(r, global_epoch, now)
        if reads:
            for name, value in (("time", now), ("samples_per_second", speed), ("loss", loss),
                                ("num_peers", len(trainers)), ("global_epoch", global_epoch)):
                self._history[name].append(value)
        verdict, reason = self._verdict(trainers, global_epoch, accumulated, now) if reads else ("stalled", "starting")
        rejected = {f"{kind}/{reason}": n for (kind, reason), n in sorted(self._rejected.items())}
        return dict(
            run_id=self.run_id, time=now, started=self.started, interval=self.interval, reads=reads,
            dht_nodes=sources, verdict=verdict, verdict_reason=reason, global_epoch=global_epoch,
            target_batch_size=target, samples_accumulated=accumulated, eta_seconds=eta,
            samples_per_second=speed, loss=loss, num_peers=len(trainers), peers_known=len(rows),
            peers=sorted(rows, key=lambda r: (not r["live"], r["id"])),
            rejected=dict(total=sum(self._rejected.values()), by_kind=rejected,
                          bad_responses=self._bad_responses),
            history={name: list(values) for name, values in self._history.items()},
        )

    def _sync(self, row: dict[str, Any], global_epoch: int, now: float) -> str:
        if row["left"]:
            return "left"
        if not row["live"]:
            return "stale"
        if row["epoch"] >= global_epoch or row["auxiliary"]:
            self._behind_since.pop(row["key"], None)
            return "in sync"
        since = self._behind_since.setdefault(row["key"], now)
        return "catching up" if global_epoch - row["epoch"] > 1 or now - since > CATCH_UP_GRACE else "in sync"

    def _verdict(self, trainers: list[dict[str, Any]], global_epoch: int, accumulated: int,
                 now: float) -> tuple[str, str]:
        if not trainers:
            return "stalled", "no live peer"
        new_nonfinite = []
        for r in trainers:
            count = r["nonfinite_losses"] or 0
            if count > self._nonfinite_seen.get(r["key"], count):
                new_nonfinite.append(r["id"])
            self._nonfinite_seen[r["key"]] = count
        if new_nonfinite:
            return "diverging", f"non-finite losses reported by {', '.join(p[:12] for p in new_nonfinite)}"
        losses = [v for v in self._history["loss"] if v is not None and math.isfinite(v)]
        if len(losses) >= 2 * _LOSS_WINDOW:
            means = [sum(losses[i:i + _LOSS_WINDOW]) / _LOSS_WINDOW for i in range(len(losses) - _LOSS_WINDOW + 1)]
            if means[-1] > DIVERGENCE_FACTOR * min(means) and means[-1] > 0:
                return "diverging", f"loss {means[-1]:.4g} is over {DIVERGENCE_FACTOR:g}x its lowest ({min(means):.4g})"
        marker = (global_epoch, accumulated)
        if marker != self._progress_marker:
            self._progress_marker, self._progress_time = marker, now
        elif now - self._progress_time > self.stall_after:
            return "stalled", f"no progress for {now - self._progress_time:.0f} s"
        return "training", f"{len(trainers)} peers at epoch {global_epoch}"

    def state(self) -> dict[str, Any]:
        """The state after the last read (thread-safe; the same object until the next read)."""
        with self._lock:
            return self._state

    # ------------------------------------------------------------------ background reads

    def start(self) -> SwarmMonitor:
        """Read every ``interval`` seconds in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="collabopt-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.refresh()
            except Exception as e:  # a read that fails (DHT hiccup) must not end the monitor
                with self._lock:
                    self._state = dict(self._state, error=repr(e))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.read_timeout + 5)


def _owner_id(owner: bytes) -> str:
    """A short, stable id of a peer's record key (its public key)."""
    return hashlib.sha256(owner).hexdigest()[:12]

