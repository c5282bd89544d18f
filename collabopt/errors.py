"""Exceptions raised by collabopt.

Every error names the parameter that was wrong and says how to fix it, and configuration errors are raised
before any network activity starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class _Drop:
    """The value of an option that a suggested fix leaves out (see :attr:`ConfigurationError.fixes`)."""

    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()


class CollaborativeError(RuntimeError):
    """Base class of collabopt errors."""


class ConfigurationError(CollaborativeError, ValueError):
    """A bad argument or an unsupported combination of arguments.

    Raised before any DHT or averager process starts. The message names the parameter and the fix.

    Attributes:
        parameter: the argument that was wrong (several, comma-separated, for a combination).
        problem: what is wrong with it.
        fix: how to fix it, in words.
        fixes: the same fix as data, where it is a change of arguments: one mapping per alternative, the first
            being the one the message leads with; each maps an argument to its new value, or to :data:`DROP` for
            one to leave out. Applied to the arguments that raised the error, each one gives arguments that are
            accepted (as far as this error's checks go). Empty where the fix is not a change of arguments.
    """

    def __init__(self, parameter: str, problem: str, fix: str, *, fixes: Sequence[Mapping[str, Any]] = ()):
        self.parameter, self.problem, self.fix = parameter, problem, fix
        self.fixes = [dict(changes) for changes in fixes]
        super().__init__(f"{parameter}: {problem}. Fix: {fix}")


def apply_fix(arguments: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` with one of :attr:`ConfigurationError.fixes` applied (:data:`DROP` leaves an argument out)."""
    fixed = dict(arguments)
    for name, value in changes.items():
        if value is DROP:
            fixed.pop(name, None)
        else:
            fixed[name] = value
    return fixed


class SwarmConnectionError(CollaborativeError, ConnectionError):
    """The swarm could not be joined (for example, no initial peer answered)."""


class SwarmKeyError(SwarmConnectionError):
    """The swarm refused this peer's ``swarm_key``: another key, none where the swarm needs one, or one where the
    swarm is open. Raised as the peer starts, before its first step."""


class ModelMismatchError(CollaborativeError):
    """This peer's model is not the swarm's: a parameter's shape or dtype differs from the state the swarm serves.

    Raised before this peer installs anything of that state, and from then on it takes no part: averaging tensors
    of other shapes cannot work, and a peer that trained on alone would look like a working one.

    Attributes:
        index: the position of the first differing parameter (in the optimizer's order).
        name: its name in the model (``None`` where this peer does not know it).
        local: its shape and dtype here, e.g. ``"(48, 32) torch.float32"``.
        swarm: its shape and dtype in the swarm's state (``"none"``: the swarm's state has fewer tensors).
    """

    def __init__(self, index: int, name: str | None, local: str, swarm: str, source: str = "the swarm's state"):
        self.index, self.name, self.local, self.swarm = index, name, local, swarm
        label = f"parameter {index}" + (f" ({name})" if name else "")
        super().__init__(
            f"this peer's model is not the swarm's: {label} is {local} here and {swarm} in {source}. Fix: run the "
            f"same model definition as the swarm (the same layers, sizes and dtypes), or use another run_id to "
            f"train this model in a swarm of its own")
