"""What a :class:`~collabopt.optimizer.CollaborativeOptimizer` shows of its peer and its swarm: read-only
properties (epochs, peers, throughput, the last round, the counters of refused work) and the optimizer really
stepped. Each reads the peer at the time of the call, so a value is never stale; once closed, the swarm's values
fall back to their defaults rather than raise.

:class:`PeerViews` is a part of :class:`~collabopt.optimizer.CollaborativeOptimizer`, which sets the attributes
annotated below.
"""

from __future__ import annotations

from typing import Any

import torch

from collabopt.diloco import DiLoCo
from collabopt.guard import NonFiniteGuard
from collabopt.interface import RoundOutcome
from collabopt.rounds import RoundWatch


class PeerViews:
    """The read-only properties of :class:`~collabopt.optimizer.CollaborativeOptimizer`."""

    diloco: DiLoCo | None
    _peer: Any
    _guard: NonFiniteGuard | None
    _samples_skipped: int
    _rounds: RoundWatch

    @property
    def loop(self) -> Any:
        """The peer's loop (:class:`~collabopt.engine.loop.PeerLoop`): its progress tracker and averagers, for
        what collabopt does not wrap."""
        return getattr(self._peer, "loop", None)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that hivemind really steps (a copy of yours when offloading)."""
        return self._peer.optimizer

    @property
    def param_groups(self) -> list[dict]:
        """Param groups over the model's parameters (used by ``torch.amp.GradScaler``)."""
        return self._peer.param_groups

    def _read(self, name: str, default: Any) -> Any:
        """A swarm value as this peer sees it; ``default`` once closed (or before the peer exists)."""
        return getattr(self._peer, name) if self._peer is not None else default

    local_epoch = property(lambda self: self._read("local_epoch", 0),
                           doc="Number of global optimizer steps this peer has taken part in (or caught up with).")
    global_epoch = property(lambda self: self._read("global_epoch", 0),
                            doc="The newest epoch any peer of the swarm has reached (as this peer last saw it).")
    num_peers = property(lambda self: max(1, self._read("num_peers", 1)),
                         doc="Peers training in this run, this one included (hivemind's count, refreshed every few "
                             "seconds; at least 1: hivemind counts a peer only after its first step).")
    samples_accumulated = property(lambda self: self._read("samples_accumulated", 0),
                                   doc="Samples the swarm has accumulated toward target_batch_size in this epoch.")
    samples_per_second = property(lambda self: self._read("samples_per_second", 0.0),
                                  doc="Throughput of the whole swarm (this peer's rate times the number of peers).")
    eta_next_epoch = property(lambda self: self._read("eta_next_epoch", 0.0),
                              doc="Estimated seconds until the next global epoch.")

    @property
    def samples_skipped(self) -> int:
        """Samples this peer trained on that contribute nothing: steps the non-finite guard (or an AMP overflow)
        dropped, which also leave ``samples_reported``; in DiLoCo mode also the inner steps undone by a restart from
        the last round's parameters (those stay in ``samples_reported``: the swarm counted them toward its round)."""
        return self._samples_skipped + (self.diloco.samples_discarded if self.diloco is not None else 0)

    @property
    def nonfinite_steps(self) -> int:
        """Accumulations (or, with ``use_local_updates``, local steps) the non-finite guard dropped (their samples
        are in ``samples_skipped``; in DiLoCo mode: restarts from the last round's parameters, see
        :mod:`collabopt.diloco`) plus global steps or rounds whose non-finite averaging result was refused."""
        guard = self._guard
        return guard.refused_steps + guard.refused_updates + guard.restored_parameters if guard is not None else 0

    @property
    def last_round(self) -> RoundOutcome | None:
        """The outcome of this peer's last round (a global epoch's boundary, or a DiLoCo round): applied, or not
        and why, and whether this peer re-synchronizes (:class:`~collabopt.interface.RoundOutcome`); None before its
        first. Each step's :class:`~collabopt.interface.StepResult` carries the one it ended, if any."""
        return self._rounds.last

    @property
    def out_of_sync(self) -> bool:
        """Whether this peer knows its parameters differ from its swarm's: its last gradient round was partial (a
        peer's share of the average arrived late; hivemind used this peer's own gradients for it), or a round found
        it on another lineage or an epoch behind. Its next gradient round or step re-synchronizes it. False proves
        nothing: only rounds compare parameters. Save the checkpoint of a run from a peer where this is False. In
        DiLoCo mode: its last round found its anchor apart from its group's, or was partial; it downloads the swarm's
        state before its next round."""
        if self.diloco is not None and self.diloco.needs_sync:
            return True
        return self._peer is not None and self._peer.out_of_sync

    def get_lr(self) -> list[float]:
        """Learning rates of the optimizer that hivemind steps."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]
