"""collabopt: train one PyTorch model together across unreliable machines.

A framework-agnostic wrapper around hivemind. See :class:`CollaborativeOptimizer`.
"""

from collabopt import _quiet_imports  # noqa: F401  (first: hivemind's import without its warnings)
from collabopt.batch_size import ForwardSampleCounter, infer_batch_size
from collabopt.config import CollabConfig
from collabopt.errors import CollaborativeError, ConfigurationError, SwarmConnectionError, SwarmKeyError
from collabopt.interface import RoundOutcome, StepResult, SwarmOptimizer
from collabopt.lifecycle import Terminated
from collabopt.node import NodeOptimizer, collaborative_optimizer
from collabopt.optimizer import CollaborativeOptimizer
from collabopt.optimizer import wait_for_peers as wait_for_peers  # deprecated: copt.wait_for_peers(n)
from collabopt.scheduling import CollaborativeScheduler
from collabopt.swarm import parse_initial_peers
from collabopt.version import __version__

__all__ = [
    "CollabConfig",
    "CollaborativeError",
    "CollaborativeOptimizer",
    "CollaborativeScheduler",
    "ConfigurationError",
    "ForwardSampleCounter",
    "NodeOptimizer",
    "RoundOutcome",
    "StepResult",
    "SwarmConnectionError",
    "SwarmKeyError",
    "SwarmOptimizer",
    "Terminated",
    "collaborative_optimizer",
    "infer_batch_size",
    "parse_initial_peers",
    "__version__",
]
