"""Smoke tests of the benchmark harness: it runs, cleans up after itself and writes the report (no timing asserted)."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import run, wan
from harness import testnet as netns


def canned_results() -> dict:
    machine = dict(date_utc="2026-01-01 00:00 UTC", host="h", cpu="cpu", cpus=2, load_avg_1m_at_start=1.0,
                   load_avg_1m_at_end=1.0, kernel="6", python="3.11", torch="2", hivemind="1.1.12", collabopt="0.1",
                   git_commit="abc")
    b3_row = dict(case="c", peers=4, mbit=100, variant="overlap", grad_mb=8.0, bound_s=0.96, allreduce_s=1.1,
                  rounds=3, allreduce_range="1.0..1.2", bound_over_allreduce=0.87, utilization=0.97,
                  epoch_compute_s=5.0)
    b5_row = dict(case="e", peers=3, variant="default", experiments=[], epoch_factor=4, epoch_s=6.1,
                  idle_per_epoch_s=1.8, idle_per_epoch_range="1.8..1.9", idle_share=0.3, lead_s=1.2,
                  wait_grads_s=0.3, step_state_s=1.1, arrival_skew_s=0.25, max_param_diff=2.5e-07, epochs_compared=2)
    return dict(
        machine=machine, quick=False,
        config=dict(b1=dict(params=1, batch=2, compute_seconds=0.05, epoch_seconds=3, sessions=1),
                    b3=dict(compute_seconds=0.1, steps_per_epoch=5),
                    b5=dict(params=1, batch=2, compute_seconds=0.05, matchmaking_time=1.0, measure_epochs=2,
                            warmup_epochs=1)),
        b1=dict(ratio=1.0, ratio_range="1.0..1.0", target_batch_size=64, rounds=2, hivemind_samples_per_s=10.0,
                collabopt_samples_per_s=10.0, cpu_ratio=1.01, cpu_ratio_range="1.0..1.02",
                hivemind_cpu_ms_per_sample=0.5, collabopt_cpu_ms_per_sample=0.505, hivemind_max_param_diff=float("nan"),
                hivemind_epochs_compared=3, collabopt_max_param_diff=0.0, collabopt_epochs_compared=3),
        b2=dict(params=10, batch=2, steps_per_epoch=4, steps_per_round=8, rounds=2,
                rows=[dict(variant="plain torch", ratio=1.0, ratio_range="1..1", cpu_ratio=1.0, ms_per_step=1.0),
                      dict(variant="collabopt", ratio=1.1, ratio_range="1..1.2", cpu_ratio=1.05, ms_per_step=1.1)]),
        b3=dict(rows=[b3_row, dict(case="d", peers=4, mbit=20, variant="overlap + PowerSGD", error="boom")]),
        b4=dict(device="cpu", params=10, rows=[dict(mode="none", extra_over_params=6.0)]),
        b5=dict(rows=[b5_row, dict(b5_row, variant="overlap", experiments=["prescheduled_state"]),
                      dict(peers=4, variant="overlap", epoch_factor=4, error="bang")]),
    )


def test_report_has_every_section_and_a_plot(tmp_path):
    paths = run.write_report(canned_results(), tmp_path)
    text = (tmp_path / "results.md").read_text()
    for heading in ("## B1", "## B2", "## B3", "## B4", "## B5", "hivemind 1.1.12", "failed: boom", "failed: bang",
                    "| 3 | default | 6.1 | 1.80 |", "overlap + prescheduled_state", "**missed**", "CPU ms / sample",
                    # the peers' largest parameter difference (over how many common epochs), per swarm
                    "at a common epoch | nan (3) | 0 (3) |", "| 0.25 | 2.5e-07 (2) |"):
        assert heading in text
    assert json.loads((tmp_path / "results.json").read_text())["b1"]["ratio"] == 1.0
    assert "| - (0) |" in run.markdown(dict(canned_results(), b5=dict(rows=[dict(canned_results()["b5"]["rows"][0],
                                                                               epochs_compared=0)])))
    pytest.importorskip("matplotlib")
    assert tmp_path / "results.png" in paths and (tmp_path / "results.png").stat().st_size > 1000


def test_wan_is_skipped_with_a_reason_when_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(wan, "unavailable_reason", lambda: "needs root")
    result = wan.run(dict(cases=[dict(peers=2, mbit=10, params=10, variant="overlap")]), tmp_path, log=lambda m: None)
    assert result == dict(skipped="needs root", rows=[])
    assert "skipped: needs root" in run.markdown(dict(canned_results(), b3=result))


def _our_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(netns.PREFIX)}


def test_test_network_is_removed_also_after_an_error():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    before = _our_namespaces()
    with pytest.raises(RuntimeError, match="inside"), netns.TestNet(2, 50) as net:
        created = _our_namespaces() - before
        assert set(net.peers) | {net.hub, net.bootstrap} <= created
        qdiscs = subprocess.run(["tc", "-n", net.peers[0], "qdisc", "show", "dev", "eth0"], capture_output=True,
                                text=True).stdout
        assert "tbf" in qdiscs and "50Mbit" in qdiscs
        mine = set(net.peers) | {net.hub, net.bootstrap}
        raise RuntimeError("inside")
    assert not mine & _our_namespaces()  # (others' test networks may come and go meanwhile)


def _synthetic_peer(offset: float = 0.0) -> dict:
    """A peer stepping every 0.1 s (0.09 s compute + 0.01 s step) whose steps ending epochs 1 and 2 took 1 s."""
    steps, epochs, status, t, epoch = [], [], [], offset, 0
    for i in range(60):
        boundary = i in (19, 39)
        step_s = 1.0 if boundary else 0.01
        if boundary:
            status += [(t + 0.09 - 2.0, "Pre-scheduling gradient averaging round in 1.00 sec"),
                       (t + 0.09, f"Beginning optimizer step #{epoch}"), (t + 0.39, "Averaged gradients with 3 peers"),
                       (t + 1.09, f"Transitioning to epoch {epoch + 1}")]
            epoch += 1
            epochs.append((t + 0.09 + step_s, epoch))
        steps.append((t, 0.09, step_s, epoch))
        t += 0.09 + step_s
    return dict(steps=steps, epochs=epochs, status=status, window=[epochs[0][0], t], final_epoch=epoch)


def test_b5_splits_idle_time_at_the_boundary():
    from benchmarks import boundary

    peer = _synthetic_peer()
    idle = boundary.peer_idle(peer, warmup_epochs=1)
    assert idle["plain_step"] == pytest.approx(0.01)
    assert idle["epochs"] == 1 and idle["idle"] == pytest.approx(0.99)  # the one boundary inside the window
    split = boundary.boundary_split(peer, peer["window"][0] - 100, peer["window"][1])
    assert split["lead"] == pytest.approx([2.0, 2.0]) and split["wait_grads"] == pytest.approx([0.3, 0.3])
    assert split["step_state"] == pytest.approx([0.7, 0.7]) and split["boundary"] == pytest.approx([1.0, 1.0])
    skews = boundary.arrival_skew([peer, _synthetic_peer(offset=0.25)], 0.0, 1e9)
    assert skews == pytest.approx([0.25, 0.25])


def test_b1_rounds_are_epochs():
    from benchmarks import overhead

    peer = dict(_synthetic_peer(), window=[0.0, 1e9])
    rates = overhead.epoch_rates(peer, batch=10, first_epoch=1)
    assert list(rates) == [1]  # epoch 2 never ends
    assert rates[1] == pytest.approx(20 * 10 / (19 * 0.1 + 1.09))
    assert overhead.swarm_rates([peer, peer], batch=10, first_epoch=1) == pytest.approx([2 * rates[1]])


def test_b6_bytes_per_sample_is_the_swarms():
    from benchmarks import diloco_wan

    def peer(steps: int, sent: int) -> dict:
        # steps of 1 s (0.9 s of compute, 0.1 s in step()), one round at the window's end
        return dict(window=[0.0, float(steps)], net_bytes=[1000, 1000 + sent], epochs=[(float(steps), 1)],
                    steps=[(float(i), 0.9, 0.1, 0, 0.0) for i in range(steps)])

    figures = diloco_wan.wan_figures([peer(10, 3200), peer(30, 3200)], warmup_epochs=1, batch=2)
    # all bytes over all samples: 80 (the median of the per-peer ratios 160 and 53.3 was 106.7)
    assert figures["bytes_per_sample"] == pytest.approx(6400 / 80)
    assert figures["utilization"] == pytest.approx(0.9) and figures["rounds_in_window"] == 1
    assert figures["bytes_per_peer_round"] == pytest.approx(3200)


def test_b6_peer_builds_diloco_and_sparseloco_from_its_config():
    import torch

    from benchmarks.peer import diloco_options
    from collabopt.diloco_options import SparseLoCo

    assert diloco_options({}) == {} and diloco_options(dict(sparse={})) == {}  # no outer: the synchronous mode
    fp16 = diloco_options(dict(outer=dict(lr=0.7, momentum=0.9, nesterov=True)))
    assert set(fp16) == {"outer_optimizer"}
    assert fp16["outer_optimizer"].func is torch.optim.SGD and fp16["outer_optimizer"].keywords["nesterov"]
    sparse = diloco_options(dict(outer="sparseloco", sparse={}))
    assert sparse["pseudo_gradient_compression"] == SparseLoCo()
    assert sparse["outer_optimizer"].keywords == SparseLoCo.outer_optimizer().keywords == dict(lr=1.0)
    assert diloco_options(dict(outer="sparseloco", sparse=dict(density=0.05)))[
        "pseudo_gradient_compression"].density == 0.05


def test_b6_sparse_rows_are_compared_with_fp16_diloco_at_the_same_rate():
    from benchmarks import diloco, diloco_wan

    assert {"sparse", "sparse + overlap"} <= set(diloco.QUICK["wan"]["modes"])
    assert diloco_wan.WAN["modes"]["sparse + overlap"]["steps_per_epoch"] == diloco_wan.WAN["modes"]["diloco"][
        "steps_per_epoch"]

    def row(mbit: int, mode: str, bytes_per_sample: float, utilization: float = 0.99) -> dict:
        return dict(mbit=mbit, mode=mode, bytes_per_sample=bytes_per_sample, utilization=utilization,
                    utilization_min=utilization - 0.01, peers=4)

    rows = [row(20, "synchronous", 60000.0), row(20, "diloco", 250.0), row(20, "diloco + overlap", 200.0),
            row(20, "sparse", 10.0), row(20, "sparse + overlap", 12.5, utilization=0.985),
            row(100, "sparse", 5.0), dict(mbit=100, mode="diloco", error="boom")]
    diloco_wan.add_ratios(rows)
    by = {(r["mbit"], r["mode"]): r for r in rows}
    assert by[20, "diloco"]["fewer_bytes_than_synchronous"] == pytest.approx(240)
    assert "fewer_bytes_than_fp16" not in by[20, "diloco"]
    assert "fewer_bytes_than_synchronous" not in by[20, "synchronous"]
    assert by[20, "sparse"]["fewer_bytes_than_fp16"] == pytest.approx(25)  # against "diloco"
    assert by[20, "sparse + overlap"]["fewer_bytes_than_fp16"] == pytest.approx(16)  # against "diloco + overlap"
    assert by[20, "sparse"]["fewer_bytes_than_synchronous"] == pytest.approx(6000)
    assert set(by[100, "sparse"]) == {"mbit", "mode", "bytes_per_sample", "utilization", "utilization_min", "peers"}
    by[20, "sparse"].update(payload_bytes=100_000, bytes_per_peer_round=500_000.0)
    goals = diloco_wan.sparse_goals(rows)
    assert len(goals) == 2
    assert goals[0].startswith("- 20 Mbit/s sparse: 25.0x") and "(goal >= 20x: met)" in goals[0]
    assert "utilization" not in goals[0]
    assert goals[0].endswith("sent per peer and round 500 kB, of which the payload to the 3 others at most 300 kB")
    assert "(goal >= 20x: not met)" in goals[1] and "0.985 mean, 0.975 lowest peer (goal >= 0.98: not met)" in goals[1]


def test_b6_payload_bytes_per_peer_and_round():
    from benchmarks import diloco_wan
    from collabopt.diloco_options import SparseLoCo

    assert diloco_wan.payload_bytes(diloco_wan.WAN["modes"]["synchronous"], 1000) is None
    assert diloco_wan.payload_bytes(diloco_wan.DILOCO_WAN, 1000) == 2000
    assert diloco_wan.payload_bytes(diloco_wan.SPARSE_WAN, 10**6) == SparseLoCo().codec.payload_bytes(10**6)


def test_fair_bed_queues_per_peer_and_congestion_control():
    """``fair``: under each link's tbf, one queue per other peer plus one for the rest, each other peer's address
    filtered to its own; ``congestion``: every namespace uses it (reno: every host allows it)."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns.TestNet(3, 50, fair=True, congestion="reno") as net:
        for where, dev, others in ((net.peers[0], "eth0", net.addr[1:]), (net.hub, "v1", net.addr[1:])):
            classes = subprocess.run(["tc", "-n", where, "class", "show", "dev", dev], capture_output=True,
                                     text=True).stdout
            filters = subprocess.run(["tc", "-n", where, "filter", "show", "dev", dev, "parent", "2:"],
                                     capture_output=True, text=True).stdout
            assert classes.count("class htb") == 3
            for addr in others:
                assert "".join(f"{int(octet):02x}" for octet in addr.split(".")) in filters
        for ns in (*net.peers, net.hub, net.bootstrap):
            cc = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                                capture_output=True, text=True).stdout.strip()
            assert cc == "reno"


