"""B2 analysis: where a local (non-boundary) step's time goes, for plain torch, raw ``hivemind.Optimizer`` and
collabopt (guard on and off), in one process with one DHT (a lone peer: its epochs end only every
``steps_per_epoch`` steps, and the profiled steps stop before that).

Two views:

- **parts**: each piece of per-step work timed on its own, many times, interleaved (median µs): the forward +
  backward, hivemind's ``accumulate_grads_`` (copying ``param.grad`` into its accumulators),
  ``tracker.report_local_progress``, ``state_averager.step(apply_delayed_updates=True)`` (the check for finished
  background work), ``tracker.ready_to_update_epoch``, ``_should_load_state_from_peers``, the two pre-scheduling
  checks, collabopt's guard (``all_finite`` over the gradients), its sample counting and its zero_grad;
- **calls**: the whole ``step()`` (+ ``zero_grad()``) call per variant, timed without a profiler, and a cProfile of
  those calls (the functions with the largest total time, µs per step).

Run (it starts a DHT: under the swarm lock): ``python -m benchmarks.step_profile config.json`` with keys params,
width, in_dim, batch, steps, out; it writes ``out`` (JSON). Not part of ``benchmarks.run``: an analysis tool.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import make_mlp, median, num_params, write_json


def _time(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    import hivemind

    from collabopt import CollaborativeOptimizer
    from collabopt.guard import all_finite

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    batch, steps = cfg["batch"], cfg["steps"]
    target = batch * 100_000  # no epoch ends while profiling
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, cfg["in_dim"], generator=g), torch.randint(0, 16, (batch,), generator=g)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return make_mlp(cfg["params"], width=cfg["width"], in_dim=cfg["in_dim"])

    common = dict(target_batch_size=target, matchmaking_time=5.0, averaging_timeout=30.0)
    m_torch, m_hm, m_co, m_co_ng = model(), model(), model(), model()
    opt_torch = torch.optim.Adam(m_torch.parameters(), lr=1e-4)
    hm = hivemind.Optimizer(dht=dht, run_id=f"prof_{uuid.uuid4().hex[:8]}", batch_size_per_step=batch,
                            optimizer=torch.optim.Adam(m_hm.parameters(), lr=1e-4), **common)
    co = CollaborativeOptimizer(torch.optim.Adam(m_co.parameters(), lr=1e-4), run_id=f"prof_{uuid.uuid4().hex[:8]}",
                                model=m_co, dht=dht, print_join_message=False, handle_signals=False, **common)
    co_ng = CollaborativeOptimizer(torch.optim.Adam(m_co_ng.parameters(), lr=1e-4),
                                   run_id=f"prof_{uuid.uuid4().hex[:8]}", model=m_co_ng, dht=dht,
                                   print_join_message=False, handle_signals=False, nonfinite_guard=False, **common)

    def backward(m: torch.nn.Module) -> None:
        F.cross_entropy(m(x), y).backward()

    calls: dict[str, Callable[[], Any]] = {
        "plain torch (no step)": lambda: None,
        "hivemind": lambda: (hm.step(), hm.zero_grad()),
        "collabopt": lambda: (co.step(), co.zero_grad()),
        "collabopt no guard": lambda: (co_ng.step(), co_ng.zero_grad()),
    }
    models = {"plain torch (no step)": m_torch, "hivemind": m_hm, "collabopt": m_co, "collabopt no guard": m_co_ng}
    for name in calls:  # warm-up: buffers, first progress report
        for _ in range(3):
            backward(models[name])
            calls[name]()
            if name.startswith("plain"):
                opt_torch.zero_grad()

    # ---- whole step() calls, interleaved, no profiler
    call_times: dict[str, list[float]] = {name: [] for name in calls}
    fwd_bwd: list[float] = []
    for _ in range(steps):
        for name, call in calls.items():
            m = models[name]
            start = time.perf_counter()
            backward(m)
            mid = time.perf_counter()
            call()
            call_times[name].append(time.perf_counter() - mid)
            if name.startswith("plain"):
                fwd_bwd.append(mid - start)
                opt_torch.zero_grad()
    step_us = {name: 1e6 * median(t) for name, t in call_times.items()}

    # ---- parts, each on its own (gradients present, as inside a step)
    backward(m_hm)
    tracker, ga, sa = hm.tracker, hm.grad_averager, hm.state_averager
    params = list(m_co.parameters())
    backward(m_co)
    repeat = max(20, steps)
    parts = {
        f"forward + backward (batch {batch})": lambda: (backward(m_torch), opt_torch.zero_grad()),
        "hivemind: accumulate_grads_ (copy param.grad into accumulators)": lambda: ga.accumulate_grads_(batch),
        "hivemind: tracker.report_local_progress": lambda: tracker.report_local_progress(
            hm.local_epoch, ga.local_samples_accumulated),
        "hivemind: state_averager.step(apply_delayed_updates=True)": lambda: sa.step(apply_delayed_updates=True),
        "hivemind: tracker.ready_to_update_epoch": lambda: tracker.ready_to_update_epoch,
        "hivemind: _should_load_state_from_peers": hm._should_load_state_from_peers,
        "hivemind: _maybe_schedule_gradient_averaging": hm._maybe_schedule_gradient_averaging,
        "hivemind: _maybe_schedule_state_averaging": hm._maybe_schedule_state_averaging,
        "collabopt: guard all_finite(grads)": lambda: all_finite([p.grad for p in params]),
    }
    part_us = {}
    for name, fn in parts.items():
        part_us[name] = 1e6 * _time(fn, repeat)
    ga.reset_accumulated_grads_()
    tracker.report_local_progress(hm.local_epoch, 0)

    # ---- cProfile of the step() calls
    profiles = {}
    for name in ("hivemind", "collabopt"):
        profiler = cProfile.Profile()
        m = models[name]
        for _ in range(steps):
            backward(m)
            profiler.enable()
            calls[name]()
            profiler.disable()
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        rows = []
        for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():
            rows.append(dict(function=f"{Path(file).name}:{line}({func})", calls_per_step=nc / steps,
                             tottime_us=1e6 * tt / steps, cumtime_us=1e6 * ct / steps))
        rows.sort(key=lambda r: -r["cumtime_us"])
        profiles[name] = rows[:40]

    for opt in (hm,):
        opt.shutdown()
    co.close()
    co_ng.close()
    dht.shutdown()
    write_json(cfg["out"], dict(params=num_params(m_torch), batch=batch, steps=steps,
                                fwd_bwd_us=1e6 * median(fwd_bwd), step_call_us=step_us, parts_us=part_us,
                                profiles=profiles))


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)
