"""The swarm's state in Lightning's loggers (every ``swarm/<name>`` of :func:`collabopt.interface.swarm_metrics`, the
names every adapter logs) and progress bar (``swarm/num_peers``, ``swarm/local_epoch``, ``swarm/samples_per_second``),
logged by global rank 0 after every training batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collabopt.integrations._lightning_compat import Callback, LightningModule, Trainer

# shown in the progress bar (it has room for a few); the loggers get every swarm metric
PROGRESS_BAR = ("swarm/num_peers", "swarm/local_epoch", "swarm/samples_per_second")


class SwarmMetricsCallback(Callback):
    """Logs ``metrics()`` (the strategy's swarm metrics) after every training batch (progress bar and loggers)."""

    def __init__(self, metrics: Callable[[], dict[str, float]]):
        self.metrics = metrics

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        if not trainer.is_global_zero:
            return
        metrics = self.metrics()
        for prog_bar in (True, False):
            part = {name: value for name, value in metrics.items() if (name in PROGRESS_BAR) == prog_bar}
            if part:
                pl_module.log_dict(part, prog_bar=prog_bar, logger=bool(trainer.loggers), on_step=True,
                                   on_epoch=False, batch_size=1, rank_zero_only=True)
