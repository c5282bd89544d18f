"""The command line with real swarms: `collabopt demo` (the main job), `collabopt dht` and `collabopt monitor`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, SWARM_ROUNDING, child_env, start_bootstrap, start_peer, unique_run_id, wait_for_file

from collabopt.processes import Process

pytestmark = pytest.mark.swarm


def test_demo_trains_a_swarm_in_sync():
    """The demo's run and its summary. 2 peers: that every peer of a swarm ends in sync is the swarm tests' claim
    (test_swarm_training, test_twelve_peers); here the summary must report it (a third peer cost 1/3 more CPU)."""
    proc = subprocess.run(
        [sys.executable, "-m", "collabopt", "demo", "--peers", "2", "--epochs", "3", "--no-progress"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "global epochs reached: 3" in out, out
    max_diff = float(out.split("max parameter difference between peers:")[1].split()[0])
    assert max_diff <= SWARM_ROUNDING and "peers are in sync" in out, out
    assert out.count("contributed") == 2
    computed = float(out.split("peers computed")[1].split("%")[0])
    assert 0 < computed <= 100, out  # the share of wall time outside step(), median over peers
    accuracy = float(out.split("held-out accuracy:")[1].split("%")[0])
    assert accuracy > 25.0, out  # 3 global steps on a 10-class problem: well above chance (10%)


def test_dht_prints_initial_peers_and_monitor_reads_the_run(tmp_path):
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    assert initial_peers.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in initial_peers
    run_id = unique_run_id("monitor")
    # an epoch the peer cannot finish in the test (~320 samples/s): the monitor always sees it mid-epoch
    peer = start_peer(tmp_path, "peer", dict(run_id=run_id, target_batch_size=100_000, epochs=1, step_sleep=0.05,
                                             max_seconds=120, linger=0), initial_peers)
    try:
        # written by the peer once its CollaborativeOptimizer has joined the swarm
        assert wait_for_file(tmp_path / "peer.start.pt", 90), peer.log()[-3000:]
        deadline = time.monotonic() + 60
        while True:  # until the peer's progress record (published every few seconds) counts samples
            monitor = subprocess.run(
                [sys.executable, "-m", "collabopt", "monitor", "--run-id", run_id, "--initial-peers", initial_peers,
                 "--count", "1", "--json", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
            )
            assert monitor.returncode == 0, monitor.stderr[-3000:]
            report = json.loads(monitor.stdout.strip().splitlines()[-1])
            assert report["run_id"] == run_id
            seen = report["num_peers"] >= 1 and report["peers"] and report["peers"][0]["samples_accumulated"] > 0
            if seen or time.monotonic() > deadline:
                break
            assert peer.poll() is None, f"the peer exited early:\n{peer.log()[-3000:]}"
            time.sleep(0.5)
        assert report["num_peers"] == 1, report
        assert report["peers"][0]["samples_accumulated"] > 0, report
        assert peer.poll() is None, "the report must be of a peer that is still training"
    finally:
        peer.kill_tree()
        bootstrap.kill_tree()
    assert "INITIAL_PEERS=" in bootstrap.log()
    assert peer.returncode is not None and bootstrap.returncode is not None, "kill_tree left a process running"


def test_doctor_passes_against_a_collabopt_bootstrap(tmp_path):
    """On loopback every check passes, including incoming connections: the bootstrap dials back to the port the
    doctor listens on. Against a dead address the same machine fails the peer check, with the fix."""
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    try:
        doctor = subprocess.run(
            [sys.executable, "-m", "collabopt", "doctor", "--initial-peers", initial_peers,
             "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--json"],
            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
        )
        dead = f"/ip4/127.0.0.1/tcp/9/p2p/{initial_peers.split('/p2p/')[1]}"  # the discard port: nothing listens
        failing = subprocess.run(
            [sys.executable, "-m", "collabopt", "doctor", "--initial-peers", dead, "--host-maddrs",
             "/ip4/127.0.0.1/tcp/0", "--timeout", "5"],
            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
        )
    finally:
        bootstrap.kill_tree()
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert all(c["status"] == "PASS" for c in checks.values()), checks
    assert checks[f"initial peer {initial_peers}"]["detail"].startswith("connected in ")
    incoming = checks["incoming connections"]["detail"]
    assert "initial peers connected back to 127.0.0.1:" in incoming and "full peer" in incoming, incoming
    assert failing.returncode == 1, failing.stdout
    assert f"FAIL     initial peer {dead}: unreachable" in failing.stdout, failing.stdout
    assert "fix: check that the peer is still running" in failing.stdout



def test_ctrl_c_ends_dht_and_monitor_with_exit_status_130(tmp_path):
    """Ctrl+C (SIGINT) ends `collabopt dht` and `collabopt monitor` with 130, as every command: starting hivemind's
    DHT sets SIGINT to ignored in the process, and the commands put Python's handler back."""
    bootstrap, initial_peers = start_bootstrap(tmp_path)
    monitor = Process([sys.executable, "-m", "collabopt", "monitor", "--run-id", unique_run_id("ctrl_c"),
                       "--initial-peers", initial_peers, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--interval", "0.5"],
                      tmp_path / "monitor.log", env=child_env())
    try:
        deadline = time.monotonic() + 60
        while "0 peers" not in monitor.log():  # its first report: it serves, between two reads
            assert monitor.poll() is None and time.monotonic() < deadline, monitor.log()[-3000:]
            time.sleep(0.2)
        for proc, name in ((monitor, "monitor"), (bootstrap, "dht")):
            assert not ignores_sigint(proc.pid), f"{name} runs with SIGINT ignored (inherited?): no Ctrl+C to test"
            proc.signal(signal.SIGINT)
            assert proc.wait(30) == 130, proc.log()[-3000:]
            assert f"collabopt {name}: interrupted" in proc.log() and "Traceback" not in proc.log(), proc.log()[-3000:]
    finally:
        monitor.kill_tree()
        bootstrap.kill_tree()


def ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its SigIgn mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line.split()[1] for line in status if line.startswith("SigIgn:"))
    return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)
