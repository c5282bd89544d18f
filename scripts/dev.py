#!/usr/bin/env python3
"""Set up a virtual environment in .venv (first run only) and run the demo or the tests.

    python3 scripts/dev.py demo      # a local swarm of 3 peers trains a digits classifier
    python3 scripts/dev.py test      # the whole test suite (unit tests on 2 workers, then the swarms one at a time)
    python3 scripts/dev.py bench     # the benchmarks (writes benchmarks/results/)
    python3 scripts/dev.py docs      # serve the documentation site on http://127.0.0.1:8000 (mkdocs serve)
    python3 scripts/dev.py gpu-check   # the prepared GPU check (benchmarks/gpu_check.py); CPU smoke without CUDA
    python3 scripts/dev.py gpu-wheels  # the wheels the lent GPU machine lacks, into wheels/gpu/ (git-ignored)

Only Python >= 3.10 is needed. torch is installed pinned (TORCH_SPEC, default torch==2.13.0) when the
environment has none; set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get the CPU-only build
on a machine where pip would otherwise pull a large CUDA build. COLLABOPT_VENV names another environment
(default .venv): with TORCH_SPEC, that runs the tests on another torch without touching .venv, e.g. the unit
tests on torch 2.14.1 (the CI and .venv use 2.13.0; both pass):

    COLLABOPT_VENV=/tmp/venv214 TORCH_SPEC=torch==2.14.1 python3 scripts/dev.py test -m "not swarm and not net"

A TORCH_SPEC of the form torch==X that the environment's torch does not match is an error, not a silent run on
the other version.

gpu-check and gpu-wheels never create or install anything: they run with .venv's Python when there is a .venv, else
with the Python running this script. The lent GPU machine has no network and no .venv (it is git-ignored and not
carried), so there gpu-check runs with its system python3 once the carried wheels and collabopt are installed;
benchmarks/gpu_wheels.py gives the exact device command.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("COLLABOPT_VENV", ROOT / ".venv"))
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
EXTRAS = {"demo": "demo", "test": "all", "bench": "all", "docs": "docs"}


def run(*args: str, **kwargs) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True, **kwargs)


def has_module(module: str) -> bool:
    return subprocess.run([str(PYTHON), "-c", f"import {module}"], capture_output=True).returncode == 0


def check_torch(spec: str) -> None:
    """Exit when TORCH_SPEC pins torch==X and the environment holds another torch (installed before, by another
    spec): the run would not test the version asked for."""
    wanted = spec.replace(" ", "").partition("torch==")[2]
    if not spec.replace(" ", "").startswith("torch==") or not wanted:
        return
    found = subprocess.run([str(PYTHON), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                           capture_output=True, text=True).stdout.strip()
    if found.split("+")[0] != wanted.split("+")[0]:
        sys.exit(f"TORCH_SPEC={spec} but {VENV} holds torch {found}: set COLLABOPT_VENV to a new directory for "
                 f"an environment with torch {wanted}, or remove {VENV}")


def ensure_env(extra: str) -> None:
    if sys.version_info < (3, 10):  # noqa: UP036 - this script runs before anything is installed
        sys.exit(f"collabopt needs Python >= 3.10, this is {sys.version.split()[0]}")
    if not PYTHON.exists():
        print(f"creating a virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if not has_module("torch"):
        index = os.environ.get("TORCH_INDEX_URL")
        run(*pip, os.environ.get("TORCH_SPEC", "torch==2.13.0"), *(["--index-url", index] if index else []))
    check_torch(os.environ.get("TORCH_SPEC", ""))
    stamp = VENV / f".collabopt-{extra}-installed"
    pyproject = ROOT / "pyproject.toml"
    if not stamp.exists() or stamp.stat().st_mtime < pyproject.stat().st_mtime:
        run(*pip, "-e", f"{ROOT}[{extra}]")
        stamp.touch()


# Arguments that only change what a run reports: with nothing else, `test` runs its two stages with them
REPORTING = re.compile(r"-q+|-v+|-r\w*|--tb=\w+|--color=\w+|--durations=\d+|--durations-min=[\d.]+|-p(?=.)\S+")
TAKES_A_VALUE = {"--durations", "--durations-min", "-p", "--tb", "--color"}


def stages_apply(rest: list[str]) -> bool:
    """Whether ``rest`` holds reporting options only (see REPORTING): any other argument (a test selection, -x, --lf,
    --pdb, a report file, ...) means one plain pytest run, as the user wrote it."""
    args = iter(rest)
    for arg in args:
        if arg in TAKES_A_VALUE:
            if next(args, None) is None:
                return False
        elif not REPORTING.fullmatch(arg):
            return False
    return True


def run_tests(rest: list[str]) -> int:
    """The whole suite in two stages: the tests without a swarm on two workers (pytest-xdist), then the swarm and
    network tests one at a time (two swarms side by side would share the cores and their timings). Any argument but
    a reporting one (:func:`stages_apply`) runs one plain pytest with the arguments instead. The exit status is the
    first stage's failure, else the second's; both stages run."""
    pytest = [str(PYTHON), "-m", "pytest"]
    if stages_apply(rest):
        stages = [[*pytest, "tests", "-m", "not swarm and not net", "-n", "2", *rest],
                  [*pytest, "tests", "-m", "swarm or net", *rest]]
    else:
        stages = [[*pytest, *rest]]
    codes = []
    for cmd in stages:
        print("+", shlex.join(cmd), flush=True)
        codes.append(subprocess.run(cmd, cwd=ROOT).returncode)
    return next((code for code in codes if code), 0)


GPU_COMMANDS = {"gpu-check": "benchmarks.gpu_check", "gpu-wheels": "benchmarks.gpu_wheels"}


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else "demo"
    rest = sys.argv[2:]
    if command in GPU_COMMANDS:  # no environment set-up: see the module docstring
        python = str(PYTHON) if PYTHON.exists() else sys.executable
        cmd = [python, "-m", GPU_COMMANDS[command], *rest]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=ROOT).returncode
    if command not in EXTRAS:
        commands = "|".join([*EXTRAS, *GPU_COMMANDS])
        sys.exit(f"usage: python3 scripts/dev.py {{{commands}}} [args...]  (got {command!r})")
    ensure_env(EXTRAS[command])
    if command == "demo":
        cmd = [str(PYTHON), "-m", "collabopt", "demo", *rest]
    elif command == "test":
        return run_tests(rest)
    elif command == "docs":  # extra arguments go to mkdocs serve, e.g. --dev-addr 0.0.0.0:8000
        cmd = [str(PYTHON), "-m", "mkdocs", "serve", "--config-file", str(ROOT / "mkdocs.yml"), *rest]
        os.environ["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's banner about its successor
    else:
        cmd = [str(PYTHON), "-m", "benchmarks.run", *rest]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
