"""A pre-started launcher ("zygote") for the tests and the benchmarks they run: it imports torch, numpy and hivemind
once, then forks each child from itself, so that a child does not pay those imports (1.5 s of CPU each, and the
tests start hundreds). :func:`spawn` is the ``spawn`` of :class:`collabopt.processes.Process`.

A forked child is set up as ``python script.py args`` or ``python -m module args`` would be: its own session (so
that killing its process group kills hivemind's processes and p2pd with it), stdin from /dev/null, stdout and
stderr to its log file, its cwd, its environment, ``sys.argv``, ``sys.path`` (``[0]`` and PYTHONPATH as Python
sets them), a fresh ``__main__``, fresh seeds for ``random``, numpy and torch; it runs in its main thread and ends
as a Python process ends (exit code, or death by a signal, reported as :class:`subprocess.Popen` reports it).

What a fork cannot redo is what the imports read from the environment (OMP_NUM_THREADS, HIVEMIND_LOGLEVEL, PYTHON*
flags, ...): a launcher serves only children whose environment equals its own, except :data:`PER_PROCESS`;
:func:`launcher_for` starts one launcher per distinct environment. A child's PYTHONPATH applies to what it imports,
not to the preloaded modules; the string hash seed is the launcher's, shared by its children. A child may name
modules to preload for it (``preload``: Lightning, whose import costs 2.3 s of CPU, for the Lightning workers): the
launcher imports them before it forks that child, and keeps them for the children after it. The launcher forks
only while it has one thread (checked after each import: a fork copies only the forking thread) and never runs a
torch op.

The client side (:class:`Launcher`, :class:`Forked`) is standard library only; the launcher process runs this file.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["IMPORT_LOCKS", "MAX_LAUNCHERS", "PER_PROCESS", "PRELOAD", "Forked", "Launcher", "launcher_for", "spawn"]

# torch._dynamo: torch.optim.Optimizer imports it at the first optimizer a process builds (1.5-4 s of CPU, more
# than torch itself), and every peer builds one
PRELOAD = ("numpy", "torch", "torch._dynamo", "hivemind")
# (module, class, attribute) of the multiprocessing locks the preloaded modules make at import: semaphores a fork
# shares with every sibling, so each child gets its own (:func:`_fresh_import_locks`)
IMPORT_LOCKS = (("hivemind.utils.mpfuture", "SharedBytes", "_lock"),
                ("hivemind.utils.mpfuture", "MPFuture", "_initialization_lock"),
                ("hivemind.utils.mpfuture", "MPFuture", "_update_lock"),
                ("hivemind.utils.asyncio", "_AsyncContextWrapper", "EXECUTOR_LOCK"))
# variables no preloaded module reads at import: they may differ between a launcher's children
PER_PROCESS = frozenset({"PYTHONPATH", "INITIAL_PEERS", "PYTEST_CURRENT_TEST", "COLLABOPT_BENCHMARK_FORK"})
MAX_LAUNCHERS = 6  # each holds ~360 MB: a variable that differs in every child must not start one per child
_MESSAGE = 1 << 20
# in a launcher: the variables its preloaded modules set at import (lightning.fabric sets PYTORCH_NVML_BASED_CUDA_CHECK
# so that torch's CUDA check does not break a later fork); a child's environment gets those it does not set itself,
# as its own import would have made them (the import is a no-op in a child that inherited the module)
_IMPORT_ENV: dict[str, str] = {}
_launchers: dict[tuple[object, ...], Launcher] = {}
_launchers_lock = threading.Lock()  # threads that start children at once (the GPU check's parts) share one


def launcher_for(env: dict[str, str]) -> Launcher:
    """The running launcher (of the modules in :data:`PRELOAD`) for children with environment ``env``; started on
    first use, closed at exit."""
    key = (PRELOAD, *sorted((k, v) for k, v in env.items() if k not in PER_PROCESS))
    with _launchers_lock:
        return _launcher(key, env)


def _launcher(key: tuple[object, ...], env: dict[str, str]) -> Launcher:
    if key not in _launchers:
        if len(_launchers) >= MAX_LAUNCHERS:
            first = next(iter(_launchers.values())).env
            differ = sorted(k for k in set(env) | set(first) if k not in PER_PROCESS and env.get(k) != first.get(k))
            raise RuntimeError(f"{MAX_LAUNCHERS} launchers run already, for environments that differ in {differ}: "
                               "if no preloaded module reads such a variable at import, add it to PER_PROCESS")
        _launchers[key] = Launcher({k: v for k, v in env.items() if k not in PER_PROCESS}, PRELOAD)
    return _launchers[key]


def spawn(args: Sequence[str], log_path: str | Path, env: dict[str, str], cwd: str | Path | None = None,
          preload: Sequence[str] = ()) -> Forked:
    """Fork ``args`` from the launcher for ``env`` (:func:`launcher_for`, :meth:`Launcher.spawn`)."""
    return launcher_for(env).spawn(args, log_path, env, cwd, preload)


@atexit.register
def _close_all() -> None:
    for launcher in _launchers.values():
        launcher.close()


class Launcher:
    """A launcher process with environment ``env`` that imports the modules ``preload`` (its log:
    ``<tempdir>/collabopt-launcher-*.log``). Raises RuntimeError, the process killed, if it does not start within
    ``timeout`` seconds."""

    def __init__(self, env: dict[str, str], preload: Sequence[str] = PRELOAD, timeout: float = 120.0):
        self.env = dict(env)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log_path = Path(tempfile.gettempdir()) / f"collabopt-launcher-{os.getpid()}-{id(self)}.log"
        with theirs, open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen([sys.executable, __file__, *preload], stdin=theirs, stdout=log,
                                          stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self._sock.settimeout(timeout)
        try:
            ready = self._sock.recv(16)
        except TimeoutError:
            ready = b""
        if ready != b"ready":
            self.popen.kill()
            self.popen.wait()
            raise RuntimeError(f"the test process launcher did not start; its log {self.log_path} ends with:\n"
                               f"{self._tail()}")
        self._sock.settimeout(None)

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def died(self) -> RuntimeError:
        """The error for a launcher that is gone: its children cannot be started or followed."""
        code = self.popen.poll()
        return RuntimeError(f"the test process launcher (pid {self.popen.pid}) is gone (exit code {code}); its "
                            f"children can no longer be started or followed. Its log {self.log_path} ends with:\n"
                            f"{self._tail()}")

    def spawn(self, args: Sequence[str], log_path: str | Path, env: dict[str, str],
              cwd: str | Path | None = None, preload: Sequence[str] = ()) -> Forked:
        """Fork ``args`` (``[sys.executable, script, ...]`` or ``[sys.executable, "-m", module, ...]``) with stdout
        and stderr to ``log_path``, once the launcher imported the modules ``preload`` (a module that fails to
        import is left to the child). Raises ValueError for other arguments or an ``env`` that is not this launcher's,
        OSError where :class:`subprocess.Popen` would (a missing cwd)."""
        args = [str(arg) for arg in args]
        script = len(args) >= 2 and not args[1].startswith("-")
        module = len(args) >= 3 and args[1] == "-m"
        if args[0] != sys.executable or not (script or module):
            raise ValueError(f"the launcher starts `{sys.executable} script ...` or `{sys.executable} -m module ...`"
                             f", not {args}: start this process without it (spawn=None)")
        differ = sorted(k for k in set(env) | set(self.env) if k not in PER_PROCESS and env.get(k) != self.env.get(k))
        if differ:
            raise ValueError(f"environment variables {differ} differ from this launcher's: use launcher_for(env)")
        request = {"args": args, "env": env, "cwd": str(Path(cwd or os.getcwd()).absolute()), "preload": list(preload)}
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, open(log_path, "wb") as log:
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [log.fileno(), theirs.fileno()])
            except OSError:
                mine.close()
                raise self.died() from None
        reply = _receive(mine)
        if reply is None:
            mine.close()
            raise self.died()
        if "error" in reply:
            mine.close()
            raise OSError(reply["errno"], reply["error"], request["cwd"])
        return Forked(self, args, reply["pid"], mine)

    def close(self) -> None:
        """End the launcher and remove its log (its children run on: they are killed as any process is)."""
        self._sock.close()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self.log_path.unlink(missing_ok=True)


def _receive(sock: socket.socket) -> dict[str, Any] | None:
    """The next message on ``sock``, or None at its end."""
    try:
        data = sock.recv(_MESSAGE)
    except ConnectionError:
        return None
    return json.loads(data) if data else None


class Forked:
    """A child of a launcher, with what the harness uses of :class:`subprocess.Popen`: ``pid``, ``returncode``,
    :meth:`poll`, :meth:`wait`, :meth:`send_signal`. Its exit status comes from the launcher, which reaps it."""

    def __init__(self, launcher: Launcher, args: list[str], pid: int, status: socket.socket):
        self.launcher, self.args, self.pid = launcher, args, pid
        self.returncode: int | None = None
        self._status = status

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        with selectors.DefaultSelector() as sel:
            sel.register(self._status, selectors.EVENT_READ)
            if not sel.select(timeout):
                return
        reply = _receive(self._status)
        self._status.close()
        if reply is None:
            raise self.launcher.died()
        self.returncode = os.waitstatus_to_exitcode(reply["status"])

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; raises :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


# ---- the launcher process ----


def _serve(ctrl: socket.socket) -> tuple[dict[str, Any], int] | None:
    """Fork a child per request on ``ctrl`` and report its pid, then its wait status. Returns in a child (its
    request and its handshake descriptor, everything else of the launcher closed), or None once the harness is gone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup descriptor hears of children
    children: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as sel:
        sel.register(ctrl, selectors.EVENT_READ)
        sel.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 512):
                            pass
                    _reap(children)
                    continue
                data, fds, _, _ = socket.recv_fds(ctrl, _MESSAGE, 2)
                if not data:
                    return None
                log_fd, status = fds[0], socket.socket(fileno=fds[1])
                request = json.loads(data)
                _preload(request["preload"], required=False)
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: keep only the log and the handshake
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for sock in (ctrl, status, *children.values()):
                        sock.close()
                    for fd in (wake_r, wake_w, ready_r):
                        os.close(fd)
                    _setup(request, log_fd, ready_w)
                    return request, ready_w
                os.close(log_fd)
                os.close(ready_w)
                with open(ready_r, "rb") as ready:
                    error = ready.read()  # empty once the child closed it: in its session, with its files and cwd
                try:
                    if error:
                        os.waitpid(pid, 0)
                        errno, _, message = error.decode().partition(" ")
                        status.send(json.dumps({"errno": int(errno), "error": message}).encode())
                        status.close()
                    else:
                        status.send(json.dumps({"pid": pid}).encode())
                        children[pid] = status
                except OSError:  # the harness dropped this child: nobody to tell
                    status.close()
                _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        sock = children.pop(pid, None)
        if sock is not None:
            with contextlib.suppress(OSError):  # the harness dropped this child: nobody to tell
                sock.send(json.dumps({"status": status}).encode())
            sock.close()


