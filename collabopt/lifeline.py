"""hivemind's helper processes end when the training process dies, even by SIGKILL.

A collabopt peer is a training process plus the processes hivemind forks from it: the DHT process (which runs the
p2pd daemon) and one process per averager. When the training process is killed outright (SIGKILL, the OOM killer, a
crash that skips cleanup), nothing tells them: they lived on as orphans, and the DHT's p2pd kept the peer's identity,
so restarting the peer with the same ``identity_path`` failed with "Identity ... is already taken by another peer".

Inside :func:`children_follow_parent`, every process forked from the main thread asks Linux to send it SIGTERM when
its parent dies (``PR_SET_PDEATHSIG``); on SIGTERM it terminates its own children (p2pd) and exits. Elsewhere than
Linux this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # (Linux; resolved here: a child between fork and exec calls it)
except (OSError, AttributeError):
    _prctl = None
_active = 0
_hooked = False
_fork_parent: int | None = None  # set before a fork from the main thread inside children_follow_parent()


@contextlib.contextmanager
def children_follow_parent() -> Iterator[None]:
    """Processes forked from the main thread inside this block end when this process ends, however it ends."""
    global _active, _hooked
    if not _hooked and hasattr(os, "register_at_fork") and os.path.isdir("/proc/self"):
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _hooked = True
    _active += 1
    try:
        yield
    finally:
        _active -= 1


def _before_fork() -> None:
    global _fork_parent
    # the parent-death signal follows the forking *thread*: only forks from the main thread use it
    from_main = threading.current_thread() is threading.main_thread()
    _fork_parent = os.getpid() if _active and from_main else None


def _after_fork_in_child() -> None:
    parent = _fork_parent
    if parent is None or not sigterm_when_parent_dies():
        return
    signal.signal(signal.SIGTERM, _end_with_children)
    if os.getppid() != parent:  # the parent died before prctl took effect
        _end_with_children(signal.SIGTERM, None)


def sigterm_when_parent_dies() -> bool:
    """Ask Linux to send this process SIGTERM when the thread that forked it ends (``PR_SET_PDEATHSIG``); False
    where it cannot (not Linux). The caller checks ``os.getppid()`` afterwards: a parent that ended before sends
    nothing. Fit for between fork and exec: libc's ``prctl`` is resolved at import, so the child loads nothing."""
    return _prctl is not None and _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0


def _end_with_children(signum: int, frame: object) -> None:
    """Terminate this process's children (p2pd under the DHT process), then exit at once."""
    for pid in children(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    os._exit(128 + signum)


def children(pid: int) -> list[int]:
    """The process ids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found
