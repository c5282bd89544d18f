"""Keep the host memory a training step frees, so that the next step does not fault it in again.

A step on CPU frees its gradients together: ``zero_grad()`` sets them to ``None`` (a copy has been added into the
accumulation). glibc's ``malloc`` hands memory at the top of its heap back to the kernel once more than its trim
threshold is free there, and gradient-sized blocks above its mmap threshold are unmapped on ``free``, so the next
``backward()`` has every page of its gradients faulted in and zeroed by the kernel again. On a 5.5M-parameter MLP
(Adam, batch 32, one thread) that was about 3,500 page faults per step and a local step 1.34x as long as a plain
loop that accumulates in ``param.grad``; with the thresholds below, no faults and 1.03x.

A plain loop is spared most of this only because it frees one gradient at a time. GPU memory is kept by torch's
caching allocator; this is about host memory only.

What it changes, once per process, on Linux with glibc: blocks up to 32 MiB come from the heap (glibc's largest
mmap threshold), and up to ``2 x`` the gradients' bytes + 64 MiB of free memory stays in the process. A process
keeps the memory of its largest step instead of giving it back between steps. Nothing is changed where you chose
an allocator yourself: ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or a malloc
tunable in ``GLIBC_TUNABLES`` set, or jemalloc / tcmalloc / mimalloc in ``LD_PRELOAD``. Setting
``MALLOC_TRIM_THRESHOLD_=131072`` (glibc's default) keeps glibc's behaviour.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # the largest mmap threshold glibc accepts on 64-bit systems
HEADROOM = 64 * 2**20  # free memory kept beyond the gradients': activations and temporaries of a step
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_trim_threshold = 0  # what this process set, 0 while nothing was


def allocator_chosen_by_user(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """The environment variable by which the user chose malloc's behaviour, or ``None``."""
    for name in USER_SETTINGS:
        if name in environ:
            return name
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if any(name in environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return "LD_PRELOAD"
    return None


def keep_freed_memory(gradient_bytes: int) -> bool:
    """Make glibc keep freed blocks of a step's size in the process (see the module's docstring).

    Returns whether the thresholds are set as asked now. Called by :class:`~collabopt.CollaborativeOptimizer` for
    parameters on the CPU; a later call for larger gradients raises the trim threshold.

    Example::

        from collabopt.host_memory import keep_freed_memory
        keep_freed_memory(sum(p.numel() * p.element_size() for p in model.parameters()))
    """
    global _trim_threshold
    wanted = min(2 * gradient_bytes + HEADROOM, 2**31 - 1)  # mallopt takes a C int
    if _trim_threshold >= wanted:
        return True
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    chosen = allocator_chosen_by_user()
    if chosen is not None:
        logger.debug("malloc's thresholds left as they are: %s is set", chosen)
        return False
    libc = ctypes.CDLL(None)  # the C library this interpreter is linked against
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, wanted)):
        logger.debug("mallopt refused the thresholds; malloc's are left as they are")
        return False
    _trim_threshold = wanted
    logger.debug("malloc keeps up to %d MiB of freed memory in the process", wanted >> 20)
    return True


def keep_freed_memory_for(params: Iterable[torch.Tensor]) -> bool:
    """:func:`keep_freed_memory` for the gradients of those of ``params`` that live on the CPU (none: no change)."""
    host_bytes = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu")
    return keep_freed_memory(host_bytes) if host_bytes else False
