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
