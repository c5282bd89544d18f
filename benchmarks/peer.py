"""One benchmark peer, run as its own OS process (on loopback, or inside a network namespace for B3).

Trains as a peer of a swarm with collabopt or with raw ``hivemind.Optimizer`` and records, per local step, when the
(real or simulated) compute ran and how long ``step()`` took, plus when each gradient all-reduce was triggered and
when it finished (wall-clock, comparable across processes of one machine).

Usage: ``python -m benchmarks.peer config.json``; writes ``config['out']`` (JSON).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import make_mlp, write_json
from benchmarks.swarmrun import save_snapshot


def compression_options(name: str | None, rank: int = 32) -> dict[str, Any]:
    """hivemind.Optimizer arguments for a named gradient compression."""
    import hivemind
    from hivemind.compression import Float16Compression, SizeAdaptiveCompression, Uniform8BitQuantization

    if not name:
        return {}
    if name == "fp16":
        return {"grad_compression": Float16Compression()}
    if name == "8bit":
        return {"grad_compression": SizeAdaptiveCompression(
            threshold=2**16, less=Float16Compression(), greater_equal=Uniform8BitQuantization())}
    if name == "powersgd":
        from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

        return {"grad_averager_factory": partial(PowerSGDGradientAverager, averager_rank=rank)}
    raise ValueError(f"unknown compression {name!r}; use fp16, 8bit or powersgd (hivemind {hivemind.__version__})")


def diloco_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """CollaborativeOptimizer arguments of DiLoCo mode (B6) from a peer's config: ``outer`` is the outer SGD's
    arguments, or ``"sparseloco"`` for SparseLoCo's own outer step; ``sparse`` (a dict of SparseLoCo's arguments,
    ``{}`` for its defaults) sends compressed pseudo-gradients. Empty without ``outer``: the synchronous mode."""
    from collabopt.diloco_options import SparseLoCo

    if not cfg.get("outer"):
        return {}
    outer = cfg["outer"]
    options = dict(outer_optimizer=SparseLoCo.outer_optimizer() if outer == "sparseloco"
                   else partial(torch.optim.SGD, **outer))
    if cfg.get("sparse") is not None:
        options["pseudo_gradient_compression"] = SparseLoCo(**cfg["sparse"])
    return options


def instrument_averaging(grad_averager: Any, events: list[dict[str, Any]]) -> None:
    """Record trigger and completion wall times of every gradient all-reduce this peer runs (the gradient averager's
    ``step``: hivemind's returns a ``StepControl``; collabopt's a ``GradientRound`` whose scheduled round reports its
    end, or with ``wait`` the round's result once it ended). DiLoCo's pseudo-gradient rounds have no ``step``: nothing
    is recorded for them."""
    original = getattr(grad_averager, "step", None)
    if original is None:
        return

    def watch(scheduled: Any, event: dict[str, Any]) -> None:  # collabopt's round: its end, in the service's thread
        def ended() -> None:
            event["done"] = time.time()
            result = scheduled.result(0)
            event["ok"] = result.tensors is not None and result.error is None
        scheduled.on_done(ended)

    def step(*args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("control")
        event = {"trigger": time.time(), "prescheduled": given is not None}
        if hasattr(given, "scheduled"):
            watch(given.scheduled, event)
        try:
            control = original(*args, **kwargs)
        except Exception:
            event.setdefault("done", time.time())
            event["ok"] = False
            events.append(event)
            raise
        if hasattr(control, "add_done_callback"):  # hivemind's StepControl
            def done(future: Any) -> None:
                event["done"] = time.time()
                event["ok"] = not future.cancelled() and future.exception() is None
            control.add_done_callback(done)
        elif hasattr(control, "scheduled") and given is None:  # collabopt's round, wait=False
            watch(control.scheduled, event)
        elif given is None:  # collabopt's round with wait: it ended before step() returned
            event["done"], event["ok"] = time.time(), True
        events.append(event)
        return control

    grad_averager.step = step


def instrument_exchange(grad_averager: Any, rounds: list[dict[str, Any]]) -> None:
    """Compressed DiLoCo (``SparsePseudoGradientRounds``): record per round the length of this peer's payload, the
    bytes its exchange sent and received (message bodies) and, where the round was applied, the share of the
    aggregate's entries that are not zero (the union of the members' kept entries). Nothing without compression."""
    feedback = getattr(grad_averager, "error_feedback", None)
    if feedback is None:
        return
    compress, report = feedback.compress, grad_averager.report
    lengths: list[int] = []

    def compressed(*args: Any, **kwargs: Any) -> bytes:
        payload = compress(*args, **kwargs)
        lengths.append(len(payload))
        return payload

    def reported(result: Any) -> Any:
        evidence = report(result)
        union = None
        if result.applied_set is not None and not evidence.error:
            with grad_averager.get_tensors() as buffers:
                union = sum(int(b.count_nonzero()) for b in buffers) / sum(b.numel() for b in buffers)
        rounds.append(dict(time=time.time(), payload=lengths.pop() if lengths else None, sent=result.sent_bytes,
                           received=result.received_bytes, group=len(result.group), union=union,
                           error=result.error, contributed=getattr(result, "contributed", True)))
        return evidence

    feedback.compress, grad_averager.report = compressed, reported


STATUS_PREFIXES = (
    # hivemind's status lines (logged at INFO with verbose=True) that mark a peer's way through an epoch boundary
    "Pre-scheduling gradient", "Pre-scheduling state", "Beginning optimizer step", "Averaged gradients",
    "Averaging gradients failed", "Skipped averaging", "Proceeding with local gradients", "Tagging along",
    "Averaged parameters", "Finished averaging round", "Received parameters", "Transitioning to epoch",
    "Peer is out of sync", "Not using pre-scheduled",
    # collabopt's loop (collabopt/engine/sync_round.py)
    "collabopt: gradient round scheduled", "collabopt: epoch", "collabopt: gradients averaged",
    "collabopt: the gradient round failed", "collabopt: no gradient round", "collabopt: now at epoch",
)


class StatusRecorder(logging.Handler):
    """Keeps (wall time, message) of the loop's status lines (see :data:`STATUS_PREFIXES`) and of its progress
    tracker's fetches ("... accumulated N samples for epoch #E from P peers. ETA ...")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(STATUS_PREFIXES) or " samples for epoch #" in message:
            self.events.append((record.created, message[:200]))


