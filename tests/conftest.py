"""Fixtures of every test folder."""

import signal
import threading

import pytest


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    """Every test starts with Python's SIGINT handler in the test process, so that the commands a test starts hear
    its Ctrl+C: a child process inherits an ignored SIGINT, and the test process may have one: a suite started as a
    background job of a shell (Python then keeps the ignored disposition it inherits), or hivemind's
    ``DecentralizedAverager.run_in_background`` in a test process."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
