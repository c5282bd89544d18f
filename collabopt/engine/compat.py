"""The hivemind versions collabopt supports, and the small facts about hivemind the rest of the package asks.

collabopt's engine composes hivemind's parts and subclasses only its designed extension points (record validators,
authorizers, servicers); those seams were written against the versions below. A hivemind upgrade starts here: add
the version once the suite passes with it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
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

# The seams: every hivemind method that a class of collabopt's overrides, with the SHA-256 (first 12 hex digits) of its
# source in the supported versions. tests/unit/test_seams.py checks that the list is complete and that the installed
# hivemind's sources still hash to these: a release that changes one names it here, and collabopt's override is
# reviewed against the new source before the digest is updated (docs/development.md, "Upgrading hivemind").
SEAMS: dict[str, str] = {
    "hivemind.averaging.matchmaking.Matchmaking.__init__": "40dea3076c71",
    "hivemind.averaging.matchmaking.Matchmaking._request_join_group": "df823040a94d",
    "hivemind.dht.validation.RecordValidatorBase.merge_with": "c98abae78e86",
    "hivemind.dht.validation.RecordValidatorBase.priority": "5daab08584a8",
    "hivemind.dht.validation.RecordValidatorBase.sign_value": "331de153d7f4",
    "hivemind.dht.validation.RecordValidatorBase.strip_value": "89702ffc17a2",
    "hivemind.dht.validation.RecordValidatorBase.validate": "c9c52593d961",
    "hivemind.p2p.servicer.ServicerBase._get_handle_name": "d3e13c74c5e5",
    "hivemind.utils.auth.AuthorizerBase.sign_request": "7490d0f663d0",
    "hivemind.utils.auth.AuthorizerBase.sign_response": "9b9de6bf394d",
    "hivemind.utils.auth.AuthorizerBase.validate_request": "e22167cf5320",
    "hivemind.utils.auth.AuthorizerBase.validate_response": "2b380d477608",
}
# the seams that collabopt relies on rather than overrides: the hivemind method, and what of collabopt's it reads
SEAM_READS: dict[str, str] = {
    # its two reads of request_timeout, the leader's first answer and (following it) its verdict:
    # collabopt.engine.group_search.RoundMatchmaking
    "hivemind.averaging.matchmaking.Matchmaking._request_join_group": "request_timeout",
}

__all__ = ["HIVEMIND_REQUEST_TIMEOUT", "SEAMS", "SEAM_READS", "SUPPORTED_HIVEMIND", "Multiaddr",
           "changed_seams", "check_compression", "dht_time", "hivemind_supported", "is_dht", "is_hivemind_object",
           "optimizer_parameter_names", "seam_digest", "versions"]


def hivemind_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed hivemind's) is one collabopt supports."""
    return (version or hivemind.__version__) in SUPPORTED_HIVEMIND


@functools.lru_cache(maxsize=1)
def optimizer_parameter_names() -> frozenset[str]:
    """Names of ``hivemind.Optimizer.__init__``'s arguments."""
    return frozenset(inspect.signature(hivemind.Optimizer.__init__).parameters) - {"self"}


def seam_digest(name: str) -> str | None:
    """The digest (as in :data:`SEAMS`) of the installed hivemind's source of ``name``, "module.Class.method";
    None where it has no such method."""
    module_name, class_name, attribute = name.rsplit(".", 2)
    try:
        function = vars(getattr(importlib.import_module(module_name), class_name))[attribute]
    except (ImportError, AttributeError, KeyError):
        return None
    function = function.fget if isinstance(function, property) else getattr(function, "__func__", function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def changed_seams() -> dict[str, str | None]:
    """The seams whose source differs in the installed hivemind: each name with its digest now (None: gone)."""
    return {name: now for name, digest in SEAMS.items() if (now := seam_digest(name)) != digest}


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
