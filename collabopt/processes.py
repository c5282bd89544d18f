"""Child processes of a local swarm: the one harness of ``collabopt demo``, the tests and the benchmarks.

Every process runs in its own session, so that it can be killed with every process it started (hivemind's DHT
and averager processes, the ``p2pd`` daemons): they stay in its process group. Its stdout and stderr go to a log
file that only the child holds open.

A process is started fresh with ``subprocess`` unless a ``spawn`` function is given: the tests pass their launcher's
(``harness/launcher.py``, outside the package), which forks it from a process that imported torch, numpy and
hivemind once and saves each process those imports (1.5 s of CPU); so do the benchmarks under the swarm tests
(``benchmarks.common.spawner``). The demo and the benchmarks start them fresh, as a user would, and so does a
process in a network namespace (``ip netns exec`` is a process of its own).

Standard library only: ``collabopt demo`` uses it, so it must not need the test or benchmark dependencies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Process", "Spawn", "child_env", "start_bootstrap", "stop_all"]

# starts ``args`` with its output in ``log_path``, its environment and cwd, in a session of its own; returns what the
# harness uses of :class:`subprocess.Popen` (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``)
Spawn = Callable[[list[str], Path, dict[str, str], "str | Path | None"], Any]


def child_env(hivemind_loglevel: str = "WARNING", **extra: str) -> dict[str, str]:
    """This process's environment for a child: no inherited ``INITIAL_PEERS``, unbuffered output, one intra-op
    thread unless ``OMP_NUM_THREADS`` is set, ``HIVEMIND_LOGLEVEL`` from the environment or ``hivemind_loglevel``;
    then ``extra``."""
    env = dict(os.environ)
    env.pop("INITIAL_PEERS", None)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HIVEMIND_LOGLEVEL", hivemind_loglevel)
    env.update(extra)
    return env


class Process:
    """A child process in its own session, its stdout and stderr in ``log_path``; ``netns`` runs it inside that
    network namespace (``ip netns exec``, needs root); ``spawn`` starts it instead of :class:`subprocess.Popen`
    (:data:`Spawn`: the tests' launcher). Use as a context manager to kill it on leaving."""

    def __init__(self, args: Sequence[str], log_path: str | Path, *, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None, netns: str | None = None, spawn: Spawn | None = None):
        self.args = list(args)
        self.log_path = Path(log_path)
        self.popen: Any
        if spawn is not None:
            if netns:
                raise ValueError(f"a process in network namespace {netns!r} is started by `ip netns exec`, not by "
                                 f"spawn: pass spawn=None")
            self.popen = spawn(self.args, self.log_path, dict(os.environ) if env is None else env, cwd)
        else:
            prefix = ["ip", "netns", "exec", netns] if netns else []
            # the child gets its own copy of the descriptor: ours is closed at once, nothing is left open here
            with open(self.log_path, "wb") as log:
                self.popen = subprocess.Popen(prefix + self.args, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        self.pid = self.popen.pid

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill_tree()

    def __repr__(self) -> str:
        return f"Process(pid={self.pid}, returncode={self.popen.returncode}, log={str(self.log_path)!r})"

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has been reaped (by :meth:`poll` / :meth:`wait`), else None."""
        return self.popen.returncode

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.popen.poll()

    def wait(self, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` seconds; the exit code, or None if it still runs."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process itself (not its children: it is expected to stop them)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signum)

    def kill_tree(self) -> None:
        """SIGKILL the process and everything in its process group, and reap it. Safe to call again."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # also after the leader exited: its children may still run
        self.wait(10)

    def log(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the log."""
        return self.log()[-chars:]


def stop_all(procs: Iterable[Process], grace: float) -> None:
    """SIGTERM every running process, give them ``grace`` seconds in all to exit, then :meth:`Process.kill_tree`
    each (also the ones that exited: their children may not have)."""
    procs = list(procs)
    for proc in procs:
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        proc.kill_tree()


def start_bootstrap(workdir: str | Path, *, name: str = "bootstrap", host: str = "127.0.0.1",
                    dht_args: Sequence[str] = (), env: dict[str, str] | None = None, cwd: str | Path | None = None,
                    netns: str | None = None, spawn: Spawn | None = None, timeout: float = 60.0
                    ) -> tuple[Process, str]:
    """Start a bootstrap DHT (``python -m collabopt dht``) listening on ``host`` with its log in
    ``<workdir>/<name>.log``; return it and its INITIAL_PEERS value once it serves. ``dht_args``: more options of
    ``collabopt dht`` (e.g. ``["--no-relay"]``); ``spawn``: see :class:`Process`. Raises RuntimeError, the process
    killed, if it exits or does not serve within ``timeout`` seconds."""
    workdir = Path(workdir)
    peers_file = workdir / f"{name}.initial_peers"
    peers_file.unlink(missing_ok=True)
    proc = Process([sys.executable, "-m", "collabopt", "dht", "--host-maddrs", f"/ip4/{host}/tcp/0",
                    "--peers-file", str(peers_file), *dht_args],
                   workdir / f"{name}.log", env=env if env is not None else child_env(), cwd=cwd, netns=netns,
                   spawn=spawn)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if peers_file.exists():  # written whole (renamed into place) by `collabopt dht`
            value = peers_file.read_text().strip()
            if value:
                return proc, value
        if proc.poll() is not None:
            proc.kill_tree()
            raise RuntimeError(f"the bootstrap DHT exited with {proc.returncode}; its log ends with:\n{proc.tail()}")
        time.sleep(0.2)
    proc.kill_tree()
    raise RuntimeError(f"the bootstrap DHT did not serve within {timeout:.0f} s; its log ends with:\n{proc.tail()}")
