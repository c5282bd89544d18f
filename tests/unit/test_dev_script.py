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


@pytest.mark.parametrize("rest", [[], ["-q", "--durations=40"], ["-q", "--durations", "40", "-p", "no:cacheprovider"],
                                  ["-vv", "-ra", "--tb=short", "-pno:cacheprovider", "--color=no"]])
def test_the_whole_suite_runs_the_unit_tests_on_two_workers_then_the_swarms_alone(dev, rest):
    assert dev.run_tests(rest) == 0
    assert dev.calls == [["tests", "-m", "not swarm and not net", "-n", "2", *rest],
                         ["tests", "-m", "swarm or net", *rest]]


@pytest.mark.parametrize("rest", [
    ["-m", "not swarm"], ["-mswarm"], ["-qm", "swarm"], ["-k", "churn"], ["-kchurn"], ["tests/unit/test_cli.py"],
    ["tests/swarm/test_churn.py::test_churn_killed_peers_restart_in_sync_and_the_swarm_goes_on"],
    ["--ignore", "tests/swarm"], ["-x"], ["--maxfail=1"], ["--lf"], ["--pdb"], ["--junitxml", "out.xml"], ["-s"],
    ["--durations"],  # (its value missing: pytest says so)
])
def test_any_other_argument_runs_one_plain_pytest_as_written(dev, rest):
    """A selection, -x, --lf, --pdb or a report file means one run: two stages would run a -k that matches nothing
    in one of them (exit 5), go on after -x, rerun everything after --lf, or write one report over the other."""
    assert dev.run_tests(["-q", *rest]) == 0
    assert dev.calls == [["-q", *rest]]


def test_both_stages_run_and_the_first_failure_is_the_exit_status(dev):
    dev.codes.extend([1, 2])
    assert dev.run_tests([]) == 1 and len(dev.calls) == 2
    dev.calls.clear()
    dev.codes.extend([0, 5])  # (pytest's "no test ran" is a failure too)
    assert dev.run_tests([]) == 5
