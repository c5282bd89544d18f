"""Keeping a :class:`~collabopt.optimizer.CollaborativeOptimizer` with its swarm: waiting for peers, downloading
the swarm's state when this peer is behind, and continuing on its own when nobody can serve that state (hivemind
would retry at every step forever).

:class:`CatchUp` is a part of :class:`~collabopt.optimizer.CollaborativeOptimizer`, which sets the attributes
annotated below.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from collabopt.config import positive_int, positive_number

logger = logging.getLogger(__name__)

SYNC_ATTEMPTS = 3  # steps refused for being behind the swarm before a peer continues from its own parameters


class CatchUp:
    """The swarm-facing synchronization of :class:`~collabopt.optimizer.CollaborativeOptimizer`."""

    _peer: Any
    _failed_syncs: int
    _check_open: Any  # (SwarmOptimizerBase)
    _advance_schedule: Any  # (CollaborativeOptimizer)

    def catch_up(self) -> None:
        """Download the swarm's state now if the swarm is ahead of this peer (done on start unless
        ``load_state_on_start=False``)."""
        self._check_open()
        if self._peer.num_peers > 0 and self._peer.global_epoch > self._peer.local_epoch:
            logger.info("collabopt: swarm is at epoch %d, downloading its state", self._peer.global_epoch)
            self._peer.announce()  # a peer finishing meanwhile serves its final state until this one has it
            self._peer.load_state_from_peers()
        self._advance_schedule()

    def load_state_from_peers(self) -> None:
        """Download the newest parameters, optimizer state and epoch from the swarm now."""
        self._check_open()
        self._peer.load_state_from_peers()
        self._advance_schedule()

    def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> bool:
        """Block until the swarm counts ``num_peers`` peers, this one included; return whether it did within
        ``timeout`` seconds. Peers count once they train or while they wait here, so every peer of a small swarm
        can call it before its first step (a demo, a test, a run that should not start alone)::

            if not copt.wait_for_peers(2, timeout=120):
                print("training alone for now")

        On return, this peer's own view of the swarm includes the others, so its first global step is taken
        together with them rather than alone.

        This method is the one public form: every collaborative optimizer has it (the core, a
        :class:`~collabopt.node.NodeOptimizer`, what each adapter hands you), so it needs no import and works the same
        on each; the function ``collabopt.wait_for_peers(copt, n)`` is a deprecated alias.
        """
        self._check_open()
        positive_int("num_peers", num_peers, "2")
        positive_number("timeout", timeout, "60.0", allow_zero=True)
        deadline = time.monotonic() + timeout
        while True:
            self._peer.announce()  # hivemind itself would publish this peer only after its first samples
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            if self._peer.num_peers >= num_peers:
                return True
            if time.monotonic() >= deadline:
                return False

    def _give_up_sync_if_nobody_serves(self) -> None:
        """hivemind drops a step and downloads state when the swarm is ahead. When the peers that are ahead have
        left (their progress records outlive them), nobody can serve that state and hivemind would retry at every
        step forever. After :data:`SYNC_ATTEMPTS` such steps, continue from this peer's own parameters at the
        swarm's epoch. A boundary whose gradient round showed this peer behind its group (it did not step, and its
        download did not bring the swarm's epoch) is such a step too.
        """
        self._failed_syncs += 1
        if self._failed_syncs < SYNC_ATTEMPTS:
            return
        self._failed_syncs = 0
        epoch = self._peer.global_epoch
        warnings.warn(
            f"collabopt: the swarm is at epoch {epoch} but no peer could send its state ({SYNC_ATTEMPTS} attempts); "
            "continuing from this peer's own parameters at that epoch",
            stacklevel=3,
        )
        self._peer.jump_to_epoch(epoch)
