"""Signal handling around hivemind: restore SIGINT, turn SIGTERM into a clean shutdown."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Terminated(SystemExit):
    """Raised in the main thread when the process receives SIGTERM, so that ``with`` blocks close cleanly."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def preserved_sigint() -> Iterator[None]:
    """Building hivemind's DHT/averagers sets SIGINT to ignored in this process: put the old handler back."""
    if not in_main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


class SigtermHandler:
    """Installs a SIGTERM handler that raises :class:`Terminated` (only where the default action was set)."""

    def __init__(self) -> None:
        self._previous: Any = None
        self.installed = False

    def install(self) -> None:
        if in_main_thread() and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._previous = signal.signal(signal.SIGTERM, _raise_terminated)
            self.installed = True

    def restore(self) -> None:
        if self.installed and in_main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self.installed = False


@contextlib.contextmanager
def sigterm_raises(instead: Callable[[], None] | None = None, raises: bool = True) -> Iterator[None]:
    """Within the block, SIGTERM runs the handler that was set (or ``instead``, where given), then raises
    :class:`Terminated` (unless ``raises=False``). Reason: a framework whose handler only sets a flag (Lightning's)
    checks it between batches; a wait after the last batch (a finished peer serving its final state) would not end on
    SIGTERM. ``instead`` is for a handler that must not run there (Lightning's broadcasts on the default group with
    several processes, while the node's other ranks wait in another group). Where SIGTERM is ignored or has a
    handler set from C (which cannot be chained or restored), or off the main thread, nothing changes."""
    previous = signal.getsignal(signal.SIGTERM) if in_main_thread() else signal.SIG_IGN
    if previous in (signal.SIG_IGN, None):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if instead is not None:
            instead()
        elif callable(previous):
            previous(signum, frame)
        if raises:
            raise Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# An interrupt (SIGINT's KeyboardInterrupt, SIGTERM's Terminated) raised while Python runs a finalizer is printed
# ("Exception ignored in: <generator ...>") and dropped: the signal is lost and training goes on. hivemind's
# accumulate_grads_ finalizes a generator at every step; a fresh-clone suite lost a SIGINT there (the peer was still
# training 10 s later). Such an interrupt is kept here and raised at the next step().
_lost_interrupts: list[BaseException] = []
_previous_unraisablehook = sys.unraisablehook


def _keep_lost_interrupts(unraisable: Any) -> None:
    if isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
        _lost_interrupts.append(unraisable.exc_value)
    _previous_unraisablehook(unraisable)


def keep_lost_interrupts() -> None:
    """Install the hook that keeps interrupts dropped in finalizers, unless it is installed; it chains to the hook
    that was there."""
    global _previous_unraisablehook
    if sys.unraisablehook is not _keep_lost_interrupts:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _keep_lost_interrupts


def raise_lost_interrupt() -> None:
    """Raise an interrupt that a finalizer dropped since the last call (see :func:`keep_lost_interrupts`)."""
    if _lost_interrupts:
        lost = _lost_interrupts[0]
        _lost_interrupts.clear()
        raise lost
