"""Reading a run's state on the DHT.

Every peer's hivemind progress tracker publishes a signed, schema-checked record under ``<run_id>_progress``
(one subkey per peer, signed with that peer's key, so no peer can overwrite another's). A monitor reads them with
a DHT created with :func:`reader_validators`.
"""

from __future__ import annotations

from typing import Any

from collabopt._hivemind import read_progress_records, reader_validators

__all__ = ["read_swarm_progress", "reader_validators"]


def read_swarm_progress(dht: Any, run_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """Summarize the progress records of ``run_id``: peers, global epoch, samples, throughput.

    ``dht`` must have been created with :func:`reader_validators` (or be the DHT of a peer of the run).
    """
    peers = read_progress_records(dht, run_id, timeout)
    global_epoch = max((p["epoch"] for p in peers if not p["client_mode"]), default=0)
    return dict(
        run_id=run_id,
        num_peers=len(peers),
        global_epoch=global_epoch,
        samples_accumulated=sum(p["samples_accumulated"] for p in peers if p["epoch"] == global_epoch),
        samples_per_second=sum(p["samples_per_second"] for p in peers),
        peers=sorted(peers, key=lambda p: p["peer_id"]),
    )
