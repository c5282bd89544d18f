"""The Lightning names the strategy uses, from whichever Lightning is installed.

Rule: the unified ``lightning`` package first, then the standalone ``pytorch_lightning``. Reason: lightning-hivemind
users run either; the strategy works the same on both, and a missing Lightning fails with the install command.
"""

from __future__ import annotations

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import DDPStrategy, Strategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError:  # pragma: no cover - exercised only where only pytorch_lightning is installed
    try:
        from pytorch_lightning import LightningModule, Trainer  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
        from pytorch_lightning.core.optimizer import LightningOptimizer  # type: ignore[no-redef]
        from pytorch_lightning.strategies import DDPStrategy, Strategy  # type: ignore[no-redef]
        from pytorch_lightning.trainer.states import TrainerFn  # type: ignore[no-redef]
        from pytorch_lightning.utilities.model_helpers import is_overridden  # type: ignore[no-redef]
        from pytorch_lightning.utilities.rank_zero import rank_zero_warn  # type: ignore[no-redef]
    except ImportError as error:
        raise ImportError(
            "collabopt.integrations.lightning needs Lightning: pip install 'collabopt[lightning]' "
            "(or pip install lightning)"
        ) from error

__all__ = ["Callback", "DDPStrategy", "LightningModule", "LightningOptimizer", "Strategy", "Trainer", "TrainerFn",
           "is_overridden", "rank_zero_warn"]
