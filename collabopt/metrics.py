"""Reading (and announcing) a run's state on the DHT.

Every peer's hivemind progress tracker publishes a signed, schema-checked record under ``<run_id>_progress``
(one subkey per peer, signed with that peer's key, so no peer can overwrite another's). A monitor reads them.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

SNAPSHOT_FIELDS = ("local_epoch", "global_epoch", "num_peers", "samples_accumulated", "target_batch_size",
                   "samples_per_second", "eta_next_epoch")


def swarm_snapshot(optimizer: Any) -> dict[str, float]:
    """The metrics of a collaborative optimizer (``metrics()`` of the core and of the node wrapper)."""
    return dict({name: getattr(optimizer, name) for name in SNAPSHOT_FIELDS}, lr=optimizer.get_lr()[0])


def reader_validators() -> list:
    """Validators a DHT must be *created* with to read the signed progress records (they strip signatures).

    Added later with ``dht.add_validators`` they do not help, and without them hivemind cannot decode the
    records (its get() then never returns): pass ``record_validators=reader_validators()`` to the DHT.
    """
    from hivemind.dht.crypto import RSASignatureValidator

    return [RSASignatureValidator()]


def read_swarm_progress(dht: Any, run_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """Summarize the progress records of ``run_id``: peers, global epoch, samples, throughput.

    ``dht`` must have been created with :func:`reader_validators` (or be the DHT of a peer of the run).
    """
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils import ValueWithExpiration

    try:
        found = dht.get(f"{run_id}_progress", latest=True, return_future=True).result(timeout=timeout)
    except FutureTimeout:
        found = None
    records = found.value if isinstance(found, ValueWithExpiration) and isinstance(found.value, dict) else {}
    peers = []
    for entry in records.values():
        value = getattr(entry, "value", None)
        if value is None:
            continue
        try:
            progress = LocalTrainingProgress.parse_obj(value)
        except Exception:
            continue  # not a valid record: ignore it
        peers.append(
            dict(
                peer_id=progress.peer_id.hex() if isinstance(progress.peer_id, bytes) else str(progress.peer_id),
                epoch=progress.epoch,
                samples_accumulated=progress.samples_accumulated,
                samples_per_second=progress.samples_per_second,
                client_mode=progress.client_mode,
                time=progress.time,
            )
        )
    global_epoch = max((p["epoch"] for p in peers if not p["client_mode"]), default=0)
    return dict(
        run_id=run_id,
        num_peers=len(peers),
        global_epoch=global_epoch,
        samples_accumulated=sum(p["samples_accumulated"] for p in peers if p["epoch"] == global_epoch),
        samples_per_second=sum(p["samples_per_second"] for p in peers),
        peers=sorted(peers, key=lambda p: p["peer_id"]),
    )


def announce_progress(tracker: Any, timeout: float = 10.0) -> None:
    """Publish this peer's progress record (hivemind's ``ProgressTracker``) now, with zero samples.

    hivemind publishes a peer's record only once it has accumulated samples, so peers that wait for each other
    before their first step never see each other. Stored under the tracker's own signed subkey; the tracker
    replaces it with its own reports as soon as this peer trains.
    """
    from hivemind.utils import get_dht_time

    now = get_dht_time()
    future = tracker.dht.store(key=tracker.training_progress_key, subkey=tracker._local_public_key,
                               value=tracker.local_progress.dict(), expiration_time=now + tracker.metadata_expiration,
                               return_future=True)
    with contextlib.suppress(FutureTimeout):  # not stored in time: the next call tries again
        future.result(timeout=timeout)


def refresh_progress(tracker: Any) -> None:
    """Make hivemind's progress tracker fetch the swarm's progress now rather than at its next scheduled time."""
    from hivemind.utils import get_dht_time

    tracker.global_progress.next_fetch_time = get_dht_time()
    tracker.global_state_updated.set()  # wakes the fetcher, which then finds its next fetch due
