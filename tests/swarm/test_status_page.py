"""The status page of ``collabopt monitor --serve`` in a real browser, over a real 3-peer swarm.

Headless Chromium (Debian's package; installed by :func:`browser.find_chromium` when this runs as root, else the test
skips with the reason, and fails in CI) opens the page and waits for the three peers' rows and a drawn throughput
plot, and a screenshot is saved (``status_page.png`` in the test's folder). ``/api/state`` and ``/metrics`` are
compared with the peers' own numbers (``monitor_worker.py`` logs them): while they train, the epoch and samples/s
the monitor shows for a peer are those the peer had at its record's time; once they idle, they are equal. A
SIGKILLed peer turns ``stale`` on the page while its record still lives on the DHT.
"""

from __future__ import annotations

import os
import time

import pytest
from browser import Chromium, find_chromium
from helpers import Process, start_bootstrap, unique_run_id
from monitor_helpers import api_state, prometheus, start_monitor, start_worker, trace, wait_files, wait_state

PEERS = ("a", "b", "c")


def require_chromium() -> str:
    executable, reason = find_chromium()
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail(f"the status page test must run in CI: {reason}")
        pytest.skip(reason)
    return executable


def rows_by_id(state: dict) -> dict[str, dict]:
    return {row["id"]: row for row in state["peers"]}


def check_against_traces(state: dict, tmp_path) -> None:
    """Every peer's row shows the epoch and samples/s the peer had when it published its record.

    A peer logs its values after every step (``monitor_worker.py``), and a step changes them at most once: at the
    record's time they were those of the peer's last log before it, or (a step under way) of its first log after.
    """
    rows = rows_by_id(state)
    for name in PEERS:
        deadline = time.monotonic() + 30
        while True:  # the peer's first log after its record
            entries = trace(tmp_path, name)
            row = rows[entries[0]["peer_id"]]
            if entries[-1]["t"] > row["updated"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        before = [e for e in entries if e["t"] <= row["updated"]][-1:]
        after = [e for e in entries if e["t"] > row["updated"]][:1]
        assert after, (name, row["updated"], entries[-1]["t"])
        assert row["samples_per_second"] in {e["sps"] for e in before + after}, (name, row, before, after)
        assert row["epoch"] in {e["epoch"] for e in before + after}, (name, row, before, after)


def test_status_page_in_a_browser(tmp_path):
    chromium = require_chromium()
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    run_id = unique_run_id("page")
    procs: dict[str, Process] = {"bootstrap": bootstrap}
    try:
        procs["monitor"], url = start_monitor(tmp_path, run_id, initial_peers)
        for name in PEERS:
            procs[name] = start_worker(tmp_path, name, dict(
                run_id=run_id, target_batch_size=600, epochs=3, wait_peers=3, max_seconds=150,
                finish_with=[str(tmp_path / other) for other in PEERS if other != name]), initial_peers)
        with Chromium(tmp_path, chromium) as browser:
            page = browser.open(url)
            page.wait_for("document.querySelectorAll('#peers tbody tr').length === 3 && "
                          "[...document.querySelectorAll('#plot-sps polyline')]"
                          ".some(p => p.getAttribute('points').split(' ').length >= 2)", timeout=90)
            # while they train (every peer past its first global step)
            state = wait_state(url, lambda s: len(s["peers"]) == 3 and all(r["epoch"] >= 1 for r in s["peers"]), 60,
                               "the three peers training")
            check_against_traces(state, tmp_path)
            page.wait_for("document.querySelector('#global-epoch').textContent !== '0'", timeout=10)
            page.screenshot(tmp_path / "status_page.png")

            # all three idle at their last epoch (still publishing): the monitor's numbers are theirs
            wait_files([tmp_path / f"{name}.done" for name in PEERS], 120, procs)
            finals = {name: trace(tmp_path, name)[-1] for name in PEERS}
            own = {(f["peer_id"], f["epoch"], f["sps"], f["samples_reported"]) for f in finals.values()}
            state = wait_state(url, lambda s: own == {(r["id"], r["epoch"], r["samples_per_second"],
                                                       r["samples_reported"]) for r in s["peers"]},
                               20, "the monitor showing the idle peers' own epochs, samples/s and samples")
            metrics = prometheus(url)
            assert state["num_peers"] == 3 and state["global_epoch"] == max(f["epoch"] for f in finals.values())
            assert state["samples_per_second"] == pytest.approx(sum(f["sps"] for f in finals.values()), rel=1e-12)
            run = ("run_id", run_id)
            assert metrics["collabopt_global_epoch", frozenset({run})] == state["global_epoch"]
            assert metrics["collabopt_peers", frozenset({run})] == 3
            for f in finals.values():
                labels = frozenset({run, ("peer", f["peer_id"])})
                assert metrics["collabopt_peer_epoch", labels] == f["epoch"]
                assert metrics["collabopt_peer_samples_per_second", labels] == pytest.approx(f["sps"], rel=1e-12)
            reported = {r["id"]: r["samples_reported"] for r in state["peers"]}
            assert reported == {f["peer_id"]: f["samples_reported"] for f in finals.values()}
            assert sum(r["share"] for r in state["peers"]) == pytest.approx(1.0)
            assert all(r["loss"] is not None and r["sync"] == "in sync" for r in state["peers"])

            # a killed peer turns stale on the page while its record still lives on the DHT
            victim = finals["c"]["peer_id"]
            procs["c"].kill_tree()
            page.wait_for(f"document.querySelector('tr[data-peer=\"{victim}\"]').dataset.sync === 'stale'",
                          timeout=60)
            stale = rows_by_id(api_state(url))[victim]
            assert stale["sync"] == "stale" and not stale["live"], stale
            assert stale["expires_at"] > api_state(url)["time"], "its record had expired already"
            page.wait_for("document.querySelector('#num-peers').textContent === '2'", timeout=10)
            page.screenshot(tmp_path / "status_page_stale.png")
        for name in ("a", "b"):
            (tmp_path / f"{name}.stop").touch()
        for name in ("a", "b"):
            assert procs[name].wait(60) == 0, procs[name].log()[-4000:]
    finally:
        for proc in procs.values():
            proc.kill_tree()
    assert (tmp_path / "status_page.png").stat().st_size > 10_000
