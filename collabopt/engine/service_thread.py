"""A service of collabopt's own that runs in a thread of the training process with its own asyncio loop: the
averaging service (:mod:`collabopt.engine.averager`) and the state service (:mod:`collabopt.engine.state_service`).

Rules, and why: the loop starts with the service and ends with :meth:`ServiceThread.close` (idempotent); the
service's ``_stop`` coroutine runs first, within ``STOP_TIMEOUT``, and :meth:`ServiceThread._leave` ends it by
closing the service's connection to the daemon and cancelling the loop's other tasks, so that nothing of the service
outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

STOP_TIMEOUT = 10.0  # seconds a service's shutdown waits for its stop coroutine and for its thread


class ServiceThread:
    """The thread and loop of a service; the service defines ``_start()`` and ``_stop()`` (coroutines)."""

    _closed = True  # (until the thread runs)

    def _start_thread(self, name: str, start_timeout: float) -> None:
        """Start the loop in a daemon thread called ``name`` and run ``_start()`` there; a failed start ends it."""
        self._event_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._event_loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._call(self._start(), start_timeout)
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coroutine: Any, timeout: float | None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._event_loop).result(timeout)

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    async def _leave(self, p2p: Any) -> None:
        """Close the service's connection to the daemon and end the loop's other tasks (the end of ``_stop``)."""
        with contextlib.suppress(Exception):
            await p2p.shutdown()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _stop_loop(self) -> None:
        self._event_loop.call_soon_threadsafe(self._event_loop.stop)
        self._thread.join(timeout=STOP_TIMEOUT)
        if not self._thread.is_alive():
            self._event_loop.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the service and end its thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._call(self._stop(), STOP_TIMEOUT)
        self._stop_loop()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ScheduledWork:
    """The part of a scheduled round that the caller's thread shares with the service's loop: ``triggered`` (the
    caller handed its data over, or left), ``group`` (the members, once assembled), ``_future`` (the round's task)
    and ``_trigger`` (the loop's future the data comes through). Subclasses set them and hand data over with
    ``service._event_loop.call_soon_threadsafe(self._set_trigger, value)``."""

    service: Any
    group: Any = None
    triggered: bool = False
    _future: Any = None
    _trigger: asyncio.Future | None = None

    def _set_trigger(self, value: Any) -> None:
        if self._trigger is not None and not self._trigger.done():
            self._trigger.set_result(value)

    def cancel(self) -> None:
        """Leave: matchmaking stops; a group already assembled goes on without this member."""
        self.triggered = True
        self.service._event_loop.call_soon_threadsafe(self._leave)

    def _leave(self) -> None:
        if self.group is None:
            self._future.cancel()
        elif self._trigger is not None and not self._trigger.done():
            self._trigger.cancel()

    def done(self) -> bool:
        return self._future.done()
