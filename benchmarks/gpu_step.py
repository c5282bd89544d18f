"""GPU local-step cost (issue 34, part 2): forward + backward + step of a ~110M-parameter GPT-like model
(:mod:`benchmarks.gpu_models`) under autocast, collabopt and raw hivemind against plain torch, B2's method.

Every variant trains its own copy of the same model on the same batches with the same global update cadence (the
plain loop steps its optimizer every ``steps_per_epoch`` local steps, when a lone peer's epoch ends), in a process
of its own. The variants run interleaved in rounds of exactly one epoch (the idle ones SIGSTOPped, their swarm's
processes too), and each round's time is divided by the plain loop's of the same round and dtype. Times are CUDA
events around the round's steps (the CPU's wall clock after a synchronize on the CPU smoke version).

fp16 variants use ``torch.amp.GradScaler`` (plain torch: one ``scaler.step`` per epoch, as a user accumulating
gradients does; collabopt and raw hivemind: ``scaler.step(opt)`` every step, which unscales each step's gradients
before they are accumulated: hivemind's own ``hivemind.GradScaler`` is meant for ``reuse_grad_buffers=True`` only,
its docstring says). bf16 variants use no scaler.
Run alone: ``python -m benchmarks.gpu_step config.json [VARIANT]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, ask_paused, child_env, median, num_params, spread, stop_paused, write_json
from benchmarks.gpu_models import GPT_100M, GPT_TINY, lm_batches, lm_loss, make_gpt

IMPLS = {"plain torch": ("torch", {}), "collabopt": ("collabopt", {}),
         "collabopt reuse": ("collabopt", {"reuse_grad_buffers": True}), "hivemind": ("hivemind", {})}
GPU = dict(model=GPT_100M, steps_per_epoch=16, rounds=12, dtypes=["fp16", "bf16"], seconds=150)
SMOKE = dict(model=GPT_TINY, steps_per_epoch=4, rounds=2, dtypes=["fp16"], seconds=60)


class Variant:
    """One loop: ``impl`` (torch / collabopt / hivemind) with ``dtype`` autocast on ``device``."""

    def __init__(self, name: str, cfg: dict[str, Any]):
        impl_name, dtype_name = name.rsplit(" ", 1)
        self.impl, options = IMPLS[impl_name]
        self.device = "cuda" if cfg["cuda"] else "cpu"
        self.dtype = torch.float16 if dtype_name == "fp16" and cfg["cuda"] else torch.bfloat16
        self.k = cfg["steps_per_epoch"]
        self.model = make_gpt(cfg["model"], self.device)
        self.batches = lm_batches(cfg["model"], self.k, self.device)
        self.local_steps = 0
        opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.scaler: Any = None
        if dtype_name == "fp16":
            self.scaler = torch.amp.GradScaler(self.device)
        batch = cfg["model"]["batch"]
        common = dict(run_id=f"gpu_b2_{uuid.uuid4().hex[:8]}", target_batch_size=batch * self.k,
                      matchmaking_time=1.0, averaging_timeout=30.0)
        if self.impl == "torch":
            self.opt = opt
        elif self.impl == "collabopt":
            from collabopt import CollaborativeOptimizer

            self.opt = CollaborativeOptimizer(opt, batch_size=batch, scaler=self.scaler, print_join_message=False,
                                              handle_signals=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **common,
                                              **options)
        else:
            import hivemind

            self.dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            self.opt = hivemind.Optimizer(dht=self.dht, optimizer=opt, batch_size_per_step=batch, **common, **options)

    def train(self) -> tuple[float, float]:
        """One epoch of local steps; (milliseconds by CUDA events or the CPU clock, wall seconds)."""
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = time.perf_counter()
        for x, y in self.batches:
            with torch.autocast(self.device, dtype=self.dtype):
                loss = lm_loss(self.model, x, y)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            self.local_steps += 1
            if self.impl == "torch" and self.local_steps % self.k != 0:
                continue  # the plain loop accumulates until the epoch's end
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
            if not (self.impl == "hivemind" and self.opt.grad_averager.reuse_grad_buffers):
                self.opt.zero_grad()
        if cuda:
            end_event.record()
            torch.cuda.synchronize()
            return start_event.elapsed_time(end_event), time.perf_counter() - start
        wall = time.perf_counter() - start
        return 1000 * wall, wall

    def epoch(self) -> int:
        return self.local_steps // self.k if self.impl == "torch" else self.opt.local_epoch

    def close(self) -> None:
        if self.impl == "collabopt":
            self.opt.close()
        elif self.impl == "hivemind":
            self.opt.shutdown()
            self.dht.shutdown()


def worker(cfg: dict[str, Any], name: str) -> None:
    """One variant in a process of its own: a warm-up epoch, then a round per ``round`` line on stdin, each answered
    with a JSON line; ``close`` answers with the variant's totals."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    variant = Variant(name, cfg)
    try:
        variant.train()
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() != "round":
                break
            ms, wall = variant.train()
            print(json.dumps({"ms": ms, "wall": wall}), flush=True)
        peak = torch.cuda.max_memory_allocated() if variant.device == "cuda" else None
        print(json.dumps({"params": num_params(variant.model), "local_steps": variant.local_steps,
                          "epochs": variant.epoch(), "cuda_peak_bytes": peak}), flush=True)
    finally:
        variant.close()


