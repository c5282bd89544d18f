"""Train a digit classifier with a Lightning ``Trainer`` as one peer of a collaborative swarm.

The only change from an ordinary Lightning script is the strategy::

    from collabopt.integrations.lightning import CollaborativeStrategy
    trainer = Trainer(strategy=CollaborativeStrategy(target_batch_size=512, run_id="digits"), ...)

First machine (starts a new swarm and prints how others join)::

    python examples/lightning_train.py

Every other machine (same command, with the address the first one printed)::

    INITIAL_PEERS=/ip4/.../tcp/.../p2p/... python examples/lightning_train.py

Network switches (each also an environment variable): ``--port`` (a fixed port to open in a firewall),
``--announce-maddrs``, ``--client-mode`` (behind NAT), ``--relay-peers``; ``--help`` lists them.

Several local processes acting as ONE peer (DDP inside the machine, one swarm member)::

    python examples/lightning_train.py --devices 2

Data: scikit-learn's 8x8 digits (shipped with scikit-learn, no download).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package works too
    import pytorch_lightning as pl

from collabopt.integrations.lightning import CollaborativeStrategy

from collabopt.network_args import add_network_arguments, network_options


def digits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1500], order[1500:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class DigitClassifier(pl.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        # stepped once per global epoch (swarm-wide optimizer step), also with offload_optimizer=True
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: min(1.0, (epoch + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class StopAtGlobalEpoch(pl.Callback):
    """Stop once the swarm has made ``epochs`` global optimizer steps (Lightning epochs are local)."""

    def __init__(self, strategy: CollaborativeStrategy, epochs: int):
        self.strategy, self.epochs = strategy, epochs

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.strategy.local_epoch >= self.epochs:
            trainer.should_stop = True


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-id", default="lightning_digits")
    parser.add_argument("--target-batch-size", type=int, default=512, help="samples per global step (swarm-wide)")
    parser.add_argument("--batch-size", type=int, default=32, help="local batch size")
    parser.add_argument("--global-epochs", type=int, default=20, help="stop after this many global steps")
    parser.add_argument("--devices", type=int, default=1, help="local processes acting as one peer")
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed, or 16-mixed on a GPU")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--offload-optimizer", action="store_true")
    add_network_arguments(parser)  # --initial-peers, --port, --announce-maddrs, --client-mode, ...
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    train, test = digits()
    model = DigitClassifier()
    strategy = CollaborativeStrategy(
        target_batch_size=args.target_batch_size,
        run_id=args.run_id,
        offload_optimizer=args.offload_optimizer,
        **network_options(args),
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_epochs=1000,
        callbacks=[StopAtGlobalEpoch(strategy, args.global_epochs)],
        enable_checkpointing=False,
        logger=False,
    )
    start = accuracy(model, test)
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    if trainer.is_global_zero:
        print(f"finished at global epoch {strategy.local_epoch}: test accuracy {start:.3f} -> "
              f"{accuracy(model, test):.3f}", flush=True)


if __name__ == "__main__":
    main()
