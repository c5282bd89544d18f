"""B2 local step cost: forward + backward + step of collabopt (and raw hivemind) against a plain torch loop.

Every variant trains its own copy of the same MLP with the same batches and the same global update cadence
(the plain loop calls ``optimizer.step()`` every ``steps_per_epoch`` local steps, which is when a lone peer's
hivemind epoch ends). Variants run interleaved in rounds (A/B/C/.../A/B/C/...) of exactly one epoch each, and each
round's time is divided by the plain loop's time of the same round, so machine noise that lasts longer than a round
cancels. (Rounds shorter than an epoch would leave a peer idle mid-epoch; hivemind's progress tracker then thinks
the epoch is overdue and steps early, so the cadence would differ.) The number of epochs each variant ran is
reported as a check. Each variant runs in a process of its own, as a user's script does: collabopt sets glibc's
malloc thresholds for its process (collabopt/host_memory.py), which would change the plain loop's allocations too.

For the collabopt variants the time spent inside the non-finite guard's checks is measured too (its share of the
variant's time: a figure that the round-to-round noise of the ratios does not blur).

Run alone: ``python -m benchmarks.local_step config.json`` (the runner writes the config; it starts
``python -m benchmarks.local_step config.json VARIANT`` for each variant).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import ask_paused, make_mlp, median, num_params, spread, stop_paused, write_json

VARIANTS = {
    # name: (implementation, options)
    "plain torch": ("torch", {}),
    "hivemind": ("hivemind", {}),
    "hivemind reuse": ("hivemind", {"reuse_grad_buffers": True}),
    "collabopt": ("collabopt", {}),
    "collabopt no guard": ("collabopt", {"nonfinite_guard": False}),
    "collabopt reuse": ("collabopt", {"reuse_grad_buffers": True}),
    "collabopt offload": ("collabopt", {"offload_optimizer": True}),
    "collabopt reuse+offload": ("collabopt", {"reuse_grad_buffers": True, "offload_optimizer": True}),
    "collabopt, glibc's malloc defaults": ("collabopt", {}),
    "plain torch, collabopt's malloc thresholds": ("torch", {}),
}


def variant_env(name: str, gradient_bytes: int) -> dict[str, str]:
    """Environment of a variant's process beyond the harness's."""
    if name == "collabopt, glibc's malloc defaults":
        # collabopt leaves malloc alone where the user tuned it (collabopt/host_memory.py). A malloc tunable set to
        # its default value: glibc's dynamic thresholds stay on (setting a threshold would switch them off), so
        # this is the default mode as it ran before collabopt set them
        return {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}
    if name == "plain torch, collabopt's malloc thresholds":  # what collabopt would set for this model
        from collabopt.host_memory import HEADROOM, MMAP_THRESHOLD

        return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                "MALLOC_TRIM_THRESHOLD_": str(2 * gradient_bytes + HEADROOM)}
    return {}


GUARD_SECONDS: dict[int, float] = {}  # id(guard) -> seconds spent in its checks


def time_the_guard() -> None:
    """Make every ``NonFiniteGuard`` check add its duration to :data:`GUARD_SECONDS`."""
    from collabopt.guard import NonFiniteGuard

    def timed(method: Any) -> Any:
        def check(self: Any, *args: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                GUARD_SECONDS[id(self)] = GUARD_SECONDS.get(id(self), 0.0) + time.perf_counter() - start
        return check

    for name in ("gradients_finite", "accumulation_finite"):
        setattr(NonFiniteGuard, name, timed(getattr(NonFiniteGuard, name)))


class Variant:
    """One training loop: a model copy, its optimizer and a ``train(batches)`` that runs local steps."""

    def __init__(self, name: str, cfg: dict[str, Any], dht: Any):
        self.name = name
        impl, options = VARIANTS[name]
        self.impl = impl
        torch.manual_seed(0)
        self.model = make_mlp(cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"])
        self.batch = cfg["batch"]
        self.k = cfg["steps_per_epoch"]
        self.local_steps = 0
        self.epochs = 0
        lr = 1e-4
        run_id = f"bench_b2_{uuid.uuid4().hex[:8]}"
        target = self.batch * self.k
        common = dict(matchmaking_time=cfg["matchmaking_time"], averaging_timeout=30.0)
        if impl == "torch":
            self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        elif impl == "collabopt":
            from collabopt import CollaborativeOptimizer

            self.opt = CollaborativeOptimizer(
                torch.optim.Adam(self.model.parameters(), lr=lr), run_id=run_id, target_batch_size=target,
                model=self.model, dht=dht, print_join_message=False, handle_signals=False, **common, **options,
            )
        else:
            import hivemind

            offload = options.get("offload_optimizer", False)
            self.opt = hivemind.Optimizer(
                dht=dht, run_id=run_id, target_batch_size=target, batch_size_per_step=self.batch,
                optimizer=(lambda params: torch.optim.Adam(params, lr=lr)) if offload
                else torch.optim.Adam(self.model.parameters(), lr=lr),
                params=self.model.parameters() if offload else None, **common, **options,
            )

    def epoch(self) -> int:
        return self.epochs if self.impl == "torch" else self.opt.local_epoch

    def guard_seconds(self) -> float:
        guard = getattr(self.opt, "_guard", None) if self.impl == "collabopt" else None
        return GUARD_SECONDS.get(id(guard), 0.0) if guard is not None else 0.0

    def train(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Run one local step per batch; return (wall seconds, CPU seconds of this thread)."""
        model, opt = self.model, self.opt
        start, start_cpu = time.perf_counter(), time.thread_time()
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            self.local_steps += 1
            if self.impl == "torch":
                if self.local_steps % self.k == 0:
                    opt.step()
                    opt.zero_grad()
                    self.epochs += 1
            elif self.impl == "collabopt":
                opt.step()
                opt.zero_grad()
            else:
                opt.step()
                if not opt.grad_averager.reuse_grad_buffers:
                    opt.zero_grad()
        return time.perf_counter() - start, time.thread_time() - start_cpu

    def close(self) -> None:
        if self.impl == "collabopt":
            self.opt.close()
        elif self.impl == "hivemind":
            self.opt.shutdown()


