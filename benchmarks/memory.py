"""B4 memory: extra tensor bytes each collabopt mode holds, relative to the model's parameter bytes.

For every mode (none / reuse / offload / both, and a plain torch optimizer as baseline) the same MLP trains for a
few global epochs as a lone peer, then every live tensor of the process is found through the garbage collector and
the bytes of their distinct storages are summed (shared-memory buffers of hivemind's averagers included, counted
once). "extra" is that sum minus the model's parameters and the input batches, divided by the parameter bytes.
With CUDA available, the model runs on the GPU and ``torch.cuda.max_memory_allocated`` is reported per mode too.

Run alone: ``python -m benchmarks.memory config.json``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import make_mlp, num_params, write_json

MODES = {
    "plain torch": None,
    "none": {},
    "reuse": {"reuse_grad_buffers": True},
    "offload": {"offload_optimizer": True},
    "both": {"reuse_grad_buffers": True, "offload_optimizer": True},
}


def live_tensor_bytes(device_type: str | None = None) -> int:
    """Bytes of the distinct storages of all tensors reachable by the garbage collector."""
    gc.collect()
    seen: dict[tuple[str, int], int] = {}
    tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    # a .grad made by backward() has no Python object until it is read, so the collector cannot see it
    tensors += [t.grad for t in tensors if t.is_leaf and t.requires_grad and t.grad is not None]
    for obj in tensors:
        try:
            if obj.is_meta:
                continue
            storage = obj.untyped_storage()
            if device_type is not None and storage.device.type != device_type:
                continue
            key = (str(storage.device), storage.data_ptr())
            seen[key] = max(seen.get(key, 0), storage.nbytes())
        except Exception:  # sparse / exotic tensors without storage
            continue
    return sum(seen.values())


def measure(mode: str, cfg: dict[str, Any], dht: Any, device: str) -> dict[str, Any]:
    from collabopt import CollaborativeOptimizer

    torch.manual_seed(0)
    model = make_mlp(cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"]).to(device)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(cfg["batch"], cfg["in_dim"], device=device)
    y = torch.randint(0, 16, (cfg["batch"],), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = live_tensor_bytes(device if device == "cuda" else None)
    options = MODES[mode]
    k = cfg["steps_per_epoch"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if options is not None:
        opt = CollaborativeOptimizer(
            opt, run_id=f"bench_b4_{uuid.uuid4().hex[:8]}", target_batch_size=cfg["batch"] * k, batch_size=cfg["batch"],
            dht=dht, print_join_message=False, handle_signals=False, matchmaking_time=cfg["matchmaking_time"],
            **options,
        )
    try:
        for step in range(k * cfg["epochs"]):
            F.cross_entropy(model(x), y).backward()
            if options is not None or (step + 1) % k == 0:  # collabopt decides itself when to step globally
                opt.step()
                opt.zero_grad()
        # measure in the middle of an epoch (gradients accumulated), where memory is highest
        F.cross_entropy(model(x), y).backward()
        if options is not None:
            opt.step()
        after = live_tensor_bytes(device if device == "cuda" else None)
        row = dict(mode=mode, param_bytes=param_bytes, extra_bytes=after - before,
                   extra_over_params=(after - before) / param_bytes,
                   epochs=opt.local_epoch if options is not None else cfg["epochs"])
        if device == "cuda":
            torch.cuda.synchronize()
            row["cuda_max_allocated_over_params"] = torch.cuda.max_memory_allocated() / param_bytes
            row["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    finally:
        if options is not None:
            opt.close()
    return row


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    import hivemind

    warnings.filterwarnings("ignore")
    device = "cuda" if torch.cuda.is_available() and not cfg.get("cpu_only") else "cpu"
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    rows = []
    try:
        for mode in cfg.get("modes", list(MODES)):
            rows.append(measure(mode, cfg, dht, device))
            gc.collect()
    finally:
        dht.shutdown()
    torch.manual_seed(0)
    write_json(cfg["out"], dict(device=device, params=num_params(make_mlp(cfg["params"], cfg["width"], cfg["in_dim"])),
                                rows=rows))


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip hivemind's noisy interpreter-exit finalizers; everything was shut down above
