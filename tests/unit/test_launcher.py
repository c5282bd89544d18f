"""harness.launcher: a child forked from the launcher is the process ``python script.py`` or
``python -m module`` would be (compared with one started fresh), exits and dies as it would, and a launcher that
is gone is an error, never a silent fallback."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from collabopt import processes
from harness import launcher

PROBE = '''
import json, multiprocessing, os, signal, sys, threading
import collabopt  # first, as in a peer: hivemind's import then warns nothing (on stderr, in the log read as JSON)
import hivemind, numpy, torch
import torch._dynamo  # preloaded by the launcher (a peer's first optimizer imports it); its import sets a variable
import hivemind.utils.logging as hivemind_logging
main = sys.modules["__main__"]
fds = os.listdir("/proc/self/fd")
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv, "path": sys.path, "cwd": os.getcwd(), "env": dict(os.environ),
    "name": __name__, "file": __file__, "main": sorted(vars(main)), "spec": getattr(main.__spec__, "name", None),
    "loader": type(main.__loader__).__name__, "session": os.getsid(0) == os.getpid(),
    "group": os.getpgid(0) == os.getpid(), "stdin": os.readlink("/proc/self/fd/0"),
    "streams": [type(s.buffer).__name__ for s in (sys.stdout, sys.stderr)], "flags": list(sys.flags),
    "fds": len(fds) - 1, "threads": [threading.active_count(), len(os.listdir("/proc/self/task"))],
    "main_thread": threading.current_thread() is threading.main_thread(), "torch_threads": torch.get_num_threads(),
    "process": [multiprocessing.current_process().name, multiprocessing.current_process().daemon],
    "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE)],
    "hivemind_log": [hivemind_logging.loglevel, hivemind_logging.use_colors],
    "seeds": [torch.initial_seed(), int(numpy.random.randint(1 << 30)), hash("collabopt")],
}))
'''


def env(**extra: str) -> dict[str, str]:
    return processes.child_env("ERROR", **extra)


def run(args: list[str], log: Path, fork: bool, environ: dict[str, str], cwd: Path | None = None) -> int | None:
    proc = processes.Process(args, log, env=environ, cwd=cwd, spawn=launcher.spawn if fork else None)
    try:
        return proc.wait(60)
    finally:
        proc.kill_tree()


@pytest.fixture(scope="module", autouse=True)
def _close_launchers():
    """The launchers these tests started end with the module (the swarm tests' stay)."""
    before = set(launcher._launchers)
    yield
    for key in set(launcher._launchers) - before:
        launcher._launchers.pop(key).close()


@pytest.fixture
def light(monkeypatch):
    """Forks from a launcher that imports nothing: how a child is started, runs and ends does not depend on the
    imports, and its children end quickly (one of torch's imports takes a second or two to end)."""
    monkeypatch.setattr(launcher, "PRELOAD", ())


@pytest.mark.parametrize("form", ["script", "module"])
def test_a_forked_child_is_set_up_as_python_would_set_it_up(tmp_path, form):
    scripts, cwd = tmp_path / "scripts", tmp_path / "cwd"
    scripts.mkdir()
    cwd.mkdir()
    (scripts / "probe.py").write_text(PROBE)
    # relative, empty and repeated entries: Python makes them absolute (the empty one: the cwd) and drops repeats
    environ = env(PYTHONPATH=os.pathsep.join(["../scripts", "", str(scripts), "../scripts"]))
    args = [sys.executable, "-m", "probe", "x"] if form == "module" else [sys.executable, "../scripts/probe.py", "x"]
    procs = {name: processes.Process(args, tmp_path / f"{name}.log", env=environ, cwd=cwd,
                                     spawn=launcher.spawn if fork else None)
             for name, fork in (("fresh", False), ("forked", True), ("forked_again", True))}
    seen = {}
    for name, proc in procs.items():
        with proc:
            assert proc.wait(60) == 0, proc.log()
        seen[name] = json.loads(proc.log())
    # a fork has the launcher's string hash seed; torch and numpy are seeded afresh, as in a new process
    fresh, forked = ({k: v for k, v in seen[name].items() if k != "seeds"} for name in ("fresh", "forked"))
    assert forked == fresh
    (torch_a, numpy_a, _), (torch_b, numpy_b, _) = seen["forked"]["seeds"], seen["forked_again"]["seeds"]
    assert torch_a != torch_b and numpy_a != numpy_b
    assert fresh["session"] and fresh["fds"] == 3 and fresh["threads"] == [1, 1]


CASES = {
    "exit": ("import sys; sys.exit(3)", 3),
    "exception": ("raise ValueError('boom')", 1),
    "exit_message": ("import sys; sys.exit('bye')", 1),
    "keyboard_interrupt": ("raise KeyboardInterrupt", -signal.SIGINT),
    "signal": ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    "clean": ("import atexit; atexit.register(print, 'atexit ran')", 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exit_codes_and_logs_are_those_of_a_fresh_process(tmp_path, light, case):
    source, code = CASES[case]
    (tmp_path / "script.py").write_text(source)
    codes, logs = {}, {}
    for fork in (False, True):
        log = tmp_path / f"{fork}.log"
        codes[fork] = run([sys.executable, str(tmp_path / "script.py")], log, fork, env())
        # a forked child's traceback starts in the launcher, which called its code: those frames differ
        logs[fork] = re.sub(r'  File ".*/launcher.py".*\n    .*\n', "", log.read_text())
    assert codes == {False: code, True: code}
    assert logs[True] == logs[False]


def test_a_missing_script_exits_2_with_pythons_message(tmp_path, light):
    logs = {}
    for fork in (False, True):
        assert run([sys.executable, str(tmp_path / "nowhere.py")], tmp_path / f"{fork}.log", fork, env()) == 2
        logs[fork] = (tmp_path / f"{fork}.log").read_text()
    assert logs[True] == logs[False] and "can't open file" in logs[True]


def test_stdout_and_stderr_go_to_the_log_in_order(tmp_path, light):
    (tmp_path / "script.py").write_text("import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')\n")
    assert run([sys.executable, str(tmp_path / "script.py")], tmp_path / "out.log", True, env()) == 0
    assert (tmp_path / "out.log").read_text() == "a\nb\nc\n"


def test_signals_reach_it_and_kill_tree_kills_what_it_started(tmp_path, light):
    (tmp_path / "script.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")
    proc = processes.Process([sys.executable, str(tmp_path / "script.py")], tmp_path / "out.log", env=env(),
                             spawn=launcher.spawn)
    with proc:
        deadline = time.monotonic() + 60
        while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text():
            assert proc.poll() is None, proc.log()
            assert time.monotonic() < deadline, "the script did not start its child within 60 s"
            time.sleep(0.05)
        grandchild = psutil.Process(int((tmp_path / "child").read_text()))
        assert proc.wait(0.2) is None and proc.returncode is None
        proc.signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        assert grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE  # in its process group
        proc.kill_tree()
        with pytest.raises(psutil.Error):
            grandchild.wait(10)
            assert grandchild.status() == psutil.STATUS_ZOMBIE  # its new parent may not reap it
            raise psutil.NoSuchProcess(grandchild.pid)


def test_what_cannot_be_forked_is_refused_before_anything_starts(tmp_path, light):
    log = tmp_path / "out.log"
    for args in (["sleep", "1"], [sys.executable, "-c", "pass"], [sys.executable, "-m"]):
        with pytest.raises(ValueError, match="spawn=None"):
            processes.Process(args, log, env=env(), spawn=launcher.spawn)
    with pytest.raises(ValueError, match="network namespace"):
        processes.Process([sys.executable, "x.py"], log, env=env(), netns="ns", spawn=launcher.spawn)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        launcher.launcher_for(env()).spawn([sys.executable, "x.py"], log, env(OMP_NUM_THREADS="2"))
    with pytest.raises(FileNotFoundError):
        processes.Process([sys.executable, "x.py"], log, env=env(), cwd=tmp_path / "nowhere", spawn=launcher.spawn)


def test_a_launcher_that_is_gone_is_an_error(tmp_path):
    (tmp_path / "script.py").write_text("import time; time.sleep(60)")
    own = launcher.Launcher(env(), preload=())
    child = own.spawn([sys.executable, str(tmp_path / "script.py")], tmp_path / "out.log", env())
    try:
        assert child.poll() is None
        own.popen.kill()
        own.popen.wait()
        with pytest.raises(RuntimeError, match="launcher .* is gone"):
            child.wait(10)
        with pytest.raises(RuntimeError, match="launcher .* is gone"):
            own.spawn([sys.executable, str(tmp_path / "script.py")], tmp_path / "again.log", env())
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        own.close()


def test_one_launcher_serves_every_environment_that_differs_only_in_per_process_variables(tmp_path, light, monkeypatch):
    (tmp_path / "script.py").write_text("pass")
    pids = set()
    for i in range(launcher.MAX_LAUNCHERS + 1):
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"test {i}")
        assert run([sys.executable, str(tmp_path / "script.py")], tmp_path / "out.log", True,
                   env(INITIAL_PEERS=str(i), PYTHONPATH=str(i))) == 0
        pids.add(launcher.launcher_for(env()).popen.pid)
    assert len(pids) == 1
    before = set(launcher._launchers)
    try:
        with pytest.raises(RuntimeError, match="COLLABOPT_TEST_VARIABLE"):
            for i in range(launcher.MAX_LAUNCHERS + 1):
                launcher.launcher_for(env(COLLABOPT_TEST_VARIABLE=str(i)))
    finally:  # the launchers it filled up: the next tests need room for theirs
        for key in set(launcher._launchers) - before:
            launcher._launchers.pop(key).close()


def test_threads_that_ask_at_once_for_a_new_environment_get_one_launcher(light):
    """The GPU check's parts start their processes from threads at once: one launcher per environment still."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda _: launcher.launcher_for(env(COLLABOPT_TEST_THREADS="1")), range(4)))
    assert len({id(one) for one in found}) == 1


def test_every_multiprocessing_lock_hivemind_makes_at_import_is_made_anew_in_each_child():
    """A semaphore made at import (by ``import hivemind``, as the launcher preloads it) is shared by all the
    launcher's children: the list must hold every one (a new hivemind release may add some)."""
    import multiprocessing.synchronize

    import hivemind  # noqa: F401

    found = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("hivemind"):
            continue
        for owner_name, owner in vars(module).items():
            holders = [(None, owner)] + ([(owner_name, owner)] if isinstance(owner, type) else [])
            for holder_name, holder in holders:
                attributes = vars(holder) if holder_name else {owner_name: owner}
                for attribute, value in attributes.items():
                    if isinstance(value, multiprocessing.synchronize.SemLock) and getattr(
                            holder, "__module__", name) == name:
                        found.add((name, holder_name, attribute))
    assert found == set(launcher.IMPORT_LOCKS)


def test_a_child_killed_holding_an_import_lock_does_not_block_the_next_child(tmp_path, monkeypatch):
    """The suite-wide hang: a peer SIGKILLed inside hivemind's SharedBytes lock left every later forked process
    blocked at its first MPFuture."""
    monkeypatch.setattr(launcher, "PRELOAD", ("hivemind",))
    (tmp_path / "holder.py").write_text(
        "import time\nfrom hivemind.utils.mpfuture import SharedBytes, MPFuture\n"
        "from hivemind.utils.asyncio import _AsyncContextWrapper\n"
        "for lock in (SharedBytes._lock, MPFuture._initialization_lock, MPFuture._update_lock,\n"
        "             _AsyncContextWrapper.EXECUTOR_LOCK):\n"
        "    lock.acquire()\n"
        "print('holding', flush=True)\ntime.sleep(60)\n")
    (tmp_path / "next.py").write_text(
        "from hivemind.utils.mpfuture import MPFuture\nfrom hivemind.utils.asyncio import _AsyncContextWrapper\n"
        "MPFuture()\n_AsyncContextWrapper.get_process_wide_executor()\nprint('done', flush=True)\n")
    holder = processes.Process([sys.executable, str(tmp_path / "holder.py")], tmp_path / "holder.log",
                               env=env(OMP_NUM_THREADS="1"), spawn=launcher.spawn)
    with holder:
        deadline = time.monotonic() + 60
        while "holding" not in holder.log():
            assert holder.poll() is None and time.monotonic() < deadline, holder.log()
            time.sleep(0.05)
        holder.signal(signal.SIGKILL)
        assert holder.wait(10) == -signal.SIGKILL
    code = run([sys.executable, str(tmp_path / "next.py")], tmp_path / "next.log", True, env(OMP_NUM_THREADS="1"))
    assert code == 0 and "done" in (tmp_path / "next.log").read_text()


def test_a_child_finds_the_launchers_objects_frozen(tmp_path, light):
    """Frozen before the fork (gc.freeze): a child's collections and exit leave the inherited objects alone."""
    (tmp_path / "script.py").write_text("import gc\nprint(gc.get_freeze_count())\n")
    assert run([sys.executable, str(tmp_path / "script.py")], tmp_path / "out.log", True, env()) == 0
    assert int((tmp_path / "out.log").read_text()) > 0


def test_a_worker_that_exits_now_runs_its_atexit_handlers_and_flushes_its_output(tmp_path):
    """``peer_worker.exit_now``: what the teardown it skips would not have done anyway is done."""
    (tmp_path / "script.py").write_text(
        "import atexit, sys\nfrom pathlib import Path\nfrom peer_worker import exit_now\n"
        f"atexit.register(Path({str(tmp_path / 'atexit')!r}).touch)\n"
        "sys.stdout = open(sys.stdout.fileno(), 'w', buffering=1 << 16, closefd=False)\n"
        "print('buffered', end='')\nexit_now()\nprint('never')\n")
    environ = env(PYTHONPATH=str(Path(__file__).resolve().parents[1] / "swarm"))
    assert run([sys.executable, str(tmp_path / "script.py")], tmp_path / "out.log", False, environ) == 0
    assert (tmp_path / "out.log").read_text() == "buffered"
    assert (tmp_path / "atexit").exists()


def test_modules_preloaded_for_a_child_stay_for_the_next_and_one_that_fails_is_left_to_the_child(tmp_path, light):
    (tmp_path / "script.py").write_text("import sys; print('colorsys' in sys.modules); import no_such_module")
    logs = []
    for preload in (("colorsys", "no_such_module"), ()):
        log = tmp_path / f"{len(logs)}.log"
        proc = processes.Process([sys.executable, str(tmp_path / "script.py")], log, env=env(), spawn=functools.partial(
            launcher.spawn, preload=preload))
        with proc:
            assert proc.wait(60) == 1  # the child's own import fails, as in a fresh process
        logs.append(log.read_text())
    assert all(text.startswith("True\n") and "ModuleNotFoundError" in text for text in logs), logs


def test_what_a_preloaded_module_sets_in_the_environment_at_import_reaches_the_child(tmp_path):
    """As lightning.fabric sets PYTORCH_NVML_BASED_CUDA_CHECK at import: a fresh process's import would set it; in a
    forked child the import is a no-op, so the launcher passes what the preload set (unless the child sets it)."""
    (tmp_path / "setter.py").write_text("import os\nos.environ['COLLABOPT_TEST_SET_AT_IMPORT'] = '1'\n"
                                        "os.environ['COLLABOPT_TEST_OWN'] = 'import'\n")
    (tmp_path / "script.py").write_text("import os, setter\nprint(os.environ.get('COLLABOPT_TEST_SET_AT_IMPORT'),"
                                        " os.environ.get('COLLABOPT_TEST_OWN'))")
    own = launcher.Launcher(env(PYTHONPATH=str(tmp_path), COLLABOPT_TEST_OWN="child"), preload=())
    try:
        child_env = env(PYTHONPATH=str(tmp_path), COLLABOPT_TEST_OWN="child")
        for i in range(2):  # the first child asks for the preload, the next one inherits the module
            log = tmp_path / f"{i}.log"
            proc = own.spawn([sys.executable, str(tmp_path / "script.py")], log, child_env,
                             preload=["setter"] if i == 0 else [])
            assert proc.wait(60) == 0
            assert log.read_text().split() == ["1", "child"]  # (the child's own value stays)
    finally:
        own.close()


def test_a_preload_that_starts_a_thread_ends_the_launcher_before_it_forks(tmp_path):
    (tmp_path / "threader.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(60,),"
                                          " daemon=True).start()\n")
    (tmp_path / "script.py").write_text("pass")
    own = launcher.Launcher(env(PYTHONPATH=str(tmp_path)), preload=())
    try:
        with pytest.raises(RuntimeError, match=r"importing \['threader'\] started 1 threads"):
            own.spawn([sys.executable, str(tmp_path / "script.py")], tmp_path / "out.log", env(), preload=["threader"])
    finally:
        own.close()
