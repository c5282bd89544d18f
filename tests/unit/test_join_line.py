"""The join line a first peer prints (a command that works pasted into a shell without an activated environment) and
the network switches the examples share (collabopt.network_args)."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from collabopt import ConfigurationError
from collabopt.network_args import add_network_arguments, network_options
from collabopt.swarm import command_line, join_message

PEER = "/ip4/10.0.0.2/tcp/31337/p2p/QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4"
# prints its own join command and the interpreter running it: run once as launched, then as pasted
PRINTER = "import sys\nfrom collabopt.swarm import command_line\nprint(command_line())\nprint(sys.executable)\n"


def pasted(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """``line`` run as a user pastes it: a plain shell, no activated environment, nothing but the system PATH."""
    return subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", f"HOME={os.environ.get('HOME', '/')}", "bash", "-c",
                           line], cwd=cwd, capture_output=True, text=True, timeout=120)


def launched(args: list[str], cwd: Path) -> list[str]:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


@pytest.mark.parametrize("launch", ["script", "module", "console script"])
def test_the_printed_command_works_pasted_into_a_plain_shell(tmp_path, launch):
    """However the peer was started, the command it prints runs the same program with the same interpreter (the
    project's virtual environment) and arguments, in a shell with no environment activated."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(PRINTER)
    script = tmp_path / "bin" / "train-peer"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n{PRINTER}")
    script.chmod(0o755)
    args = {"script": [sys.executable, "pkg/train.py"], "module": [sys.executable, "-m", "pkg.train"],
            "console script": [str(script)]}[launch] + ["--run-id", "two words"]
    command, interpreter = launched(args, tmp_path)
    assert command.endswith("--run-id 'two words'"), command
    if launch == "module":
        assert " -m pkg.train " in command
    elif launch == "console script":
        assert command.startswith("bin/train-peer "), command
    again = pasted(command, tmp_path)
    assert again.returncode == 0, (command, again.stderr[-2000:])
    assert again.stdout.splitlines() == [command, interpreter], command


def test_the_interpreter_is_the_running_one_relative_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("")
    assert command_line(["python", "train.py", "--lr", "0.1"], str(venv_python)) == ".venv/bin/python train.py --lr 0.1"
    outside = "/opt/env with space/bin/python3"
    assert command_line(["python3", "train.py"], outside) == "'/opt/env with space/bin/python3' train.py"
    assert command_line(["python3", str(tmp_path / "sub" / "t.py")], outside).endswith(" sub/t.py")
    assert command_line(["python3", "/elsewhere/t.py"], outside).endswith(" /elsewhere/t.py")
    # an interpreter in the working directory itself runs as ./python, not a `python` looked up on PATH
    (tmp_path / "python").write_text("")
    assert command_line(["python", "t.py"], str(tmp_path / "python")) == "./python t.py"


def test_interpreter_options_and_modules_are_kept_and_what_cannot_be_repeated_is_generic():
    exe = "/usr/bin/python3"
    assert command_line(["python", "-u", "-W", "ignore", "-m", "pkg.train", "-x"], exe) == \
        "/usr/bin/python3 -u -W ignore -m pkg.train -x"
    assert command_line(["python", "-mpkg.train", "--lr", "1"], exe) == "/usr/bin/python3 -m pkg.train --lr 1"
    generic = "/usr/bin/python3 your_script.py"
    for argv in (["python", "-c", "import x"], ["python"], ["python", "-"], ["python", "-i", "t.py"],
                 ["python", "-m", "ipykernel_launcher", "-f", "kernel.json"]):
        assert command_line(argv, exe) == generic, argv


def test_the_join_message_shows_the_command_and_a_fixed_port():
    message = join_message([f"/ip4/10.0.0.2/tcp/31337/p2p/{PEER.rsplit('/', 1)[1]}"], "digits",
                           command=".venv/bin/python examples/pytorch_loop.py --port 31337")
    line = message.splitlines()[1].strip()
    assert line == f"INITIAL_PEERS={PEER} .venv/bin/python examples/pytorch_loop.py --port 31337"
    assert shlex.split(line)[1:3] == [".venv/bin/python", "examples/pytorch_loop.py"]


# ---- the examples' network switches


def parse(*argv: str, environ: dict[str, str] | None = None) -> dict:
    parser = add_network_arguments(argparse.ArgumentParser())
    return network_options(parser.parse_args(list(argv)), environ=environ or {})


def test_nothing_given_passes_nothing_and_collabopts_defaults_hold():
    assert parse() == {}


def test_each_switch_sets_its_option():
    assert parse("--port", "31337", "--announce-maddrs", "/ip4/203.0.113.5/tcp/31337", "--identity-path", "k.key",
                 "--initial-peers", f"{PEER},{PEER}") == dict(
        initial_peers=[PEER, PEER], host_maddrs=["/ip4/0.0.0.0/tcp/31337"],
        announce_maddrs=["/ip4/203.0.113.5/tcp/31337"], identity_path="k.key")
    assert parse("--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--client-mode") == dict(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
    assert parse("--relay-peers", PEER) == dict(relay_peers=[PEER])


def test_environment_variables_are_read_when_the_switch_is_not_given():
    environ = dict(COLLABOPT_PORT="4001", COLLABOPT_CLIENT_MODE="1", INITIAL_PEERS=PEER)
    assert parse(environ=environ) == dict(initial_peers=[PEER], host_maddrs=["/ip4/0.0.0.0/tcp/4001"],
                                          client_mode=True)
    assert parse("--port", "5001", environ=environ)["host_maddrs"] == ["/ip4/0.0.0.0/tcp/5001"]
    assert parse(environ=dict(COLLABOPT_CLIENT_MODE="0")) == {}


@pytest.mark.parametrize("argv, environ, named", [
    (["--port", "31337", "--host-maddrs", "/ip4/0.0.0.0/tcp/1"], {}, "--port"),
    (["--client-mode", "--relay-peers", PEER], {}, "--client-mode"),
    ([], dict(COLLABOPT_PORT="http"), "$COLLABOPT_PORT"),
    ([], dict(COLLABOPT_CLIENT_MODE="maybe"), "$COLLABOPT_CLIENT_MODE"),
    (["--relay-peers", "/ip4/1.2.3.4/tcp/1"], {}, "--relay-peers"),
    (["--announce-maddrs", "not-an-address"], {}, "--announce-maddrs"),
])
def test_bad_values_name_the_switch_or_variable(argv, environ, named):
    with pytest.raises(ConfigurationError) as error:
        parse(*argv, environ=environ)
    assert error.value.parameter == named and error.value.fix


def test_a_bad_port_switch_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        parse("--port", "70000")
    assert stop.value.code == 2 and "--port" in capsys.readouterr().err
