"""Signal handling around hivemind: restore SIGINT, turn SIGTERM into a clean shutdown."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
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