def test_allreduce_timing_reads_collabopt_rounds_and_hivemind_controls():
    """B3's all-reduce time comes from the gradient averager's step: collabopt's round reports its end (prescheduled
    or not, waited for or not), hivemind's StepControl is a future; a round that failed or raised is not ok."""
    import concurrent.futures
    import types

    from benchmarks.peer import instrument_averaging
    from benchmarks.swarmrun import allreduce_seconds

    class Scheduled:  # the part of collabopt's ScheduledRound the timing reads
        def __init__(self, error=None):
            self.callbacks, self.error = [], error

        def on_done(self, callback):
            self.callbacks.append(callback)

        def result(self, timeout=None):
            return types.SimpleNamespace(tensors=None if self.error else [], error=self.error)

        def end(self):
            for callback in self.callbacks:
                callback()

    def averager(step):
        events = []
        holder = types.SimpleNamespace(step=step)
        instrument_averaging(holder, events)
        return holder, events

    # collabopt, prescheduled, waited for: the round ends inside step()
    round_ = types.SimpleNamespace(scheduled=Scheduled())
    holder, events = averager(lambda **kw: (kw["control"].scheduled.end(), {"me": {}})[1])
    assert holder.step(control=round_) == {"me": {}}
    assert events[0]["ok"] and events[0]["done"] >= events[0]["trigger"] and events[0]["prescheduled"]
    # collabopt, not waited for (delay_grad_averaging): the end comes later
    later = types.SimpleNamespace(scheduled=Scheduled(error="no quorum"))
    holder, events = averager(lambda **kw: later)
    holder.step(wait=False)
    assert "done" not in events[0]
    later.scheduled.end()
    assert events[0]["done"] >= events[0]["trigger"] and events[0]["ok"] is False
    # collabopt, scheduled inside step() and waited for; then a step that raised
    def failing(**kw):
        raise RuntimeError("round failed")
    holder, events = averager(lambda **kw: {"me": {}})
    holder.step()
    assert events[0]["ok"] is True and events[0]["done"] >= events[0]["trigger"]
    holder, events = averager(failing)
    with pytest.raises(RuntimeError):
        holder.step()
    assert events[0]["ok"] is False
    # hivemind: a StepControl is a future
    future = concurrent.futures.Future()
    holder, events = averager(lambda **kw: future)
    holder.step(wait=False)
    future.set_result(None)
    assert events[0]["ok"] is True
    # two peers' rounds pair by trigger time; the first event of each peer is skipped
    records = [{"averaging": [dict(trigger=t, done=t + d, ok=True) for t, d in ((0, 1), (10.0, 2.5))]},
               {"averaging": [dict(trigger=t + 0.5, done=t + 0.5 + d, ok=True) for t, d in ((0, 1), (10.0, 2.0))]}]
    assert allreduce_seconds(records) == [2.0]


