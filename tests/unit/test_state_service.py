"""collabopt's state service (collabopt/engine/state_service.py) without a swarm: a wait for the service's loop ends
on SIGTERM (collabopt.Terminated) or Ctrl+C and cancels what it waited for. Serving and downloading between two
peers: tests/swarm/test_state_serving.py."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from collabopt import Terminated
from collabopt.engine.state_service import StateService


@pytest.mark.parametrize("interrupt", [Terminated, KeyboardInterrupt])
def test_an_interrupt_ends_a_wait_on_the_service_and_cancels_it(interrupt):
    service = StateService.__new__(StateService)
    service._event_loop = asyncio.new_event_loop()
    service._thread = threading.Thread(target=service._event_loop.run_forever, daemon=True)
    service._thread.start()
    cancelled = threading.Event()

    async def a_long_download():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def on_alarm(signum, frame):
        raise interrupt()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(interrupt):
            service._call(a_long_download(), 60)
        assert cancelled.wait(5.0), "the coroutine the wait was for goes on"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        service._stop_loop()
