"""scripts/dev.py test: the stages it runs (argument handling only; the commands are recorded, not run)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dev(monkeypatch):
    spec = importlib.util.spec_from_file_location("dev_script", ROOT / "scripts" / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls, codes = [], []

    def run(cmd, cwd=None):
        calls.append(cmd[cmd.index("pytest") + 1:])
        return subprocess.CompletedProcess(cmd, codes.pop(0) if codes else 0)

    monkeypatch.setattr(module.subprocess, "run", run)
    module.calls, module.codes = calls, codes
    return module


def test_the_whole_suite_runs_the_unit_tests_on_two_workers_then_the_swarms_alone(dev):
    assert dev.run_tests(["-q", "--durations=40"]) == 0
    assert dev.calls == [["tests", "-m", "not swarm and not net", "-n", "2", "-q", "--durations=40"],
                         ["tests", "-m", "swarm or net", "-q", "--durations=40"]]


@pytest.mark.parametrize("rest", [["-m", "not swarm"], ["-k", "churn"], ["tests/unit/test_cli.py"],
                                  ["tests/swarm/test_churn.py::test_churn_killed_peers_restart_in_sync_and_the_swarm_goes_on"]])
def test_arguments_that_select_tests_run_one_plain_pytest(dev, rest):
    assert dev.run_tests(["-q", *rest]) == 0
    assert dev.calls == [["-q", *rest]]


def test_both_stages_run_and_the_first_failure_is_the_exit_status(dev):
    dev.codes.extend([1, 2])
    assert dev.run_tests([]) == 1 and len(dev.calls) == 2
    dev.calls.clear()
    dev.codes.extend([0, 5])  # (pytest's "no test ran" is a failure too)
    assert dev.run_tests([]) == 5