def worker(cfg: dict[str, Any], name: str) -> None:
    """One variant in a process of its own: build it, then run a round per ``round`` line read from stdin and
    answer each with a JSON line; ``close`` answers with the variant's totals."""
    import hivemind

    torch.set_num_threads(cfg.get("threads", 1))
    warnings.filterwarnings("ignore")
    time_the_guard()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) if VARIANTS[name][0] != "torch" else None
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(cfg["batch"], cfg["in_dim"], generator=g), torch.randint(0, 16, (cfg["batch"],), generator=g))
        for _ in range(cfg["steps_per_epoch"])
    ]
    variant = Variant(name, cfg, dht)
    try:
        variant.train(batches)  # warm-up: the first epoch creates optimizer state, buffers, JIT paths
        guard_before = variant.guard_seconds()
        print(json.dumps(dict(ready=True)), flush=True)
        for line in sys.stdin:
            if line.strip() != "round":
                break
            wall, thread_cpu = variant.train(batches)
            print(json.dumps(dict(wall=wall, cpu=thread_cpu)), flush=True)
        print(json.dumps(dict(params=num_params(variant.model), local_steps=variant.local_steps,
                              epochs=variant.epoch(), guard_seconds=variant.guard_seconds() - guard_before)),
              flush=True)
    finally:
        variant.close()
        if dht is not None:
            dht.shutdown()


def main(config_path: str) -> None:
    """Start every variant in a process of its own, then run their rounds one at a time, interleaved.

    Separate processes: a variant's allocations do not change another's (collabopt sets glibc's malloc thresholds
    for its process: collabopt/host_memory.py), and the plain loop runs as a user's own script does. A variant's
    processes are stopped while the others run.
    """
    import subprocess

    cfg = json.loads(Path(config_path).read_text())
    names = cfg.get("variants", list(VARIANTS))
    gradient_bytes = 4 * num_params(make_mlp(cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"]))
    procs = {name: subprocess.Popen([sys.executable, "-m", "benchmarks.local_step", config_path, name],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env=dict(os.environ, **variant_env(name, gradient_bytes)),
                                    start_new_session=True)
             for name in names}

    def ask(name: str, command: str | None = None) -> dict[str, Any]:
        return ask_paused(procs[name], command, f"B2 variant {name!r}: its output is in this log")

    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name in names:
            ask(name)  # ready
            os.killpg(procs[name].pid, signal.SIGSTOP)
        for r in range(cfg["rounds"]):
            order = names[r % len(names):] + names[: r % len(names)]  # rotate so no variant is always first
            for name in order:
                answer = ask(name, "round")
                times[name].append(answer["wall"])
                cpu[name].append(answer["cpu"])
        totals = {name: ask(name, "close") for name in names}
    finally:
        stop_paused(list(procs.values()))
    base, base_cpu = times["plain torch"], cpu["plain torch"]
    rows = []
    for name in names:
        ratios = [t / b for t, b in zip(times[name], base, strict=True)]
        cpu_ratios = [t / b for t, b in zip(cpu[name], base_cpu, strict=True)]
        total = totals[name]
        rows.append(dict(
            variant=name, ratio=median(ratios), ratio_range=spread(ratios), cpu_ratio=median(cpu_ratios),
            ms_per_step=1000 * median(times[name]) / cfg["steps_per_epoch"], local_steps=total["local_steps"],
            epochs=total["epochs"],
            guard_share=total["guard_seconds"] / sum(times[name]) if VARIANTS[name][0] == "collabopt" else None,
        ))
    write_json(cfg["out"], dict(
        params=totals[names[0]]["params"], batch=cfg["batch"], steps_per_epoch=cfg["steps_per_epoch"],
        steps_per_round=cfg["steps_per_epoch"], rounds=cfg["rounds"], rows=rows, processes="one per variant",
    ))


if __name__ == "__main__":
    if len(sys.argv) > 2:
        worker(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
    else:
        main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip hivemind's noisy interpreter-exit finalizers; everything was shut down above