@pytest.mark.parametrize("transport", ["tcp", "p2p"])
def test_b3_reference_peers_send_a_butterfly_all_reduces_bytes(tmp_path, transport):
    """B3's references, plain TCP and p2pd's byte streams (benchmarks.{tcp,p2p}_allreduce_peer), 3 peers on
    loopback: every round of every peer is read by allreduce_seconds, and each peer writes 2 (N-1)/N of the gradient
    bytes: its part for each other peer, and its own part's results to each of them."""
    import socket
    import sys

    from benchmarks.common import ROOT, child_env
    from benchmarks.swarmrun import allreduce_seconds
    from benchmarks.tcp_allreduce_peer import part_sizes

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    addrs = [f"127.0.0.{21 + i}" for i in range(3)]
    procs = []
    for i in range(3):
        config = tmp_path / f"{i}.json"
        config.write_text(json.dumps(dict(index=i, addrs=addrs, port=port, grad_bytes=80_011, rounds=3,
                                          idle_seconds=0.05, part_size_bytes=4096, exchange_dir=str(tmp_path),
                                          ready_file=str(tmp_path / f"{i}.ready"), go_file=str(tmp_path / "go"),
                                          out=str(tmp_path / f"{i}.out.json"))))
        procs.append(subprocess.Popen([sys.executable, "-m", f"benchmarks.{transport}_allreduce_peer", str(config)],
                                      env=child_env(), cwd=ROOT))
    (tmp_path / "go").touch()
    assert [proc.wait(timeout=60) for proc in procs] == [0, 0, 0]
    records = [json.loads((tmp_path / f"{i}.out.json").read_text()) for i in range(3)]
    grad_bytes = records[0]["grad_bytes"]
    sizes = part_sizes(grad_bytes, 3)
    assert sum(sizes) == grad_bytes and max(sizes) - min(sizes) <= 1
    for i, record in enumerate(records):
        others, own_results = grad_bytes - sizes[i], (3 - 1) * sizes[i]
        assert [event["written"] for event in record["averaging"]] == [others + own_results] * 3
    assert len(allreduce_seconds(records)) == 2  # (the first round is left out, as for every B3 row)


