"""The swarm's state in Lightning's progress bar and loggers: ``swarm/peers``, ``swarm/epoch``,
``swarm/samples_per_s``, logged by global rank 0 after every training batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collabopt.integrations._lightning_compat import Callback, LightningModule, Trainer


def swarm_metrics_of(copt: Any) -> dict[str, float]:
    """The metrics of ``copt`` (a collaborative optimizer or node) while it is open; empty otherwise."""
    if copt is None or copt.closed:
        return {}
    return {
        "swarm/peers": float(max(1, copt.num_peers)),  # this peer trains even before its record is seen
        "swarm/epoch": float(copt.local_epoch),
        "swarm/samples_per_s": float(copt.samples_per_second),
    }


class SwarmMetricsCallback(Callback):
    """Logs ``metrics()`` (the strategy's swarm metrics) after every training batch (progress bar and loggers)."""

    def __init__(self, metrics: Callable[[], dict[str, float]]):
        self.metrics = metrics

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        if not trainer.is_global_zero:
            return
        metrics = self.metrics()
        if metrics:
            pl_module.log_dict(metrics, prog_bar=True, logger=bool(trainer.loggers), on_step=True, on_epoch=False,
                               batch_size=1, rank_zero_only=True)