def run(workdir: Path, smoke: bool) -> dict[str, Any]:
    """Start every variant, run the interleaved rounds, return the rows (ratios against plain torch per dtype)."""
    settings = dict(SMOKE if smoke else GPU, cuda=not smoke)
    names = [f"{impl} {dtype}" for dtype in settings["dtypes"] for impl in IMPLS]
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "config.json"
    write_json(config, settings)
    procs: dict[str, subprocess.Popen] = {}
    times: dict[str, list[float]] = {name: [] for name in names}
    errors: dict[str, str] = {}

    def ask(name: str, command: str | None = None, timeout: float = 120.0) -> dict[str, Any]:
        return ask_paused(procs[name], command, f"log: {workdir / name}.log", timeout)

    totals: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 - the child holds it
            procs[name] = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_step", str(config), name],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                           env=child_env(), cwd=ROOT, start_new_session=True)
            log.close()
        for name in names:
            try:
                ask(name)
                os.killpg(procs[name].pid, signal.SIGSTOP)
            except (RuntimeError, ValueError) as error:
                errors[name] = f"{error}: {(workdir / f'{name}.log').read_text(errors='replace')[-1500:]}"
        live = [name for name in names if name not in errors]
        deadline = time.monotonic() + settings["seconds"]
        for r in range(settings["rounds"]):
            if time.monotonic() > deadline:  # the whole check must end in time: fewer rounds, said in the report
                break
            for name in list(live[r % len(live):] + live[: r % len(live)]):
                try:
                    times[name].append(ask(name, "round")["ms"])
                except (RuntimeError, ValueError) as error:
                    errors[name] = str(error)
                    live.remove(name)
        totals = {name: ask(name, "close") for name in live}
    finally:
        stop_paused(list(procs.values()))
    rows = []
    for name in names:
        dtype = name.rsplit(" ", 1)[1]
        if name in errors:
            rows.append(dict(variant=name, error=errors[name]))
            continue
        base = times.get(f"plain torch {dtype}", [])
        ratios = [t / b for t, b in zip(times[name], base, strict=False)]  # rounds of both (one may have failed)
        rows.append(dict(variant=name, ratio=median(ratios), ratio_range=spread(ratios), ratios=ratios,
                         ms_per_step=median(times[name]) / settings["steps_per_epoch"], **totals[name]))
    return dict(settings={k: v for k, v in settings.items()}, rows=rows,
                timer="CUDA events" if not smoke else "CPU clock (smoke)")


def table(result: dict[str, Any]) -> list[str]:
    if result.get("skipped"):
        return ["(not run)"]
    s = result["settings"]
    params = next((r["params"] for r in result["rows"] if "params" in r), 0)
    rounds = max((len(r.get("ratios", [])) for r in result["rows"]), default=0)
    model = s["model"]
    lines = [f"{params / 1e6:.1f}M-parameter GPT-like model (batch {model['batch']} x {model['seq']} tokens), "
             f"Adam, {s['steps_per_epoch']} local steps per epoch, {rounds} interleaved rounds, one process per "
             f"variant; timer: {result['timer']}. Goal: collabopt <= 1.01x plain torch, and ahead of raw hivemind.", "",
             "| variant | time / plain torch (median) | range over rounds | ms per step | epochs | peak GPU memory |",
             "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | failed: {row['error'][:200]} | | | | |")
            continue
        peak = f"{row['cuda_peak_bytes'] / 2**30:.2f} GiB" if row.get("cuda_peak_bytes") else "—"
        lines.append(f"| {row['variant']} | {row['ratio']:.3f} | {row['ratio_range']} | {row['ms_per_step']:.2f} | "
                     f"{row['epochs']} | {peak} |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) > 2:
        worker(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # skip hivemind's noisy interpreter-exit finalizers; everything was shut down above
