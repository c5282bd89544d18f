"""One DiLoCo peer (``outer_optimizer=``), run as its own OS process by tests/swarm/test_diloco.py.

Usage: ``python diloco_worker.py config.json``. Writes ``<out>.json`` (per round: epoch, whether this peer applied
the round or downloaded, its weight, the round's group) and ``<out>.pt``: the parameters at the start, after every
epoch change (``after``), and after the last inner step before it (``before``: the parameters the round averaged).

Config (besides peer_worker.py's run_id, target_batch_size, epochs, batch_sizes, lr, seed, model_seed, wait_peers,
finish_with, max_seconds, step_sleep): ``outer`` (SGD keyword arguments), ``compression`` ("none" for exact
averaging), ``fail_round`` (this peer's averaging fails at that round: an injected network fault),
``cut_results_round`` and ``cut_marker`` (from this peer's that-many-th all-reduce on, its reducer ends one member's
results one part short, once per swarm: an injected fault, see :func:`cut_results`; a member that lost results saves
``partial``: its parameters when its pseudo-gradient was taken, by the round's epoch), ``stop_after`` (leave after
this many rounds, without waiting for anyone), ``collaborate`` (build it with
``collabopt.integrations.pytorch.collaborate``, the plain-loop adapter), ``overlap`` (``overlap_rounds=True``; then
``landed`` holds, per round applied, the anchor, the parameters after and before the step that applied it),
``sparse`` (``pseudo_gradient_compression=SparseLoCo(**sparse)``; the result then holds ``exchange_bytes``: the
bytes its exchanges sent and received), ``checkpoint_epoch`` (at that epoch, once a round was applied, save
``<out>.ckpt``: ``copt.state_dict()``, the model's parameters and the error-feedback buffer as it was; then leave),
``resume_from`` (a ``.ckpt`` to start from: parameters loaded before the optimizer is built, its state right after;
``<out>.pt`` then holds ``loaded_error_feedback``: the buffer after loading), ``kill_in_exchange`` (in its
that-many-th exchange this peer sends its offer to one member only, then SIGKILLs itself: see
:func:`kill_mid_exchange`), ``held_out`` (the last that-many samples of the data are never trained on; the result
then holds ``held_out_losses``: the loss on them after every epoch change, by epoch), ``attack`` (a hostile member,
benchmarks/sparse_hostile.py: ``scale``, ``noise`` and ``claim`` alter what it sends in every round, see
:func:`attack_rounds`; ``wrong_labels``: it trains on every label shifted by one).
"""

from __future__ import annotations

import functools
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from collabopt.integrations.pytorch import collaborate
from peer_worker import (
    at_finish_line,
    batch_size_sequence,
    exit_now,
    full_loss,
    make_data,
    make_model,
    target_epoch,
    write_json,
)

