"""Runs the same training (same init, same batches) under several collabopt modes in one fresh process.

Usage: ``python tests/equivalence_worker.py out.pt``. Each mode is a solo peer of its own new swarm (a real
hivemind optimizer, DHT and averagers), built and closed one after the other. Writes ``{mode: {...}}``.
"""

from __future__ import annotations

import sys
import uuid
import warnings

import torch
import torch.nn.functional as F

from collabopt import CollaborativeOptimizer

STEPS, BATCH, TARGET = 24, 16, 64  # 6 global epochs of 4 local steps


def batches():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 3, generator=g)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 8, generator=g)
        yield x, (x @ w).argmax(1)


def run(mode: dict) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if mode.get("amp") else None
    skip = mode.get("skip_steps", ())  # fp32 reference: these batches are not used
    overflow = mode.get("overflow_step")  # AMP: this step's gradients are inf, so it is dropped
    with warnings.catch_warnings(record=True) as caught, CollaborativeOptimizer(
        opt, run_id=f"equiv_{uuid.uuid4().hex[:8]}", target_batch_size=TARGET, model=model,
        reuse_grad_buffers=mode.get("reuse", False), offload_optimizer=mode.get("offload", False),
        scaler=scaler, host_maddrs=["/ip4/127.0.0.1/tcp/0"], matchmaking_time=1.0, print_join_message=False,
    ) as copt:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches()):
            if i in skip:
                continue
            loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                scaled = scaler.scale(loss)
                if i == overflow:
                    scaled = scaled * float("inf")
                scaled.backward()
                if mode.get("unscale_first"):
                    scaler.unscale_(copt)
                scaler.step(copt)
                scaler.update()
            else:
                loss.backward()
                copt.step()
            copt.zero_grad()
        copt.flush()
        result = dict(
            params={k: v.detach().clone() for k, v in model.state_dict().items()},
            epoch=copt.local_epoch,
            samples_reported=copt.samples_reported,
            samples_skipped=copt.samples_skipped,
            zero_grad_warnings=sum("zero_grad() does nothing" in str(w.message) for w in caught),
        )
    return result


MODES = {
    "fp32": {},
    "fp32_reuse": dict(reuse=True),
    "fp32_offload": dict(offload=True),
    "amp": dict(amp=True),
    "amp_reuse": dict(amp=True, reuse=True),
    "amp_reuse_unscale_first": dict(amp=True, reuse=True, unscale_first=True),
    "amp_offload": dict(amp=True, offload=True),
    "fp32_skip5": dict(skip_steps=(5,)),
    "fp32_skip4_5": dict(skip_steps=(4, 5)),
    "amp_overflow5": dict(amp=True, overflow_step=5),
    "amp_reuse_overflow5": dict(amp=True, reuse=True, overflow_step=5),
}


if __name__ == "__main__":
    names = sys.argv[2:] or list(MODES)
    torch.save({name: run(MODES[name]) for name in names}, sys.argv[1])
