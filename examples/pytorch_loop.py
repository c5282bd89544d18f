"""A plain PyTorch training loop that trains together with every other copy of itself.

First machine (starts a new swarm and prints how to join it, as a command to paste):

    .venv/bin/python examples/pytorch_loop.py --run-id digits

Every other machine (the command the first one printed, its INITIAL_PEERS included):

    INITIAL_PEERS=/ip4/203.0.113.5/tcp/41235/p2p/12D3KooW... .venv/bin/python examples/pytorch_loop.py --run-id digits

Network switches (each also an environment variable): --port to listen on a fixed port (to open it in a firewall),
--announce-maddrs behind port forwarding, --client-mode behind NAT (what `collabopt doctor` says to do).
--log-level DEBUG shows each step of the rounds (the printed join command carries it to the other peers).

The defaults make an epoch last longer than matchmaking_time with up to 3 peers (collabopt warns when the swarm fills
an epoch faster): this tiny model's steps are timed by --compute-delay, so a peer feeds at most
--batch-size / --compute-delay = 640 samples/s, and 3 peers fill an epoch in 6.4 s or more.

Needs scikit-learn for its bundled digits dataset (`pip install 'collabopt[demo]'`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from collabopt.integrations.pytorch import collaborate
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from collabopt import CollaborativeError
from collabopt.cli import LOG_LEVELS, set_log_level
from collabopt.network_args import add_network_arguments, network_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-id", default="digits_example")
    parser.add_argument("--target-batch-size", type=int, default=12288, help="samples per global step")
    parser.add_argument("--matchmaking-time", type=float, default=5.0,
                        help="seconds peers spend forming an averaging group at the end of an epoch")
    parser.add_argument("--batch-size", type=int, default=32, help="local batch size")
    parser.add_argument("--epochs", type=int, default=20, help="stop after this many global epochs")
    parser.add_argument("--checkpoint", type=Path, default=None, help="resume from / save to this file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-peers", type=int, default=1,
                        help="wait (up to 2 minutes) until this many peers are in the swarm before training")
    parser.add_argument("--compute-delay", type=float, default=0.05,
                        help="seconds of simulated compute per step: this tiny model is so fast that a global epoch "
                             "would end before other peers can join it; a real model needs none")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None, metavar="LEVEL",
                        help="log level of collabopt and hivemind, e.g. DEBUG (default: $HIVEMIND_LOGLEVEL, else INFO)")
    add_network_arguments(parser)  # --initial-peers, --port, --announce-maddrs, --client-mode, ...
    args = parser.parse_args()
    set_log_level(args.log_level)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a tiny model needs one thread, and copies that share a machine then share its cores
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    loader = DataLoader(TensorDataset(x[:1400], y[:1400]), batch_size=args.batch_size, shuffle=True)
    x_test, y_test = x[1400:], y[1400:]

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the schedule counts global epochs (one per target_batch_size samples of the whole swarm)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=args.epochs + 1)

    with collaborate(model, optimizer, run_id=args.run_id, target_batch_size=args.target_batch_size,
                     scheduler=scheduler, matchmaking_time=args.matchmaking_time,
                     **network_options(args)) as copt:
        if args.checkpoint is not None and args.checkpoint.exists():
            saved = torch.load(args.checkpoint)
            model.load_state_dict(saved["model"])
            copt.load_state_dict(saved["optimizer"])
            print(f"resumed from {args.checkpoint} at epoch {copt.local_epoch}")
        if args.min_peers > 1 and not copt.wait_for_peers(args.min_peers, timeout=120):
            print(f"fewer than {args.min_peers} peers after 2 minutes: training with {copt.num_peers}")
        epoch = copt.local_epoch
        while copt.local_epoch < args.epochs:
            for inputs, targets in loader:
                loss = F.cross_entropy(model(inputs), targets)
                loss.backward()
                copt.step()  # the samples are counted from model's forward call
                copt.zero_grad()
                time.sleep(args.compute_delay)
                if copt.local_epoch != epoch:  # a global epoch ended: the swarm averaged and stepped
                    with torch.no_grad():
                        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
                    jumped = copt.local_epoch > epoch + 1  # it fell behind and downloaded the swarm's state
                    caught_up = f" (caught up with the swarm from epoch {epoch})" if jumped else ""
                    epoch = copt.local_epoch
                    print(f"epoch {epoch}: {copt.num_peers} peers, lr {copt.get_lr()[0]:.2e}, "
                          f"held-out accuracy {accuracy:.1%}{caught_up}", flush=True)
                if copt.local_epoch >= args.epochs:
                    break
        copt.serve_final_state()  # stays while a peer is behind this epoch: it downloads the final state from here
        if args.checkpoint is not None:
            torch.save({"model": model.state_dict(), "optimizer": copt.state_dict()}, args.checkpoint)


if __name__ == "__main__":
    try:
        main()
    except CollaborativeError as e:  # a bad option, or no initial peer answered: the message says what to do
        raise SystemExit(f"pytorch_loop.py: {e}") from None
    except KeyboardInterrupt:  # Ctrl+C: the `with` block has already left the swarm
        print("pytorch_loop.py: interrupted; this peer left the swarm (the others train on)", file=sys.stderr)
        raise SystemExit(130) from None
