"""The hivemind versions collabopt supports, and the small facts about hivemind the rest of the package asks.

collabopt's engine composes hivemind's parts and, at documented seams, subclasses a few of them; those seams were
written against the versions below. A hivemind upgrade starts here: add the version once the suite passes with it.
"""

from __future__ import annotations

import functools
import inspect
import platform
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

try:  # hivemind >= 1.1.11 vendors its multiaddr implementation
    from hivemind.utils.multiaddr import Multiaddr
except ImportError:  # pragma: no cover - older layouts
    from multiaddr import Multiaddr

SUPPORTED_HIVEMIND = ("1.1.12",)
HIVEMIND_REQUEST_TIMEOUT = 3.0  # hivemind's default averager request_timeout (seconds)

__all__ = ["HIVEMIND_REQUEST_TIMEOUT", "SUPPORTED_HIVEMIND", "Multiaddr", "SameHandlers", "check_compression",
           "dht_time", "hivemind_supported", "is_dht", "is_hivemind_object", "optimizer_parameter_names", "versions"]


def hivemind_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed hivemind's) is one collabopt supports."""
    return (version or hivemind.__version__) in SUPPORTED_HIVEMIND


@functools.lru_cache(maxsize=1)
def optimizer_parameter_names() -> frozenset[str]:
    """Names of ``hivemind.Optimizer.__init__``'s arguments."""
    return frozenset(inspect.signature(hivemind.Optimizer.__init__).parameters) - {"self"}


def is_dht(obj: Any) -> bool:
    return isinstance(obj, hivemind.DHT)


def is_hivemind_object(obj: Any) -> bool:
    return type(obj).__module__.startswith("hivemind")


def check_compression(value: Any) -> bool:
    from hivemind.compression import CompressionBase

    return isinstance(value, CompressionBase)


def dht_time() -> float:
    return get_dht_time()


def versions() -> dict[str, str]:
    """Versions a peer publishes: collabopt, hivemind, torch, Python."""
    from collabopt.version import __version__

    return dict(collabopt=__version__, hivemind=hivemind.__version__, torch=torch.__version__.split("+")[0],
                python=platform.python_version())


class SameHandlers:
    """A mixin for subclasses of a hivemind averager: serve and call its RPCs under the names of hivemind's class.
    hivemind names a servicer's handlers after its class (``ServicerBase._get_handle_name``): a subclass would
    answer only peers running the same subclass (no round, no state download with plain hivemind or an older
    collabopt). See docs/decisions.md, "Handlers under hivemind's names"."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        hivemind_class = next(base for base in cls.__mro__ if base.__module__.startswith("hivemind."))
        handle_name = f"{hivemind_class.__name__}.{method_name}"
        return handle_name if namespace is None else f"{namespace}::{handle_name}"
