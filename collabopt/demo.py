"""``collabopt demo``: a local swarm of peer processes trains a digits classifier together.

The coordinator (this process) runs the bootstrap DHT, starts ``--peers`` peer processes on loopback (different
seeds and batch sizes), shows a live progress bar read from the progress records peers publish to the DHT, and
ends with a summary: global epochs, held-out accuracy, samples contributed per peer and the largest parameter
difference between peers (0: they hold bit-identical parameters).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from collabopt.errors import CollaborativeError, ConfigurationError

BATCH_SIZES = ([16, 24, 32], [32, 48], [8, 16, 24, 40])  # per peer: varying batch sizes, cycled


def _require_demo_extras() -> None:
    try:
        import sklearn  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as e:  # the environment, not the command line: a runtime error (exit status 1)
        raise CollaborativeError(
            f"needs the demo extras ({e.name} is missing). Fix: pip install 'collabopt[demo]'") from None


def load_digits_split(seed: int = 0):
    """scikit-learn's bundled 8x8 digits (no download): a fixed 80/20 train/test split, scaled to [0, 1]."""
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(x))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def make_model():
    import torch

    torch.manual_seed(0)  # every peer starts from the same weights (the swarm would align them anyway)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def run_peer(index: int, config: dict[str, Any]) -> None:
    """One peer process: trains until the swarm reached ``epochs`` global epochs, then writes its results."""
    import torch
    import torch.nn.functional as F

    from collabopt import CollaborativeOptimizer

    (x_train, y_train), (x_test, y_test) = load_digits_split()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: min(1.0, (epoch + 1) / 3))  # warmup
    generator = torch.Generator().manual_seed(1000 + index)
    sizes = BATCH_SIZES[index % len(BATCH_SIZES)]
    fed = 0
    in_step = 0.0  # seconds inside copt.step(): what the swarm costs this peer (matchmaking, averaging, bookkeeping)
    with CollaborativeOptimizer(
        optimizer,
        run_id=config["run_id"],
        target_batch_size=config["target_batch_size"],
        scheduler=scheduler,
        model=model,
        initial_peers=config["initial_peers"],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        matchmaking_time=2.0,
        averaging_timeout=15.0,
        print_join_message=False,
    ) as copt:
        step = 0
        deadline = time.monotonic() + config["timeout"]
        # start together: a peer alone would race through the first epochs before the others have joined
        out = Path(config["out_dir"])
        copt.wait_for_peers(config["peers"], timeout=config["timeout"])
        started = time.monotonic()
        # the finish line: a peer that reached the last epoch trains on until every peer has. hivemind matches
        # averaging rounds by time, not by epoch, so a peer that missed the start of one round counts the next ones
        # one epoch late; if the others stopped at the last epoch, it would take its last step alone.
        while time.monotonic() < deadline:
            if copt.local_epoch >= config["epochs"]:
                (out / f"peer{index}.done").touch()
                if all((out / f"peer{i}.done").exists() for i in range(config["peers"])):
                    break
            n = sizes[step % len(sizes)]
            idx = torch.randint(0, len(x_train), (n,), generator=generator)
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            before = time.monotonic()
            copt.step()  # samples counted from the model's forward call
            copt.zero_grad()
            in_step += time.monotonic() - before
            copt.report_loss(loss)  # shown by the status page (--serve)
            fed += n
            step += 1
            time.sleep(0.1)  # a stand-in for a bigger model's compute: epochs last a few seconds, so that peers meet
        wall = time.monotonic() - started
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        torch.save(model.state_dict(), out / f"peer{index}.pt")
        (out / f"peer{index}.json").write_text(json.dumps(dict(
            epoch=copt.local_epoch, samples_reported=copt.samples_reported, samples_fed=fed, accuracy=accuracy,
            computed=(wall - in_step) / wall if wall > 0 else 0.0,
        )))