from collabopt import CollaborativeOptimizer


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    # why a member's all-reduce failed (hivemind says it at debug level only): in the log when a test fails
    logging.getLogger("collabopt.engine").setLevel(logging.DEBUG)
    logging.getLogger("hivemind.p2p.p2p_daemon").setLevel(logging.DEBUG)
    # and whose group it joined or gave up on (a follower that gave up on a leader whose group still counted it
    # leaves that group's round incomplete, while its own log shows no round): a few lines a round
    logging.getLogger("hivemind.averaging.matchmaking").setLevel(logging.DEBUG)
    out = cfg["out"]
    seed = cfg.get("seed", 0)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    x_all, y_all = make_data(cfg.get("data_seed", 0))
    model = make_model(cfg.get("model_seed", 0), hidden=cfg.get("hidden", 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 0.01))
    options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], verbose=True, matchmaking_time=2.0, averaging_timeout=30.0,
                   outer_optimizer=functools.partial(torch.optim.SGD, **cfg.get("outer", dict(
                       lr=0.7, momentum=0.9, nesterov=True))))
    if cfg.get("overlap"):
        options["overlap_rounds"] = True
    if cfg.get("aggregation"):
        options["aggregation"] = cfg["aggregation"]
    if cfg.get("sparse") is not None:
        from collabopt.diloco_options import SparseLoCo

        options["pseudo_gradient_compression"] = SparseLoCo(**cfg["sparse"])
    if cfg.get("compression") == "none":
        from hivemind.compression import NoCompression

        options["grad_compression"] = NoCompression()
    held_out = cfg.get("held_out", 0)
    deadline = time.monotonic() + cfg.get("max_seconds", 120)
    sizes = batch_size_sequence(cfg.get("batch_sizes", [16]), rng)
    result = {"rounds": [], "samples_fed": 0}
    params = {"after": {}, "before": {}, "landed": {}, "base": {}, "partial": {}}
    last_inner = {}
    optimizer.register_step_post_hook(lambda *_: last_inner.update(params=snapshot(model)))

    if cfg.get("kill_in_exchange") is not None:
        kill_mid_exchange(cfg["kill_in_exchange"])
    if cfg.get("cut_results_round") is not None:
        cut_results(cfg["cut_results_round"], cfg["cut_marker"])
    checkpoint = torch.load(cfg["resume_from"]) if cfg.get("resume_from") else None
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    if cfg.get("collaborate"):  # the plain-loop adapter
        copt = collaborate(model, optimizer, run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"],
                           **options)
    else:
        copt = CollaborativeOptimizer(optimizer, run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"],
                                      model=model, **options)
    with copt:
        record_partial_rounds(copt, model, params["partial"])
        if cfg.get("attack"):
            attack_rounds(copt, cfg["attack"])
        if checkpoint is not None:
            copt.load_state_dict(checkpoint["copt"])
            params["loaded_error_feedback"] = error_feedback_buffers(copt)
        if cfg.get("fail_round") is not None:
            inject_failure(copt, cfg["fail_round"])
        if cfg.get("wait_peers"):
            assert copt.wait_for_peers(cfg["wait_peers"], timeout=90), "the other peers did not come"
        params["start"] = snapshot(model)
        result["start_epoch"] = copt.local_epoch
        result["start_loss"] = full_loss(model, x_all, y_all)
        write_json(out + ".progress", {"epoch": copt.local_epoch})  # (a late joiner: the epoch it downloaded)
        fed_since_anchor = 0
        while time.monotonic() < deadline and not at_finish_line(cfg, copt.local_epoch,
                                                                 target_epoch(cfg, cfg["epochs"])):
            if cfg.get("stop_after") is not None and copt.diloco.rounds_applied >= cfg["stop_after"]:
                break
            n = next(sizes)
            idx = torch.randint(0, len(x_all) - held_out, (n,))
            y = y_all[idx]
            if cfg.get("attack", {}).get("wrong_labels"):  # a hostile member's data: every label shifted by one
                y = (y + 1) % 4
            F.cross_entropy(model(x_all[idx]), y).backward()
            result["samples_fed"] += n
            fed_since_anchor += n
            before = (copt.local_epoch, copt.diloco.rounds_applied, copt.diloco.resyncs)
            partial_rounds = len(params["partial"])
            copt.step()
            copt.zero_grad()
            if not cfg.get("overlap") and len(params["partial"]) != partial_rounds:
                fed_since_anchor = 0  # (what the next round weighs is what comes after the partial round)
            if cfg.get("overlap") and copt.diloco.rounds_applied != before[1]:  # a round landed in this step
                params["landed"][copt.diloco.rounds_applied] = dict(
                    after=snapshot(model), before=last_inner["params"],
                    anchor={k: a.detach().clone() for k, a in zip(params["start"], copt.loop.anchors,
                                                                  strict=True)})
            if copt.local_epoch != before[0]:
                epoch = copt.local_epoch
                params["after"][epoch] = snapshot(model)
                params["before"][epoch] = last_inner["params"]
                applied = copt.diloco.rounds_applied != before[1]
                last = copt.diloco.last_round
                if cfg.get("overlap") and copt.diloco.pending is not None:  # a round started (lands later)
                    applied, last = True, copt.diloco.pending
                    # what it averages: anchor - base (the previous round may have landed in this very step)
                    params["base"][epoch] = dict(zip(params["start"], (b.clone() for b in last.base), strict=True))
                result["rounds"].append(dict(
                    epoch=epoch, applied=applied, resynced=copt.diloco.resyncs != before[2],
                    weight=last.weight if applied else None,
                    group_size=getattr(last, "group_size", None) if applied else None,
                    fed_since_anchor=fed_since_anchor, reason=getattr(last, "reason", "started"),
                    detail=getattr(last, "detail", "")))
                if applied:
                    fed_since_anchor = 0
                if held_out:
                    result.setdefault("held_out_losses", {})[epoch] = full_loss(model, x_all[-held_out:],
                                                                                y_all[-held_out:])
                write_json(out + ".progress", {"epoch": epoch})
                if applied and cfg.get("checkpoint_epoch") is not None and epoch >= cfg["checkpoint_epoch"]:
                    torch.save(dict(copt=copt.state_dict(), model=snapshot(model),
                                    error_feedback=error_feedback_buffers(copt)), out + ".ckpt")
                    break
            time.sleep(cfg.get("step_sleep", 0.02))
        result.update(final_epoch=copt.local_epoch, final_loss=full_loss(model, x_all, y_all),
                      rounds_applied=copt.diloco.rounds_applied, rounds_failed=copt.diloco.rounds_failed,
                      resyncs=copt.diloco.resyncs, samples_reported=copt.samples_reported,
                      nonfinite_steps=copt.nonfinite_steps, metrics_interval=copt._reporter.interval,
                      exchange_bytes=[getattr(copt.loop.grad_averager, name, None)
                                      for name in ("bytes_sent", "bytes_received")])
        params["final"] = snapshot(model)
        torch.save(params, out + ".pt")
    write_json(out + ".json", result)