def _setup(request: dict[str, Any], log_fd: int, ready_w: int) -> None:
    """In the child: its session, descriptors and cwd (errors go back through ``ready_w``, and the child exits)."""
    try:
        os.setsid()
        os.dup2(log_fd, 1)  # stdin is the launcher's, /dev/null
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.chdir(request["cwd"])
    except OSError as exc:
        os.write(ready_w, f"{exc.errno} {exc.strerror}".encode())
        os._exit(127)


def _run(request: dict[str, Any], ready_w: int, base_path: list[str]) -> None:
    """In the child: become ``python <args>`` and run it, as its ``__main__``."""
    import builtins
    import importlib.machinery
    import random
    import runpy
    import types

    os.close(ready_w)
    args = request["args"]
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in _IMPORT_ENV.items():
        os.environ.setdefault(key, value)
    pythonpath = os.environ.get("PYTHONPATH")  # made absolute, an empty entry is the cwd
    extra = [os.path.abspath(entry) for entry in pythonpath.split(os.pathsep)] if pythonpath else []
    module = args[2] if args[1] == "-m" else None
    first = os.getcwd() if module else os.path.dirname(os.path.realpath(args[1]))
    sys.path[:] = [first, *dict.fromkeys(extra + base_path)]
    sys.argv = ["-m", *args[3:]] if module else args[1:]
    sys.orig_argv = list(args)
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    _fresh_import_locks()
    main = types.ModuleType("__main__")
    main.__builtins__, main.__annotations__ = builtins, {}
    sys.modules["__main__"] = main
    if module:
        runpy._run_module_as_main(module)  # what `python -m` runs
        return
    path = os.path.join(os.getcwd(), args[1])  # as Python sets __file__: absolute, not normalized
    try:
        with open(path, "rb") as file:
            source = file.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        sys.exit(2)
    main.__file__, main.__cached__ = path, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    exec(compile(source, path, "exec"), main.__dict__)


