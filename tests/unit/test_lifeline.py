"""collabopt.lifeline: processes forked inside children_follow_parent() end when their parent is SIGKILLed, and
take their own children (p2pd, for hivemind's DHT process) with them. Real processes, no hivemind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

PARENT = r'''
import multiprocessing as mp, subprocess, sys, time
from collabopt.lifeline import children_follow_parent

def helper():  # like hivemind's DHT process: it runs a daemon of its own
    subprocess.Popen(["sleep", "600"])
    time.sleep(600)

follow = sys.argv[1] == "follow"
ctx = mp.get_context("fork")
if follow:
    with children_follow_parent():
        ctx.Process(target=helper, daemon=True).start()
else:
    ctx.Process(target=helper, daemon=True).start()
print("READY", flush=True)
time.sleep(600)
'''


def run_and_kill(mode: str, grace: float) -> list[psutil.Process]:
    """Start the parent, wait for its child and grandchild, SIGKILL the parent; return its descendants still alive
    after up to ``grace`` seconds."""
    proc = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        deadline = time.monotonic() + 10
        while len(psutil.Process(proc.pid).children(recursive=True)) < 2:
            assert time.monotonic() < deadline, "the helper did not start its daemon"
            time.sleep(0.05)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in descendants):
            time.sleep(0.1)
        return [p for p in descendants if _alive(p)]
    finally:
        proc.kill()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_and_their_daemons_end_with_a_killed_parent():
    assert run_and_kill("follow", grace=10) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_without_it_they_outlive_the_parent():
    """The defect it fixes (and proof that the test above can fail)."""
    left = run_and_kill("plain", grace=2)
    try:
        assert len(left) == 2
    finally:
        for p in left:
            p.kill()
