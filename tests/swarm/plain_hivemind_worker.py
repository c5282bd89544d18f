"""A peer that runs plain hivemind (no collabopt), for the interoperability test.

Usage: ``python tests/swarm/plain_hivemind_worker.py config.json`` (``run_id``, ``out``, ``target_batch_size``,
``model_seed``, ``lr``; ``INITIAL_PEERS`` in the environment). It builds the model of ``peer_worker.py`` with a
``hivemind.Optimizer`` of the run, downloads the swarm's state with hivemind's own ``load_state_from_peers`` and
writes ``<out>.json`` (its epoch after the download) and ``<out>.pt`` (its parameters).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import hivemind
import torch
from peer_worker import exit_now, make_model, write_json


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    model = make_model(cfg["model_seed"])
    dht = hivemind.DHT(initial_peers=os.environ["INITIAL_PEERS"].split(","), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       start=True)
    optimizer = hivemind.Optimizer(dht=dht, run_id=cfg["run_id"], params=model.parameters(),
                                   optimizer=lambda params: torch.optim.SGD(params, lr=cfg["lr"]),
                                   target_batch_size=cfg["target_batch_size"], batch_size_per_step=16,
                                   matchmaking_time=2.0, averaging_timeout=10.0, load_state_timeout=20.0,
                                   verbose=True)
    try:
        optimizer.load_state_from_peers()
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, cfg["out"] + ".pt")
        write_json(cfg["out"] + ".json", {"epoch": optimizer.local_epoch})
    finally:
        optimizer.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
