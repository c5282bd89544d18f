"""Exceptions raised by collabopt.

Every error names the parameter that was wrong and says how to fix it, and configuration errors are raised
before any network activity starts.
"""

from __future__ import annotations


class CollaborativeError(RuntimeError):
    """Base class of collabopt errors."""


class ConfigurationError(CollaborativeError, ValueError):
    """A bad argument or an unsupported combination of arguments.

    Raised before any DHT or averager process starts. The message names the parameter and the fix.
    """

    def __init__(self, parameter: str, problem: str, fix: str):
        self.parameter, self.problem, self.fix = parameter, problem, fix
        super().__init__(f"{parameter}: {problem}. Fix: {fix}")


class SwarmConnectionError(CollaborativeError, ConnectionError):
    """The swarm could not be joined (for example, no initial peer answered)."""


class SwarmKeyError(SwarmConnectionError):
    """The swarm refused this peer's ``swarm_key``: another key, none where the swarm needs one, or one where the
    swarm is open. Raised as the peer starts, before its first step."""
