"""Smoke tests of the benchmark harness: it runs, cleans up after itself and writes the report (no timing asserted)."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import run, wan
from collabopt import testnet as netns


def canned_results() -> dict:
    machine = dict(date_utc="2026-01-01 00:00 UTC", host="h", cpu="cpu", cpus=2, load_avg_1m_at_start=1.0,
                   load_avg_1m_at_end=1.0, kernel="6", python="3.11", torch="2", hivemind="1.1.12", collabopt="0.1",
                   git_commit="abc")
    b3_row = dict(case="c", peers=4, mbit=100, variant="overlap", grad_mb=8.0, bound_s=0.96, allreduce_s=1.1,
                  rounds=3, allreduce_range="1.0..1.2", bound_over_allreduce=0.87, utilization=0.97,
                  epoch_compute_s=5.0)
    return dict(
        machine=machine, quick=False,
        config=dict(b1=dict(params=1, batch=2, rounds=1, measure_seconds=3),
                    b3=dict(compute_seconds=0.1, steps_per_epoch=5)),
        b1=dict(ratio=1.0, ratio_range="1.0..1.0", target_batch_size=64, hivemind_samples_per_s=10.0,
                collabopt_samples_per_s=10.0),
        b2=dict(params=10, batch=2, steps_per_epoch=4, steps_per_round=8, rounds=2,
                rows=[dict(variant="plain torch", ratio=1.0, ratio_range="1..1", cpu_ratio=1.0, ms_per_step=1.0),
                      dict(variant="collabopt", ratio=1.1, ratio_range="1..1.2", cpu_ratio=1.05, ms_per_step=1.1)]),
        b3=dict(rows=[b3_row, dict(case="d", peers=4, mbit=20, variant="overlap + PowerSGD", error="boom")]),
        b4=dict(device="cpu", params=10, rows=[dict(mode="none", extra_over_params=6.0)]),
    )


def test_report_has_every_section_and_a_plot(tmp_path):
    paths = run.write_report(canned_results(), tmp_path)
    text = (tmp_path / "results.md").read_text()
    for heading in ("## B1", "## B2", "## B3", "## B4", "hivemind 1.1.12", "failed: boom"):
        assert heading in text
    assert json.loads((tmp_path / "results.json").read_text())["b1"]["ratio"] == 1.0
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
        raise RuntimeError("inside")
    assert _our_namespaces() == before
