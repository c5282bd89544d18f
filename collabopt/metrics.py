"""What peers publish about themselves on the DHT, and reading it back.

Two signed records per peer live under the run's keys, one subkey per peer, each signed with that peer's key (so no
peer can overwrite another's) and schema-checked by every peer that stores them:

* ``<run_id>_progress``: hivemind's progress record (epoch, samples toward the next epoch, samples/s, client mode),
  written by collabopt's progress service at most every ``min_refresh_period``;
* ``<run_id>_metrics``: collabopt's metrics record, written every :data:`PUBLISH_INTERVAL` seconds
  (:data:`DILOCO_PUBLISH_INTERVAL` in DiLoCo mode) by a
  :class:`MetricsReporter` thread: epoch and the swarm's epoch as this peer sees it, samples/s, samples contributed
  and skipped, the training loss the loop reported (``copt.report_loss(loss)``), client mode / relay, versions.
  A peer that leaves cleanly replaces it with ``None``; a killed peer's record stops changing and expires after
  :data:`RECORD_TTL` seconds (three intervals in DiLoCo mode).

Readers (``collabopt monitor``, :func:`read_swarm_progress`) check every record on its own (signature, size, schema):
records that fail are left out and counted (``rejected``), so a process writing garbage under the run's keys cannot
crash or mislead them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from typing import Any

import torch

from collabopt.engine.compat import dht_time, versions
from collabopt.engine.records import read_run_records, reader_validators
from collabopt.engine.replicas import RIDE_ALONG
from collabopt.errors import ConfigurationError

__all__ = ["DILOCO_PUBLISH_INTERVAL", "PUBLISH_INTERVAL", "RECORD_TTL", "MetricsReporter", "read_swarm_progress",
           "reader_validators"]

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL = 2.0  # seconds between two metrics records of a peer
# ... of a DiLoCo peer: its rounds last minutes, and each record is a store on the key's replicas (every 10 s, 0.5 of
# a compressed DiLoCo peer's ~11 kB/s sent between rounds on the WAN bed, B6). The status page's staleness follows
# the record's interval (stale after three)
DILOCO_PUBLISH_INTERVAL = 30.0
RECORD_TTL = 30.0  # seconds a metrics record lives on the DHT, at least (a killed peer's disappears after this)
_RELAY_CHECK_EVERY = 15  # publications between two looks at this peer's announced addresses


class MetricsReporter:
    """Publishes a peer's metrics record every ``interval`` seconds from a daemon thread (so that a peer busy in a long
    averaging round still shows up as alive), and collects the losses the training loop reports.

    Built by :class:`~collabopt.CollaborativeOptimizer` for its peer; ``copt`` gives the values of the core,
    ``peer`` (a :class:`~collabopt.engine.peer.HivemindPeer`) those of hivemind and the DHT.
    """

    def __init__(self, copt: Any, peer: Any, interval: float = PUBLISH_INTERVAL, ttl: float | None = None):
        self.copt, self.peer = copt, peer
        self.interval = interval
        self.ttl = ttl if ttl is not None else max(RECORD_TTL, 3 * interval)  # (a record outlives two missed stores)
        self._lock = threading.Lock()
        self._loss_sum: Any = 0.0  # a tensor once a tensor loss was reported: summed on its device, read here
        self._loss_finite: Any = 0
        self._loss_count = 0
        self._loss: float | None = None  # the mean of the last publication's losses
        self._losses_reported = 0
        self._nonfinite_losses = 0
        self._fixed = dict(peer_id=peer.peer_id, client_mode=peer.client_mode, auxiliary=bool(copt.config.auxiliary),
                           **{f"{name}_version": value for name, value in versions().items()})
        self._relayed = False
        self._published = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="collabopt-metrics", daemon=True)
        self._thread.start()

    def report_loss(self, loss: Any) -> None:
        """Count one training loss (a number or a one-element tensor; a tensor is not copied to the host here)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ConfigurationError("report_loss", f"expected one value, got a tensor of shape "
                                         f"{tuple(loss.shape)}", "pass the scalar loss (e.g. loss, or loss.mean())")
            value = loss.detach().reshape(()).float()
            finite = torch.isfinite(value)
            with self._lock:
                self._loss_sum = self._loss_sum + torch.where(finite, value, torch.zeros_like(value))
                self._loss_finite = self._loss_finite + finite.int()
                self._loss_count += 1
            return
        try:
            value = float(loss)
        except (TypeError, ValueError):
            raise ConfigurationError("report_loss", f"expected a number or a one-element tensor, got "
                                     f"{type(loss).__name__}", "pass the loss, e.g. copt.report_loss(loss)") from None
        finite = math.isfinite(value)
        with self._lock:
            self._loss_sum = self._loss_sum + (value if finite else 0.0)
            self._loss_finite = self._loss_finite + int(finite)
            self._loss_count += 1

    def _take_losses(self) -> None:
        with self._lock:
            total, finite, count = self._loss_sum, self._loss_finite, self._loss_count
            self._loss_sum, self._loss_finite, self._loss_count = 0.0, 0, 0
        if count == 0:
            return  # nothing new: the record keeps the last mean
        finite = int(finite)
        mean = float(total) / finite if finite else None
        self._loss = mean if mean is not None and math.isfinite(mean) else self._loss
        self._losses_reported += count
        self._nonfinite_losses += count - finite

    def record(self) -> dict[str, Any]:
        """This peer's metrics record now (see :func:`collabopt.engine.records.metrics_fields`)."""
        peer, copt = self.peer, self.copt
        self._take_losses()
        if self._published % _RELAY_CHECK_EVERY == 0:
            self._relayed = peer.relayed
        epoch = int(peer.local_epoch)
        speed = peer.local_samples_per_second
        return dict(
            self._fixed,
            time=float(dht_time()),
            interval=float(self.interval),
            epoch=epoch,
            global_epoch=max(epoch, int(peer.global_epoch)),
            samples_per_second=float(speed) if math.isfinite(speed) and speed > 0 else 0.0,
            samples_reported=max(0, int(copt.samples_reported)),
            samples_skipped=max(0, int(copt.samples_skipped)),
            nonfinite_steps=int(copt.nonfinite_steps),
            target_batch_size=int(copt.target_batch_size),
            loss=self._loss,
            losses_reported=self._losses_reported,
            nonfinite_losses=self._nonfinite_losses,
            relayed=bool(self._relayed),
            last_round=_round_text(copt.last_round),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peer.publish_metrics(self.record(), dht_time() + self.ttl,  # (a renewal may wait a little)
                                          may_wait=min(RIDE_ALONG, self.interval / 3) if self._published else 0.0)
                self._published += 1
            except Exception as e:  # informational: never disturb training
                logger.debug("collabopt: could not publish metrics: %r", e)
            self._stop.wait(self.interval)

    def close(self) -> None:
        """Stop publishing and replace the record with ``None`` (this peer left). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.peer.publish_metrics(None, dht_time() + self.ttl)
        except Exception as e:
            logger.debug("collabopt: could not withdraw the metrics record: %r", e)


def _round_text(outcome: Any) -> str | None:
    """What a peer's record says of its last round: ``"epoch 12: applied: averaged (3 of 3)"``."""
    return None if outcome is None else f"epoch {outcome.epoch}: {outcome.summary()}"[:64]


def read_swarm_progress(dht: Any, run_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """Summarize the progress records of ``run_id``: peers, global epoch, samples, throughput, and how many records
    under the run's keys were rejected (bad signature, malformed, oversized) and left out. Each peer's entry also
    holds its ``last_round`` (from its metrics record; None without one).

    Works with any running DHT (a peer's, or a client's like ``collabopt monitor``'s)::

        dht = hivemind.DHT(initial_peers=[...], client_mode=True, start=True)
        print(read_swarm_progress(dht, "my_run")["global_epoch"])
    """
    records = read_run_records(dht, run_id, timeout)
    peers = [dict(record, last_round=(records.metrics.get(owner, (None, 0.0))[0] or {}).get("last_round"))
             for owner, (record, _expiration) in records.progress.items() if record is not None]
    global_epoch = max((p["epoch"] for p in peers if not p["client_mode"]), default=0)
    return dict(
        run_id=run_id,
        num_peers=len(peers),
        global_epoch=global_epoch,
        samples_accumulated=sum(p["samples_accumulated"] for p in peers if p["epoch"] == global_epoch),
        samples_per_second=sum(p["samples_per_second"] for p in peers),
        peers=sorted(peers, key=lambda p: p["peer_id"]),
        rejected=dict(Counter(reason for _kind, _fingerprint, reason in records.rejected)),
    )
