"""The command line without a swarm: its exit statuses (0 done or help, 1 a runtime error in one line, 2 a usage
error, 130 Ctrl+C, the same in every command), its help, and bad input refused before anything starts."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import collabopt.cli as cli
from collabopt import __version__
from collabopt.errors import CollaborativeError, SwarmConnectionError

ROOT = Path(__file__).resolve().parents[2]
MADDR = "/ip4/127.0.0.1/tcp/31337/p2p/QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4"
COMMANDS = ("demo", "dht", "doctor", "monitor", "keygen")


def collabopt(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m collabopt ARGS`` with -W default: a warning anything raises at import would show on stderr."""
    environ = {k: v for k, v in os.environ.items() if k not in ("INITIAL_PEERS", "HIVEMIND_LOGLEVEL")} | env
    return subprocess.run([sys.executable, "-W", "default", "-m", "collabopt", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------- 0: done, or help


def test_version_prints_the_version_and_nothing_else():
    proc = collabopt("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"collabopt {__version__}\n", "")


def test_help_is_exit_status_0_and_lists_each_command_once(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for name in COMMANDS:
        assert text.count(f"collabopt {name} ") == 1, name
        assert f"\n    {name} " not in text, f"{name} listed a second time"
    assert cli.main([]) == 0  # a bare `collabopt`: what it can do, not an error
    assert "collabopt doctor --initial-peers" in capsys.readouterr().out


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_a_description_its_defaults_and_log_level(capsys, name):
    assert cli.main([name, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    description = text.split(" options: ")[0].split("] ")[-1]
    assert len(description) > 40, f"collabopt {name} --help has no description: {text[:300]}"
    assert "--log-level LEVEL" in text and "(default: None)" not in text and "(default: False)" not in text
    if name in ("demo", "doctor", "monitor"):
        assert "(default: 10.0)" in text or "(default: 2.0)" in text or "(default: 3)" in text, text


def test_the_monitor_takes_only_the_options_it_uses(capsys):
    for option in ("--identity-path", "--use-ipfs", "--announce-maddrs", "--use-auto-relay", "--port",
                   "--client-mode", "--relay-peers"):
        assert cli.main(["monitor", "--run-id", "r", "--initial-peers", MADDR, option, "x"]) == 2, option
        assert f"unrecognized arguments: {option}" in capsys.readouterr().err
    assert cli.main(["monitor", "--help"]) == 0
    assert "--no-relay" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["dht", "doctor", "monitor"])
def test_the_network_switches_are_the_examples_ones(name):
    """One definition (collabopt.network_args): each command's network switch has the examples' help (its default
    said once) and type; the commands differ only in which switches they take."""
    from collabopt.network_args import SWITCHES, add_network_arguments

    def switches(parser):
        return {a.dest: (a.option_strings, a.nargs, a.type, a.default, a.help) for a in parser._actions
                if a.dest in SWITCHES}

    command = cli.build_parser()._subparsers._group_actions[0].choices[name]
    taken = {"dht": cli.DHT_SWITCHES, "doctor": cli.DOCTOR_SWITCHES, "monitor": cli.MONITOR_SWITCHES}[name]
    assert switches(command) == switches(add_network_arguments(argparse.ArgumentParser(), taken))
    assert set(switches(command)) == set(taken) and "initial_peers" in taken


def test_a_command_reads_the_switches_environment_variables(monkeypatch):
    """As the examples do: $COLLABOPT_PORT fixes the bootstrap peer's port, and a switch wins over its variable."""
    seen = []

    def started(options):
        seen.append(options)
        raise SwarmConnectionError("stop here")

    monkeypatch.setattr("collabopt.swarm.start_dht", started)
    monkeypatch.delenv("INITIAL_PEERS", raising=False)
    monkeypatch.delenv("COLLABOPT_SWARM_KEY", raising=False)
    monkeypatch.setenv("COLLABOPT_PORT", "31337")
    monkeypatch.setenv("COLLABOPT_IDENTITY_PATH", "bootstrap.key")
    assert cli.main(["dht"]) == 1
    assert seen[-1].host_maddrs == ["/ip4/0.0.0.0/tcp/31337"] and seen[-1].identity_path == "bootstrap.key"
    assert cli.main(["dht", "--port", "4001"]) == 1
    assert seen[-1].host_maddrs == ["/ip4/0.0.0.0/tcp/4001"]
    monkeypatch.setenv("COLLABOPT_PORT", "http")
    assert cli.main(["dht"]) == 2  # a bad value: a usage error naming the variable
    # the monitor takes no identity and no port: their variables are not read there (else "http" would be exit 2)
    assert cli.main(["monitor", "--run-id", "r", "--initial-peers", MADDR, "--count", "1"]) == 1
    assert seen[-1].identity_path is None and seen[-1].client_mode


# ---------------------------------------------------------------- 2: a usage error


def test_a_bad_option_is_exit_status_2(capsys):
    assert cli.main(["demo", "--peers", "three"]) == 2
    assert "argument --peers: invalid int value: 'three'" in capsys.readouterr().err
    assert cli.main(["nonsense"]) == 2


def test_cli_refuses_bad_peers_before_starting():
    proc = collabopt("dht", "--initial-peers", "/ip4/1.2.3/tcp/1")
    assert proc.returncode == 2
    assert "--initial-peers" in proc.stderr and "Fix:" in proc.stderr and "Traceback" not in proc.stderr


def test_monitor_without_initial_peers_says_what_to_pass():
    proc = collabopt("monitor", "--run-id", "x")
    assert proc.returncode == 2
    assert proc.stderr.startswith("collabopt monitor: --initial-peers: none given") and "Fix:" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


# ---------------------------------------------------------------- 1: a runtime error, in one line


def _raise(error: BaseException):
    def command(*_args, **_kwargs):
        raise error

    return command


def test_a_runtime_error_is_exit_status_1_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr("collabopt.membership.new_swarm_key", _raise(SwarmConnectionError("no peer answered")))
    assert cli.main(["keygen"]) == 1
    assert capsys.readouterr().err == "collabopt keygen: no peer answered\n"
    monkeypatch.setattr("collabopt.membership.new_swarm_key", _raise(OSError("network\nunreachable")))
    assert cli.main(["keygen"]) == 1
    assert capsys.readouterr().err == ("collabopt keygen: OSError: network unreachable "
                                       "(--log-level DEBUG shows the traceback)\n")


@pytest.fixture
def log_levels(monkeypatch):
    """--log-level sets the level of this process's loggers and $HIVEMIND_LOGLEVEL: put back after the test."""
    import hivemind.utils.logging as hivemind_logging

    monkeypatch.setenv("HIVEMIND_LOGLEVEL", os.environ.get("HIVEMIND_LOGLEVEL", "INFO"))
    monkeypatch.setattr(hivemind_logging, "loglevel", hivemind_logging.loglevel)
    levels = {name: logging.getLogger(name).level for name in ("hivemind", "collabopt")}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_log_level_debug_adds_the_traceback(monkeypatch, capsys, log_levels):
    monkeypatch.setattr("collabopt.membership.new_swarm_key", _raise(CollaborativeError("it broke")))
    assert cli.main(["keygen", "--log-level", "debug"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.endswith("collabopt keygen: it broke\n")
    assert logging.getLogger("hivemind").level == logging.getLogger("collabopt").level == logging.DEBUG
    assert os.environ["HIVEMIND_LOGLEVEL"] == "DEBUG"  # for the processes a command starts


class FakeDHT:
    def __init__(self, alive=lambda: True):
        self.is_alive, self.stopped = alive, False

    def get_visible_maddrs(self):
        return [MADDR]

    def shutdown(self):
        self.stopped = True


class FakePeerProcess:
    returncode = None

    def poll(self):
        return None


def test_the_demo_timing_out_is_one_line_with_the_fix(monkeypatch, capsys):
    clock = iter(range(0, 10_000, 10))  # seconds: each look at the clock, 10 s later
    dht = FakeDHT()
    monkeypatch.setattr("collabopt.swarm.start_dht", lambda options: dht)
    monkeypatch.setattr("collabopt.processes.Process", lambda *args, **kwargs: FakePeerProcess())
    monkeypatch.setattr("collabopt.processes.stop_all", lambda procs, grace: None)
    monkeypatch.setattr("collabopt.metrics.read_swarm_progress", lambda dht, run_id: dict(
        num_peers=1, global_epoch=0, samples_accumulated=0, samples_per_second=0.0))
    monkeypatch.setattr("collabopt.demo.time", types.SimpleNamespace(monotonic=lambda: next(clock),
                                                                      sleep=lambda seconds: None))
    assert cli.main(["demo", "--timeout", "60", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["collabopt demo: the peers did not finish within 90 s. Fix: on a busy or slow "
                                "machine, give them longer (--timeout 300) or fewer epochs (--epochs)"], err
    assert dht.stopped


# ---------------------------------------------------------------- 130: Ctrl+C, in every command


def _interrupt():
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", ["demo", "dht", "doctor", "monitor", "monitor --serve", "keygen"])
def test_ctrl_c_is_exit_status_130_in_every_command(monkeypatch, capsys, command):
    """Where the command waits for Ctrl+C (the dht's and the monitor's loops, the demo's progress loop, the
    doctor's checks), KeyboardInterrupt reaches main(), and what the command started is stopped."""
    monkeypatch.delenv("INITIAL_PEERS", raising=False)
    monkeypatch.delenv("COLLABOPT_SWARM_KEY", raising=False)
    dht = FakeDHT(alive=_interrupt)
    monkeypatch.setattr("collabopt.swarm.start_dht", lambda options: dht)
    monkeypatch.setattr("collabopt.processes.Process", lambda *args, **kwargs: FakePeerProcess())
    monkeypatch.setattr("collabopt.processes.stop_all", lambda procs, grace: None)
    monkeypatch.setattr("collabopt.metrics.read_swarm_progress", _raise(KeyboardInterrupt()))
    monkeypatch.setattr("collabopt.doctor.run_checks", _raise(KeyboardInterrupt()))
    monkeypatch.setattr("collabopt.membership.new_swarm_key", _raise(KeyboardInterrupt()))
    args = {"monitor": ["--run-id", "r", "--initial-peers", MADDR],
            "monitor --serve": ["--run-id", "r", "--initial-peers", MADDR, "--serve", "127.0.0.1:0"],
            "doctor": ["--initial-peers", MADDR], "demo": ["--no-progress"]}.get(command, [])
    assert cli.main([command.split()[0], *args]) == 130
    assert capsys.readouterr().err.endswith(f"collabopt {command.split()[0]}: interrupted\n")
    assert dht.stopped or command in ("doctor", "keygen")


# ---------------------------------------------------------------- quiet import


def test_importing_collabopt_prints_nothing_and_leaves_the_warning_filters_alone():
    """hivemind's import warns (torch.jit.script is deprecated: a FutureWarning from torch 2.14 on): collabopt
    silences exactly that warning while it imports hivemind, not for the program that imports collabopt."""
    code = ("import warnings, collabopt._quiet_imports as quiet\n"
            "ours = {message for _, message, _ in quiet.HIVEMIND_IMPORT_WARNINGS}\n"
            "left = [f for f in warnings.filters if f[1] is not None and f[1].pattern in ours]\n"
            "assert not left, left\n")
    proc = subprocess.run([sys.executable, "-W", "default", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_monitor_report_of_a_run_nobody_trains_says_to_check_the_run_id():
    text = cli.report_text(dict(run_id="typo", num_peers=0, global_epoch=0, samples_accumulated=0,
                                samples_per_second=0.0, peers=[]))
    assert text.splitlines()[0] == "run typo: 0 peers, epoch 0, 0 samples this epoch, 0.0 samples/s"
    assert "is --run-id the run_id the peers use?" in text
