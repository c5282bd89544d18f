"""Train with CollaborativeStrategy where only ``pytorch_lightning`` can be imported (``lightning`` is hidden).

Usage: ``python tests/lightning_standalone_pl.py``; prints one JSON line with what it checked.
"""

from __future__ import annotations

import json
import sys

for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
    del sys.modules[name]
sys.modules["lightning"] = None  # type: ignore[assignment]  # "import lightning" now fails

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from collabopt.integrations.lightning import CollaborativeStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)
        self.samples_fed = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.samples_fed += len(x)
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Stop(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.strategy.local_epoch >= 2:
            trainer.should_stop = True


def main() -> None:
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    strategy = CollaborativeStrategy(target_batch_size=64, run_id=sys.argv[1], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=50, callbacks=[Stop()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module = Module()
    trainer.fit(module, DataLoader(data, batch_size=16))
    print(json.dumps({
        "strategy_base": f"{type(strategy).__mro__[1].__module__}.{type(strategy).__mro__[1].__name__}",
        "lightning_loaded": any(m == "lightning" or m.startswith("lightning.") for m in sys.modules
                                if sys.modules[m] is not None),
        "local_epoch": strategy.local_epoch,
        "samples_fed": module.samples_fed,
        "samples_reported": strategy.collaborative_optimizer.samples_reported,
    }))


if __name__ == "__main__":
    main()
