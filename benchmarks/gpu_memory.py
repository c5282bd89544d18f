"""GPU memory (issue 34, part 3): ``torch.cuda.max_memory_allocated`` of the GPT-like model's training under fp16
autocast with ``torch.amp.GradScaler`` (bf16 on the CPU smoke version), plain torch against collabopt's default mode,
``offload_optimizer`` and DiLoCo, each a lone peer training a few epochs in one process, one mode after the other.

Per mode: the peak of the GPU memory allocated while training (the parameters included, the memory held before the
model was built excluded) over plain torch's, and the tensor bytes live in the middle of an epoch (gradients
accumulated) beyond plain torch's, split into GPU and host memory (every tensor the garbage collector finds,
distinct storages: :func:`benchmarks.memory.live_tensor_bytes`), in units of the parameters' fp32 bytes.
:data:`DOCUMENTED` names the buffers collabopt (that is, hivemind under it) holds in each mode and where each lives
(docs/performance.md, B4 notes); the check is that the GPU holds nothing beyond them.
Run alone: ``python -m benchmarks.gpu_memory config.json``.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import run_module
from benchmarks.gpu_models import GPT_100M, GPT_TINY, lm_batches, lm_loss, make_gpt
from benchmarks.memory import live_tensor_bytes

MODES: dict[str, dict[str, Any] | None] = {
    "plain torch": None,
    "default": {},
    "offload_optimizer": {"offload_optimizer": True},
    "DiLoCo": {"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)},
}
# mode: (GPU bytes beyond plain torch in units of the parameters, the buffers and where each lives)
DOCUMENTED = {
    "default": (1.0, "GPU: the gradient accumulators (1x; they stay on the GPU so that a step copies nothing to the "
                     "host). Host: the all-reduce buffers (1x, shared memory of the averager's process) and "
                     "hivemind's copy of the parameters for parameter averaging (1x)"),
    "offload_optimizer": (1.0, "GPU: at most the gradient accumulators (1x). Host: the optimizer's parameters and "
                               "its state (Adam's moments move there from the GPU), the all-reduce buffers"),
    "DiLoCo": (0.0, "GPU: nothing. Host: the anchor (the parameters of the last round), the outer optimizer's "
                    "momentum and the all-reduce buffers of the pseudo-gradient"),
}
SLACK = 0.1  # of the parameters: allocator rounding, autocast's weight casts cached differently
GPU = dict(model=GPT_100M, steps_per_epoch=4, epochs=3, matchmaking_time=1.0)
SMOKE = dict(model=GPT_TINY, steps_per_epoch=4, epochs=2, matchmaking_time=0.3)


def measure(mode: str, cfg: dict[str, Any], device: str) -> dict[str, Any]:
    from collabopt import CollaborativeOptimizer

    cuda = device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    gpu_before = live_tensor_bytes(device) if cuda else 0
    host_before = live_tensor_bytes("cpu")
    model = make_gpt(cfg["model"], device)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    k = cfg["steps_per_epoch"]
    batches = lm_batches(cfg["model"], k, device)
    batch_bytes = sum(t.numel() * t.element_size() for b in batches for t in b)
    dtype = torch.float16 if cuda else torch.bfloat16
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    opt: Any = torch.optim.Adam(model.parameters(), lr=1e-4)
    options = MODES[mode]
    if options is not None:
        opt = CollaborativeOptimizer(opt, run_id=f"gpu_b4_{uuid.uuid4().hex[:8]}", batch_size=cfg["model"]["batch"],
                                     target_batch_size=cfg["model"]["batch"] * k, scaler=scaler,
                                     host_maddrs=["/ip4/127.0.0.1/tcp/0"], matchmaking_time=cfg["matchmaking_time"],
                                     print_join_message=False, handle_signals=False, **options)
    try:
        for step in range(k * cfg["epochs"] + 1):
            with torch.autocast(device, dtype=dtype):
                loss = lm_loss(model, *batches[step % k])
            scaler.scale(loss).backward()
            if step == k * cfg["epochs"]:  # the middle of an epoch: gradients accumulated, where memory is highest
                break
            if options is not None or (step + 1) % k == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        row: dict[str, Any] = dict(mode=mode, param_bytes=param_bytes,
                                   epochs=opt.local_epoch if options is not None else cfg["epochs"])
        host = live_tensor_bytes("cpu") - host_before
        row["host_extra_bytes"] = host - (0 if cuda else param_bytes + batch_bytes)
        if cuda:
            torch.cuda.synchronize()
            row["gpu_peak_bytes"] = torch.cuda.max_memory_allocated() - held_before
            row["gpu_live_bytes"] = live_tensor_bytes(device) - gpu_before - batch_bytes
    finally:
        if options is not None:
            opt.close()
    del model, opt, batches
    return row


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    device = "cuda" if cfg["cuda"] else "cpu"
    rows = [measure(mode, cfg, device) for mode in MODES]
    plain = rows[0]
    for row in rows:
        p = row["param_bytes"]
        row["host_extra_over_params"] = (row["host_extra_bytes"] - plain["host_extra_bytes"]) / p
        if device == "cuda":
            row["gpu_peak_over_plain"] = row["gpu_peak_bytes"] / plain["gpu_peak_bytes"]
            row["gpu_peak_extra_over_params"] = (row["gpu_peak_bytes"] - plain["gpu_peak_bytes"]) / p
            row["gpu_live_extra_over_params"] = (row["gpu_live_bytes"] - plain["gpu_live_bytes"]) / p
            if row["mode"] in DOCUMENTED:
                row["within_documented"] = row["gpu_peak_extra_over_params"] <= DOCUMENTED[row["mode"]][0] + SLACK
    Path(cfg["out"]).write_text(json.dumps(dict(device=device, rows=rows)))


def run(workdir: Path, smoke: bool) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    settings = dict(SMOKE if smoke else GPU, cuda=not smoke)
    try:
        result = run_module("benchmarks.gpu_memory", settings, workdir, 120 if smoke else 200, name="gpu_memory")
    except RuntimeError as error:
        return dict(settings=settings, rows=[], error=str(error)[-1500:])
    return dict(result, settings=settings)


def table(result: dict[str, Any]) -> list[str]:
    if result.get("skipped"):
        return ["(not run)"]
    if result.get("error"):
        return [f"failed: {result['error']}"]
    cuda = result["device"] == "cuda"
    lines = ["Lone peer per mode, fp16 autocast + GradScaler (bf16 on CPU), a few epochs of the local-step model; "
             "measured in the middle of an epoch. \"x params\": in units of the parameters' fp32 bytes, beyond "
             "plain torch's. Goal: the GPU holds nothing beyond the documented buffers.", "",
             "| mode | peak GPU memory / plain torch | GPU peak beyond plain (x params) | GPU live beyond plain "
             "(x params) | host tensors beyond plain (x params) | documented buffers (GPU beyond plain, x params) | "
             "within |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        gpu = (f"{row['gpu_peak_over_plain']:.3f} | {row['gpu_peak_extra_over_params']:+.2f} | "
               f"{row['gpu_live_extra_over_params']:+.2f}") if cuda else "— (no GPU) | — | —"
        documented = DOCUMENTED.get(row["mode"])
        doc = f"{documented[1]} ({documented[0]:g})" if documented else "baseline: Adam's gradients and 2 moments"
        within = ("yes" if row.get("within_documented") else "NO") if cuda and documented else "—"
        lines.append(f"| {row['mode']} | {gpu} | {row['host_extra_over_params']:+.2f} | {doc} | {within} |")
    return lines


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip hivemind's noisy interpreter-exit finalizers; everything was shut down above