def record_status() -> StatusRecorder:
    """Capture the INFO status lines of hivemind's optimizer or collabopt's loop in this process (the peer must be
    built with verbose=True)."""
    recorder = StatusRecorder()
    for name in ("hivemind", "collabopt.engine"):
        status_logger = logging.getLogger(name)
        status_logger.setLevel(logging.INFO)
        status_logger.addHandler(recorder)
    return recorder


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its children (hivemind's averagers, the DHT's daemons)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:  # a child that just ended
            pass
    return total


def bytes_sent() -> int:
    """Bytes sent on every interface of this process's network namespace but loopback (B6 runs each peer in its own
    namespace: that is all the peer sends, DHT included)."""
    import psutil

    return sum(c.bytes_sent for nic, c in psutil.net_io_counters(pernic=True).items() if nic != "lo")


def mark_dht(cfg: dict[str, Any], dht: list[dict[str, Any]], dht_calls: list[dict[str, int]]) -> None:
    """With ``dht_traffic``: append :mod:`benchmarks.dht_traffic`'s counts and this process's DHT calls."""
    if cfg.get("dht_traffic"):
        from benchmarks import dht_traffic

        dht.append(dht_traffic.snapshot())
        dht_calls.append(dht_traffic.calls())


def apply_experiments(hm: Any, names: list[str]) -> None:
    """Changes to hivemind's behaviour tried out by B5 before they are proposed for the core (by name).

    - ``prescheduled_state``: hivemind 1.1.12 pre-schedules the parameter-averaging round only once it has timed one
      pre-scheduled round (``delay_before_state_averaging.num_updates > 0``), and it times only pre-scheduled
      rounds, so it never does: every foreground state round starts its matchmaking at the boundary. A first
      estimate of 0 s lets the first round be pre-scheduled; hivemind then times the rounds itself.
    """
    for name in names:
        if name == "prescheduled_state":
            if not hasattr(hm, "delay_before_state_averaging"):
                raise ValueError("prescheduled_state applies to raw hivemind.Optimizer peers (impl=hivemind) only")
            hm.delay_before_state_averaging.update(task_size=1, interval=0.0)
        else:
            raise ValueError(f"unknown experiment {name!r}")


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_mlp(cfg["params"], width=cfg.get("width", 1024), in_dim=cfg.get("in_dim", 256))
    batch = cfg["batch"]
    real = cfg.get("compute", "real") == "real"
    compute_seconds = cfg.get("compute_seconds", 0.0)
    g = torch.Generator().manual_seed(cfg.get("seed", 0))
    x = torch.randn(batch, cfg.get("in_dim", 256), generator=g)
    y = torch.randint(0, 16, (batch,), generator=g)
    write_grads = cfg.get("write_grads", False)
    fake_grads = None if real else [torch.randn(p.shape, generator=g) * 1e-3 for p in model.parameters()]
    options = dict(cfg.get("options", {}))
    options.update(compression_options(cfg.get("compression"), cfg.get("powersgd_rank", 32)))
    status = None
    if cfg.get("record_status"):
        import hivemind  # noqa: F401  (sets up hivemind's loggers first)

        status = record_status()
        options["verbose"] = True
    if cfg.get("dht_traffic"):  # DHT bytes by key (benchmarks.sparse_scale --breakdown); before the DHT starts
        from benchmarks import dht_traffic

        dht_traffic.install(cfg["run_id"])
        dht_traffic.count_calls(cfg["run_id"])
    host = cfg.get("host", "127.0.0.1")
    impl = cfg["impl"]
    common = dict(run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"],
                  matchmaking_time=cfg.get("matchmaking_time", 3.0),
                  averaging_timeout=cfg.get("averaging_timeout", 30.0),
                  average_state_every=cfg.get("average_state_every", 1), **options)
    needs_factory = any(options.get(k) for k in ("offload_optimizer", "delay_optimizer_step", "delay_grad_averaging"))
    inner_seconds = [0.0]  # DiLoCo mode: time in the inner optimizer's steps (local training work)
    if impl == "collabopt":
        from collabopt import CollaborativeOptimizer

        inner = torch.optim.SGD(model.parameters(), lr=1e-3)
        if cfg.get("outer"):  # DiLoCo mode (B6)
            # the whole inner.step() call, as a plain loop calls it: torch's wrapper of every optimizer's step
            # (profiler record, hooks: 0.1-0.2 ms here after a sleep) is local training work too (step hooks, used
            # until 2026-11-26, left it out and so counted it as collabopt's overhead)
            torch_step = inner.step

            def timed_step(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return torch_step(*args, **kwargs)
                finally:
                    inner_seconds[0] += time.perf_counter() - start

            inner.step = timed_step
            common.update(diloco_options(cfg))
        opt = CollaborativeOptimizer(
            inner, model=model if real else None, batch_size=batch,
            initial_peers=cfg["initial_peers"], host_maddrs=[f"/ip4/{host}/tcp/0"], print_join_message=False,
            **common,
        )
        hm = opt.loop
    else:
        import hivemind

        dht = hivemind.DHT(start=True, initial_peers=cfg["initial_peers"].split(","),
                           host_maddrs=[f"/ip4/{host}/tcp/0"])
        opt = hm = hivemind.Optimizer(
            dht=dht, batch_size_per_step=batch,
            optimizer=(lambda params: torch.optim.SGD(params, lr=1e-3)) if needs_factory
            else torch.optim.SGD(model.parameters(), lr=1e-3),
            params=model.parameters() if needs_factory else None, **common,
        )
    apply_experiments(hm, cfg.get("experiments", []))
    ready_at = time.time()
    if cfg.get("ready_file"):  # start together: the runner creates go_file once every peer is ready
        Path(cfg["ready_file"]).touch()
        wait_until = time.monotonic() + cfg.get("join_timeout", 120)
        while not Path(cfg["go_file"]).exists() and time.monotonic() < wait_until:
            time.sleep(0.05)
    events: list[dict[str, Any]] = []
    exchanges: list[dict[str, Any]] = []  # compressed DiLoCo's rounds (instrument_exchange)
    if hm.grad_averager is not None:
        instrument_averaging(hm.grad_averager, events)
        instrument_exchange(hm.grad_averager, exchanges)
    rounds: list[dict[str, Any]] = []  # the outcomes of the rounds collabopt's steps ended (group sizes)
    # (compute start, compute seconds, step seconds, epoch, seconds of step() in the inner optimizer: DiLoCo)
    steps: list[tuple[float, float, float, int, float]] = []
    net_bytes: list[int] = []  # bytes sent on this namespace's interfaces at the window's start and end (B6)
    exchange_bytes: list[int] = []  # compressed DiLoCo: bytes its exchange sent (bodies), at the same times
    dht: list[dict[str, Any]] = []  # with dht_traffic: benchmarks.dht_traffic's counts and calls, at the same times
    dht_calls: list[dict[str, int]] = []
    epochs: list[tuple[float, int]] = []
    created = time.time()
    deadline = time.monotonic() + cfg.get("max_seconds", 300)
    warmup_epochs = cfg.get("warmup_epochs", 1)
    window: list[float] = []  # wall times [start, end] of the measured window
    window_epoch: list[int] = []  # the epoch it started at
    cpu: list[float] = []  # CPU seconds of this process tree at the window's start and end
    linger_until = None
    params = list(model.parameters())

    def record(**extra: Any) -> dict[str, Any]:
        return dict(impl=impl, launched=cfg.get("launched"), ready=ready_at, created=created, steps=steps,
                    epochs=epochs, averaging=events, window=window, cpu=cpu, net_bytes=net_bytes,
                    exchange_bytes=exchange_bytes, exchanges=exchanges, rounds=rounds, dht=dht, dht_calls=dht_calls,
                    status=status.events if status is not None else [],
                    num_peers=hm.tracker.global_progress.num_peers, final_epoch=hm.local_epoch,
                    grad_bytes=sum(p.numel() * p.element_size() for p in params), **extra)

    try:
        while time.monotonic() < deadline:
            if linger_until is not None and time.monotonic() >= linger_until:
                break
            start = time.time()
            if real:
                F.cross_entropy(model(x), y).backward()
            else:
                time.sleep(compute_seconds)
                for p, grad in zip(params, fake_grads, strict=True):
                    # write_grads (B6): a backward pass writes every gradient just before step(); handing over the
                    # same tensors left them cold in the cache after the sleep, and the first pass over them in
                    # step() paid that (measured on 5M parameters: 8 ms cold, 1 ms warm)
                    p.grad = grad.clone() if write_grads else grad
            compute = time.time() - start
            epoch_before = hm.local_epoch
            inner_before = inner_seconds[0]
            t0 = time.time()
            result = opt.step()
            if impl == "collabopt" or not options.get("reuse_grad_buffers"):
                opt.zero_grad()
            t1 = time.time()
            if linger_until is None:
                steps.append((start, compute, t1 - t0, hm.local_epoch, inner_seconds[0] - inner_before))
                outcome = getattr(result, "round", None)  # (collabopt's StepResult)
                if outcome is not None:
                    rounds.append(dict(time=t1, epoch=outcome.epoch, applied=outcome.applied, reason=outcome.reason,
                                       group_size=outcome.group_size, num_peers=outcome.num_peers))
            if hm.local_epoch != epoch_before:
                epochs.append((t1, hm.local_epoch))
                if cfg.get("snapshots") and linger_until is None:  # its parameters at each epoch, compared
                    save_snapshot(cfg["snapshots"], hm.local_epoch, params)
                if not window and hm.local_epoch >= warmup_epochs:
                    window.append(t1)
                    window_epoch.append(hm.local_epoch)
                    cpu.append(tree_cpu_seconds())
                    if cfg.get("count_bytes"):
                        net_bytes.append(bytes_sent())
                        exchange_bytes.append(getattr(hm.grad_averager, "bytes_sent", 0))
                        mark_dht(cfg, dht, dht_calls)
            if cfg.get("measure_epochs"):  # a whole number of epochs / rounds (B6): each costs the same share
                window_over = bool(window) and hm.local_epoch >= window_epoch[0] + cfg["measure_epochs"]
            else:
                window_over = bool(window) and t1 >= window[0] + cfg["measure_seconds"]
            if window_over and linger_until is None:
                window.append(t1)
                cpu.append(tree_cpu_seconds())
                if cfg.get("count_bytes"):
                    net_bytes.append(bytes_sent())
                    exchange_bytes.append(getattr(hm.grad_averager, "bytes_sent", 0))
                    mark_dht(cfg, dht, dht_calls)
                # results now; keep stepping a little so that peers whose window ends later are not left alone
                write_json(cfg["out"], record())
                linger_until = time.monotonic() + cfg.get("linger_seconds", 5.0)
        if linger_until is None:
            write_json(cfg["out"], record(error="ran out of time before the measured window ended"))
    finally:
        if impl == "collabopt":
            opt.close()
        else:
            opt.shutdown()
            dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip hivemind's noisy interpreter-exit finalizers; everything was shut down above