def error_feedback_buffers(copt: CollaborativeOptimizer) -> list[torch.Tensor]:
    """A copy of this peer's committed error-feedback buffer (``pseudo_gradient_compression``)."""
    return [b.clone() for b in copt.loop.grad_averager.error_feedback.buffers]


def attack_rounds(copt: CollaborativeOptimizer, spec: dict) -> None:
    """A hostile member: in every round it contributes to, what it sends is its pseudo-gradient (the round's buffers,
    which the compression reads) times ``spec["scale"]``, plus Gaussian noise of ``spec["noise"]`` times the
    pseudo-gradient's norm, at a weight of ``spec["claim"]`` times the samples it trained on. Its parameters stay its
    own, and so do the samples it reports for the swarm's progress (a claim there brings the rounds sooner for
    everyone; the claim here is what the aggregate weighs)."""
    diloco = copt.diloco
    contribute = diloco._contribute

    def hostile(swarm):
        weight = contribute(swarm)
        if weight == 0:  # (nothing to send: refused, or nothing trained)
            return weight
        with swarm.buffers() as buffers:
            norm = float(torch.linalg.vector_norm(torch.cat([b.reshape(-1) for b in buffers])))
            size = sum(b.numel() for b in buffers)
            for b in buffers:
                noise = torch.randn_like(b) * (spec.get("noise", 0.0) * norm / size ** 0.5)
                b.mul_(spec.get("scale", 1.0)).add_(noise)
        return weight * spec.get("claim", 1)

    diloco._contribute = hostile


