"""Run ``python <script> ...`` or ``python -m <module> ...`` inside a network namespace, as a process forked from the
harness's launcher: ``python tests/net/in_netns.py <namespace> <script or -m module> <args>``.

``ip netns exec`` starts a fresh interpreter, which imports torch and hivemind again (about 2 s of CPU per process;
a network test starts 4 to 6 of them on 2 cores at once). A child forked from the launcher has them imported: it
only moves itself into the namespace (``setns``, as ``ip netns exec`` does; the fork is single-threaded, and
everything it starts afterwards, p2pd included, inherits the namespace) before it opens any socket.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys

CLONE_NEWNET = 0x40000000


def enter(namespace: str) -> None:
    """Move this process into the network namespace ``namespace`` (made by ``ip netns add``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {namespace!r}: {os.strerror(error)}")
    finally:
        os.close(fd)


def main(argv: list[str]) -> None:
    namespace, target, *rest = argv
    enter(namespace)
    sys.orig_argv = [sys.executable, target, *rest]  # the join line a peer prints names its command, not this one
    if target == "-m":
        module, *args = rest
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()  # as `python -m` has it
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *rest]
        sys.path[0] = os.path.dirname(os.path.realpath(target))  # as `python script` has it
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
