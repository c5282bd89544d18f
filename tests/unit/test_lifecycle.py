"""Interrupts that Python drops in a finalizer are raised at the next step (collabopt.lifecycle)."""

from __future__ import annotations

import gc

import pytest

from collabopt import lifecycle


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (pytest's hook, which ours calls)
def test_an_interrupt_dropped_in_a_finalizer_is_raised_later_and_only_once():
    lifecycle.keep_lost_interrupts()

    def generator():
        try:
            yield 1
        finally:
            raise KeyboardInterrupt  # as a SIGINT that arrives while the generator is finalized

    started = generator()
    next(started)
    del started  # Python prints "Exception ignored in: <generator ...>" and drops the KeyboardInterrupt
    gc.collect()
    with pytest.raises(KeyboardInterrupt):
        lifecycle.raise_lost_interrupt()
    lifecycle.raise_lost_interrupt()  # nothing left


def test_nothing_is_raised_without_a_lost_interrupt():
    lifecycle.keep_lost_interrupts()
    lifecycle.keep_lost_interrupts()  # installed once
    lifecycle.raise_lost_interrupt()


def test_sigterm_raises_within_the_block_after_the_handler_that_was_set():
    """Lightning's SIGTERM handler only sets a flag: a finished peer's final wait still ends at once."""
    import os
    import signal

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with pytest.raises(lifecycle.Terminated), lifecycle.sigterm_raises():
            os.kill(os.getpid(), signal.SIGTERM)  # (a signal to this process is handled before kill returns)
        assert seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # the flag-only handler is back
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_raises_can_run_another_handler_instead_and_not_raise():
    """A node's rank other than 0 in Lightning's final wait: only a flag is recorded (Lightning's handler, which
    broadcasts on the default group, does not run), and no Terminated is raised (rank 0's reaches it)."""
    import os
    import signal

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("lightning"))
    try:
        with lifecycle.sigterm_raises(instead=lambda: seen.append("instead"), raises=False):
            os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["instead"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_raises_leaves_a_handler_set_from_c_alone(monkeypatch):
    """signal.getsignal returns None for a handler set from C: it can be neither chained nor restored."""
    import signal

    monkeypatch.setattr(signal, "getsignal", lambda signum: None)
    monkeypatch.setattr(signal, "signal", lambda *args: pytest.fail("the handler was replaced"))
    with lifecycle.sigterm_raises():
        pass