def _max_param_diff(paths: list[Path]) -> float:
    import torch

    states = [torch.load(p) for p in paths]
    return max(
        (float((a[k] - b[k]).abs().max()) for a in states for b in states for k in a),
        default=float("nan"),
    )


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of ``collabopt demo``."""
    _require_demo_extras()
    if args.peers < 1 or args.epochs < 1 or args.target_batch_size < 1:
        raise ConfigurationError("--peers/--epochs/--target-batch-size", "must be positive", "e.g. --peers 3")
    if not args.timeout > 0:
        raise ConfigurationError("--timeout", f"must be a positive number of seconds, got {args.timeout}",
                                 "e.g. --timeout 300")
    from tqdm import tqdm

    from collabopt.lifecycle import preserved_sigint
    from collabopt.metrics import read_swarm_progress, reader_validators
    from collabopt.processes import Process, child_env, stop_all
    from collabopt.swarm import SwarmOptions, start_dht

    address = None
    if getattr(args, "serve", None):
        from collabopt.status_page import parse_address

        address = parse_address(args.serve)
    run_id = args.run_id or f"demo_{uuid.uuid4().hex[:8]}"
    print(f"collabopt demo: {args.peers} peers train a digits classifier together (run_id={run_id})", flush=True)
    print("collabopt demo: starting the bootstrap peer (a DHT on 127.0.0.1)", flush=True)
    with preserved_sigint():
        dht = start_dht(SwarmOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=reader_validators()))
    initial_peers = [str(m) for m in dht.get_visible_maddrs()]
    procs: list[Process] = []
    bar = None
    server = _serve_status_page(dht, run_id, address) if address is not None else None
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="collabopt-demo-") as out_dir:
        try:
            config = dict(run_id=run_id, target_batch_size=args.target_batch_size, epochs=args.epochs, lr=1e-2,
                          initial_peers=initial_peers, out_dir=out_dir, timeout=args.timeout, peers=args.peers)
            env = child_env("ERROR", OMP_NUM_THREADS="1")
            print(f"collabopt demo: starting {args.peers} peer processes (each starts its DHT and averagers, then "
                  f"waits for the others: about 10 s)", flush=True)
            for index in range(args.peers):
                procs.append(Process([sys.executable, "-m", "collabopt.demo", str(index), json.dumps(config)],
                                     Path(out_dir) / f"peer{index}.log", env=env))
            bar = tqdm(total=args.epochs, desc=f"peers joining 0/{args.peers}", unit="epoch",
                       disable=args.no_progress, dynamic_ncols=True)
            all_joined = False
            while any(p.poll() is None for p in procs):
                if time.monotonic() - start > args.timeout + 30:  # one line, no traceback (exit status 1)
                    raise CollaborativeError(
                        f"the peers did not finish within {args.timeout + 30:.0f} s. Fix: on a busy or slow machine, "
                        f"give them longer (--timeout {max(300, 2 * args.timeout):.0f}) or fewer epochs (--epochs)")
                report = read_swarm_progress(dht, run_id)
                if not all_joined:
                    all_joined = report["num_peers"] >= args.peers
                    bar.set_description("global epochs" if all_joined else
                                        f"peers joining {report['num_peers']}/{args.peers}", refresh=False)
                    if all_joined and args.no_progress:
                        print(f"collabopt demo: all {args.peers} peers joined; training", flush=True)
                bar.n = max(bar.n, min(report["global_epoch"], args.epochs))  # records expire as peers leave
                bar.set_postfix(peers=report["num_peers"], samples=report["samples_accumulated"],
                                sps=f"{report['samples_per_second']:.0f}/s", refresh=False)
                bar.refresh()
                time.sleep(0.5)
            bar.n = args.epochs if all(p.returncode == 0 for p in procs) else bar.n
            bar.close()
            failed = [i for i, p in enumerate(procs) if p.returncode != 0]
            if failed:
                for i in failed:
                    print(f"peer {i} failed (exit {procs[i].returncode}):\n{procs[i].tail()}", file=sys.stderr)
                return 1
            return _summary(Path(out_dir), args, time.monotonic() - start)
        finally:
            if bar is not None:
                bar.close()  # before anything else is printed (Ctrl+C, a failed peer)
            stop_all(procs, grace=15)  # SIGTERM, then SIGKILL to each peer's whole process tree
            if server is not None:
                server.stop()
            dht.shutdown()


def _serve_status_page(dht, run_id: str, address: tuple[str, int]):
    """The run's status page (``collabopt monitor --serve``), read through the demo's own DHT."""
    from collabopt.errors import ConfigurationError
    from collabopt.monitor import SwarmMonitor
    from collabopt.status_page import StatusServer

    try:
        server = StatusServer(SwarmMonitor(dht, run_id, interval=1.0), address).start()
    except OSError as e:
        dht.shutdown()
        raise ConfigurationError("--serve", f"cannot listen on {address[0]}:{address[1]} ({e})",
                                 "choose another port") from None
    print(f"collabopt demo: status page at {server.url}", flush=True)
    return server


def _summary(out_dir: Path, args: argparse.Namespace, elapsed: float) -> int:
    results = [json.loads((out_dir / f"peer{i}.json").read_text()) for i in range(args.peers)]
    max_diff = _max_param_diff([out_dir / f"peer{i}.pt" for i in range(args.peers)])
    print(f"\nSummary ({elapsed:.0f} s)")
    print(f"  global epochs reached: {min(r['epoch'] for r in results)}")
    print(f"  held-out accuracy:     {results[0]['accuracy']:.1%}")
    for i, r in enumerate(results):
        print(f"  peer {i}: contributed {r['samples_reported']} samples (fed {r['samples_fed']}), "
              f"batch sizes {BATCH_SIZES[i % len(BATCH_SIZES)]}, accuracy {r['accuracy']:.1%}")
    computed = sorted(r["computed"] for r in results)
    print(f"  peers computed {computed[len(computed) // 2]:.0%} of the time (min {computed[0]:.0%}); the rest they "
          "waited inside step() for the swarm (mostly matchmaking and averaging at global-epoch boundaries)")
    print(f"  max parameter difference between peers: {max_diff:g}")
    # hivemind's all-reduce hands each peer `average - own` to add, so peers agree to float rounding (usually
    # exactly): anything above 1e-6 means a peer really diverged
    ok = max_diff <= 1e-6 and all(r["epoch"] >= args.epochs for r in results)
    in_sync = "bit-identical" if max_diff == 0.0 else "identical up to float rounding"
    print(f"  peers are in sync ({in_sync})" if ok else "  PEERS DIVERGED OR DID NOT FINISH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    run_peer(int(sys.argv[1]), json.loads(sys.argv[2]))