def _fresh_import_locks() -> None:
    """In the child: new locks for :data:`IMPORT_LOCKS`, as a fresh import makes. The launcher's are shared by all
    its children, and one killed while holding one (a test's SIGKILL) blocked every sibling at its next use: the
    rest of a suite hung (reproduced with ``SharedBytes._lock``)."""
    import multiprocessing

    for module_name, owner, attribute in IMPORT_LOCKS:
        module = sys.modules.get(module_name)
        if module is not None:
            setattr(getattr(module, owner), attribute, multiprocessing.Lock())


def _preload(names: Sequence[str], required: bool) -> None:
    """In the launcher: import ``names`` (those not ``required`` only if they import), check it is still
    single-threaded (else it exits: it cannot fork), freeze what they made."""
    import importlib

    new = [name for name in names if name not in sys.modules]
    before = dict(os.environ)
    for name in new:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  # the child's own import fails as it would in a fresh process
            if required:
                raise
    _IMPORT_ENV.update({key: value for key, value in os.environ.items() if before.get(key) != value})
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        sys.exit(f"importing {new} started {len(threads) - 1} threads (OMP_NUM_THREADS is "
                 f"{os.environ.get('OMP_NUM_THREADS')!r}; set it to 1): a fork would copy a process whose other "
                 "threads are gone")
    gc.freeze()  # children neither scan nor write (copy) the preloaded objects: see docs/decisions.md, "Exit"


def _main() -> None:
    """The launcher process: import, check it is single-threaded, say ready, serve; in a child, run it."""
    del sys.path[0]  # this file's folder: not on a child's path
    _preload(sys.argv[1:], required=True)
    ctrl = socket.socket(fileno=os.dup(0))  # the harness's end, handed over as stdin; the children's is /dev/null
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    base_path = list(sys.path)
    ctrl.send(b"ready")
    served = _serve(ctrl)
    if served is not None:
        _run(served[0], served[1], base_path)


if __name__ == "__main__":
    _main()