def test_b3_rows_are_the_median_of_their_sittings():
    """wan_allreduce's sittings, rows paired by case: a row's time and utilization are the medians of its measured
    sittings' (its range their times, their figures listed); a sitting whose row failed or timed no round is left out
    of it and its error kept; a row measured in no sitting keeps its first row; a skipped bed stays skipped."""
    from benchmarks.wan_allreduce import combine_sittings

    def row(case, seconds, utilization=float("nan"), **extra):
        return dict(case=case, peers=4, mbit=100, bound_s=2.0, allreduce_s=seconds, rounds=5, allreduce_range="-",
                    bound_over_allreduce=2.0 / seconds, utilization=utilization, **extra)

    failed = dict(case="tcp", peers=4, mbit=100, error="peer wrote no record")
    sittings = [dict(rows=[row("hivemind", 2.5, 0.6), row("engine", 2.2), failed]),
                dict(rows=[row("engine", 9.0, error="x"), row("hivemind", 2.2, 0.7), failed]),
                dict(rows=[row("hivemind", 2.4, 0.65), dict(row("engine", float("nan")), rounds=0), failed]),
                dict(skipped="not root", rows=[])]
    rows = combine_sittings(sittings)["rows"]
    assert [r["case"] for r in rows] == ["hivemind", "engine", "tcp"]
    assert rows[0]["allreduce_s"] == 2.4 and rows[0]["bound_over_allreduce"] == 2.0 / 2.4
    assert rows[0]["sittings"] == [0.8, 0.909, 0.833] and rows[0]["rounds"] == 15 and rows[0]["utilization"] == 0.65
    assert rows[0]["allreduce_range"] == "2.200..2.500 (3 sittings)" and rows[0]["failed_sittings"] == []
    assert rows[1]["allreduce_s"] == 2.2 and rows[1]["allreduce_range"] == "2.200..2.200 (1 sitting)"
    assert rows[1]["failed_sittings"] == ["x", "no round timed"]
    assert rows[2] == failed
    assert combine_sittings([dict(skipped="not root", rows=[])] * 2) == dict(skipped="not root", rows=[])