def kill_mid_exchange(round_index: int) -> None:
    """Fault injection: in this peer's ``round_index``-th exchange (1-based, compressed DiLoCo), its offer goes to the
    first other member only (delivered: the call returned); then the process is SIGKILLed, the rest of the round
    going on without it. Patched on the exchange's runner (its rounds run in this process)."""
    import os
    import signal

    from collabopt.engine.gather_round import ExchangeRound

    send_offers, state = ExchangeRound.send_offers, {"rounds": 0}

    async def send_one_then_die(self, payload, weight, digest, signature, deadline):
        state["rounds"] += 1
        if state["rounds"] < round_index or not self.present:
            return await send_offers(self, payload, weight, digest, signature, deadline)
        await self._call(self.present[0], "rpc_offer", deadline, payload, weight, signature)
        print(f"fault injection: exchange {state['rounds']}: offer sent to {self.members[self.present[0]]} only, "
              "killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    ExchangeRound.send_offers = send_one_then_die


def record_partial_rounds(copt: CollaborativeOptimizer, model: torch.nn.Module, partial: dict) -> None:
    """``partial[epoch]``: the parameters this peer's pseudo-gradient was taken from, in each round of that epoch whose
    results did not all arrive though its pseudo-gradient may have reached the others (who may have applied it)."""
    diloco, names = copt.diloco, [name for name, _ in model.named_parameters()]
    may_have_delivered = diloco._may_have_delivered

    def record(base, weight, epoch):
        partial[epoch] = {name: b.detach().clone() for name, b in zip(names, base, strict=True)}
        may_have_delivered(base, weight, epoch)

    diloco._may_have_delivered = record


def cut_results(round_index: int, marker: str) -> None:
    """Fault injection: from this peer's ``round_index``-th all-reduce (1-based) on, the first time its reducer serves
    a member (a peer reduces a part only in some rounds) and its last part is less than half of the average, it
    ends that member's stream of results one part short, though it averaged that part: a lost result
    (test_diloco.results_cut), whose member must not count its pseudo-gradient twice. Once per swarm: the peer that
    cuts creates ``marker`` first. Patched on collabopt's all-reduce runner (its rounds run in this process)."""
    import os

    from collabopt.engine.allreduce import AllReduceRound

    serve, run = AllReduceRound.serve, AllReduceRound.run
    state = {"rounds": 0, "cut": False}

    async def counting_rounds(self, *args, **kwargs):
        state["rounds"] += 1
        return await run(self, *args, **kwargs)

    async def serve_then_cut(self, stream, sender_id):
        last_part = self.reducer.part_shapes[-1].numel() if self.reducer.part_shapes else 0
        # (the member must get more than half of the average: with less it cannot tell that its pseudo-gradient
        # arrived, and its round fails as any other)
        cutting = (state["rounds"] >= round_index and not state["cut"] and last_part
                   and 2 * last_part < self.container.total_size)
        if cutting:
            state["cut"] = True
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                cutting = False  # another peer cut already
        sent = 0
        async for message in serve(self, stream, sender_id):
            sent += 1
            if cutting and sent == self.reducer.num_parts:
                print(f"fault injection: round {state['rounds']}: results to {sender_id} cut one part short",
                      flush=True)
                return  # averaged, but that member never gets its result
            yield message

    AllReduceRound.serve = serve_then_cut
    AllReduceRound.run = counting_rounds


def inject_failure(copt: CollaborativeOptimizer, round_index: int) -> None:
    """This peer misses round ``round_index`` as if its connection failed then: it does not look for a group, and its
    averaging fails after the others had time to average without it."""
    swarm = copt.loop
    average, schedule = swarm.average, swarm.schedule_rounds
    failed = []

    def in_failing_round() -> bool:
        return swarm.local_epoch + 1 == round_index and not failed

    def failing_average(weight: float):
        if not in_failing_round():
            return average(weight)
        failed.append(True)
        swarm.skip_averaging()
        time.sleep(swarm.matchmaking_time + 1.0)  # the others' round happens meanwhile
        raise ConnectionError("injected: this peer's connection failed during the round")

    swarm.average = failing_average
    swarm.schedule_rounds = lambda: None if in_failing_round() else schedule()

if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
