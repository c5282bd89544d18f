"""How SIGTERM ends the final wait (``serve_final_state`` after the last batch) under Lightning.

Rule: one process: Lightning's handler runs, then ``collabopt.Terminated`` ends the wait. Several processes (a
node): Lightning's handler does not run there; rank 0 records the SIGTERM where Lightning keeps it
(``trainer.received_sigterm``) and raises ``Terminated``, which the node sends to every rank; the other ranks only
record it. Reason: Lightning's handler only sets a flag, checked between batches, so alone it would not end a wait
after the last one; and with several processes it broadcasts on the default group, where no other rank is (they
wait for rank 0 in the node's wait group): it blocked for the default group's timeout (30 minutes), then failed.
"""

from __future__ import annotations

from typing import Any

from collabopt.lifecycle import sigterm_raises


def sigterm_ends_final_wait(trainer: Any, several_processes: bool, global_rank: int) -> Any:
    """The context manager the final wait runs in (see the module's rule)."""
    if not several_processes:
        return sigterm_raises()
    connector = getattr(trainer, "_signal_connector", None)  # holds trainer.received_sigterm (Lightning 2.x)

    def record() -> None:
        if connector is not None:
            connector.received_sigterm = True

    return sigterm_raises(instead=record, raises=global_rank == 0)


__all__ = ["sigterm_ends_final_wait"]
