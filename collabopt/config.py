"""One frozen configuration of a peer: every option validated once, before any network starts.

Where it sits: :class:`~collabopt.CollaborativeOptimizer` (the core), :class:`~collabopt.node.NodeOptimizer` (several
ranks as one peer) and every adapter (``collabopt.integrations.*``) turn their keyword arguments into a
:class:`CollabConfig` with :meth:`CollabConfig.from_options`; its :data:`OPTION_NAMES` are the names they accept.
The config builds hivemind's arguments (:meth:`CollabConfig.hivemind_arguments`) and the DHT's
(:meth:`CollabConfig.swarm_options`). The rules between options, each refusal with a fix that leads to a config
that is accepted, are in :mod:`collabopt.option_rules`. Objects (optimizer, scheduler, model, dht) are checked by the
``check_*`` functions here and stay arguments of the constructors.

    >>> config = CollabConfig.from_options(run_id="demo", target_batch_size=4096, matchmaking_time=2.0)
    >>> config.hivemind_arguments()["averager_opts"]
    {'request_timeout': 1.0}
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from collabopt import option_rules
from collabopt.diloco_options import SparseLoCo
from collabopt.engine import compat
from collabopt.engine.averaging import gradient_averager_factory
from collabopt.engine.robust_averaging import aggregation_options
from collabopt.errors import DROP, ConfigurationError
from collabopt.membership import swarm_key_from
from collabopt.option_rules import positive_int, positive_number
from collabopt.swarm import DhtOptions, SwarmOptions, parse_initial_peers, validate_listen_maddrs

DEFAULT_NODE_TIMEOUT = 24 * 3600.0  # seconds other ranks of a node may wait for rank 0 (matchmaking, download)
# hivemind.Optimizer arguments collabopt sets itself (never accepted from users)
_MANAGED_BY_COLLABOPT = frozenset({"dht", "run_id", "target_batch_size", "batch_size_per_step", "optimizer", "params",
                                   "scheduler", "client_mode"})
# DHT options (cannot be combined with a dht= the caller owns)
_SWARM_FIELDS = ("initial_peers", "host_maddrs", "announce_maddrs", "identity_path", "client_mode", "use_ipfs",
                 "bootstrap_timeout", "relay_peers", "swarm_key")


@dataclass(frozen=True, kw_only=True)
class CollabConfig(DhtOptions):
    """Options of one peer (see docs/options.md). Build it with :meth:`from_options`, which also
    accepts any other ``hivemind.Optimizer`` argument (kept in ``hivemind_options``)."""

    run_id: str
    target_batch_size: int
    batch_size: int | None = None  # fixed samples per step (per rank on a node), when nothing else tells
    # ---- DHT: the fields of DhtOptions, and where INITIAL_PEERS come from when not given
    initial_peers_env: Sequence[str] = ("INITIAL_PEERS",)
    # ---- hivemind.Optimizer
    reuse_grad_buffers: bool = False
    offload_optimizer: bool = False
    delay_optimizer_step: bool = False
    delay_grad_averaging: bool = False
    delay_state_averaging: bool = False
    use_local_updates: bool = False
    auxiliary: bool = False
    matchmaking_time: float = 5.0
    averaging_timeout: float = 30.0
    load_state_timeout: float = 600.0
    average_state_every: int = 1
    verbose: bool = False
    hivemind_options: Mapping[str, Any] = field(default_factory=dict)
    # ---- collabopt
    nonfinite_guard: bool = True  # refuse NaN/inf gradients and averaging results (collabopt/guard.py)
    load_state_on_start: bool = True
    handle_signals: bool = True
    print_join_message: bool = True
    node_timeout: float = DEFAULT_NODE_TIMEOUT
    # callable(params) -> torch optimizer: DiLoCo mode, your optimizer steps locally (collabopt/diloco.py)
    outer_optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None = None
    overlap_rounds: bool = False  # DiLoCo mode: a round's all-reduce runs while inner steps go on
    # "mean" (hivemind's) or "centered_clip": robust to a hostile member (collabopt/engine/robust_averaging.py)
    aggregation: str = "mean"
    # DiLoCo mode: SparseLoCo(...) sends the top-k of each chunk at 2 bits, with error feedback (diloco_options.py)
    pseudo_gradient_compression: SparseLoCo | None = None

    @classmethod
    def from_options(cls, **options: Any) -> CollabConfig:
        """Split ``options`` into collabopt's own and other ``hivemind.Optimizer`` arguments; refuse the rest."""
        own = {f.name for f in dataclasses.fields(cls)} - {"hivemind_options"}
        mine = {name: value for name, value in options.items() if name in own}
        extra = {name: value for name, value in options.items() if name not in own}
        for name in extra:
            if name not in hivemind_option_names():
                raise option_rules.unknown_option(name, options[name], option_names())
        for name, example in (("run_id", "my_experiment"), ("target_batch_size", 4096)):
            if name not in mine:
                raise ConfigurationError(name, "is required", f"pass e.g. {name}={example!r}",
                                         fixes=[{name: example}])
        return cls(**mine, hivemind_options=extra)

    def __post_init__(self) -> None:
        option_rules.check(self.option_values(), _defaults())  # each error with a fix that leads to a valid config
        # DHT options: parsed now (bad addresses fail here), normalized in place
        if self.initial_peers is not None:  # the environment variable is read when a DHT is started
            object.__setattr__(self, "initial_peers", parse_initial_peers(self.initial_peers, env_vars=()))
        object.__setattr__(self, "host_maddrs", validate_listen_maddrs(self.host_maddrs, "host_maddrs"))
        object.__setattr__(self, "announce_maddrs", validate_listen_maddrs(self.announce_maddrs, "announce_maddrs"))
        # parsed now (a malformed key fails here); the environment variable is read when a DHT is started
        object.__setattr__(self, "swarm_key", swarm_key_from(self.swarm_key, environment=False))
        self.validate()  # the DHT options

    def option_values(self) -> dict[str, Any]:
        """Every option by name: the fields and the other ``hivemind.Optimizer`` arguments (what the rules read)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "hivemind_options"}
        return {**self.hivemind_options, **fields}

    # ------------------------------------------------------------------ what the config builds

    def swarm_options(self) -> SwarmOptions:
        """Options of the DHT this peer starts (when it owns one); ``initial_peers`` default to the environment."""
        dht_options = {f.name: getattr(self, f.name) for f in dataclasses.fields(DhtOptions)}
        dht_options["initial_peers"] = parse_initial_peers(self.initial_peers, env_vars=self.initial_peers_env)
        dht_options["swarm_key"] = swarm_key_from(self.swarm_key)  # (or $COLLABOPT_SWARM_KEY)
        return SwarmOptions(**dht_options)

    def swarm_options_given(self) -> list[str]:
        """DHT options set to something other than their default (refused together with a dht= you own)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name in _SWARM_FIELDS if getattr(self, name) not in (defaults[name], None)]

    @property
    def updates_in_background(self) -> bool:
        """Whether hivemind applies optimizer steps or averaging results outside the step that triggered them."""
        return self.delay_optimizer_step or self.delay_state_averaging or self.use_local_updates

    @property
    def needs_optimizer_factory(self) -> bool:
        """Whether hivemind builds its own optimizer (offloaded or delayed steps) from a factory."""
        return self.offload_optimizer or self.delay_optimizer_step or self.delay_grad_averaging

    def hivemind_arguments(self) -> dict[str, Any]:
        """``hivemind.Optimizer`` keyword arguments, without ``dht``, ``optimizer``/``params`` and ``client_mode``.

        A ``matchmaking_time`` of 3 s or less gets ``averager_opts["request_timeout"] = matchmaking_time / 2``
        unless set (hivemind's 3 s join-request timeout must stay below the matchmaking time, or matchmaking can
        deadlock), and the gradient averager gets the same request timeout.
        """
        extra = dict(self.hivemind_options)
        averager_opts = extra.get("averager_opts")
        request_timeout = (averager_opts or {}).get("request_timeout")
        if request_timeout is None and self.matchmaking_time <= compat.HIVEMIND_REQUEST_TIMEOUT:
            request_timeout = self.matchmaking_time / 2
            extra["averager_opts"] = dict(averager_opts or {}, request_timeout=request_timeout)
        robust = aggregation_options(self.aggregation)  # (none for "mean")
        if robust:  # the state averager's parameter rounds aggregate as the gradient rounds do, and it installs
            # only downloaded states most of the swarm holds (collabopt.engine.download_votes)
            extra["averager_opts"] = dict(extra.get("averager_opts") or {}, **robust, verify_downloads=True)
            # and no record's claims alone end an epoch (collabopt.robust.cap_progress_claims)
            extra["tracker_opts"] = dict(extra.get("tracker_opts") or {}, cap_claims=True)
        if not self.use_local_updates:  # (collabopt's averager, also where no request timeout is set)
            extra["grad_averager_factory"] = gradient_averager_factory(
                extra.get("grad_averager_factory"), request_timeout, **robust)
        return dict(
            run_id=self.run_id,
            target_batch_size=self.target_batch_size if not self.auxiliary else 1,
            batch_size_per_step=None,
            reuse_grad_buffers=self.reuse_grad_buffers,
            offload_optimizer=self.offload_optimizer,
            delay_optimizer_step=self.delay_optimizer_step,
            delay_grad_averaging=self.delay_grad_averaging,
            delay_state_averaging=self.delay_state_averaging,
            use_local_updates=self.use_local_updates,
            auxiliary=self.auxiliary,
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            load_state_timeout=self.load_state_timeout,
            average_state_every=self.average_state_every,
            verbose=self.verbose,
            **extra,
        )


def _defaults() -> dict[str, Any]:
    """The default of every option that has one (what a fix that drops an option leaves)."""
    return {f.name: f.default for f in dataclasses.fields(CollabConfig) if f.default is not dataclasses.MISSING}


REFERENCE_LINK_BYTES_PER_SECOND = 10e6 / 8  # 10 Mbit/s: a slow home uplink (sizes next_chunk_timeout)


def sized_next_chunk_timeout(tensor_bytes: int, matchmaking_time: float, averaging_timeout: float) -> float:
    """collabopt's default ``next_chunk_timeout``: the time a 10 Mbit/s link takes to move a peer's share of an
    all-reduce both ways (about twice ``tensor_bytes``), at least ``matchmaking_time`` (hivemind's default) and at
    most a third of ``averaging_timeout`` (hivemind leaves out a reducer silent for twice the timeout: that must
    happen before the whole round times out).

    During an all-reduce a sender's next part, and a reducer's next result, wait behind everything queued on a
    saturated link; hivemind leaves out a member that pauses longer than this (a partial round). With hivemind's
    ``matchmaking_time`` (3 s), 4 peers with 18 MB of gradients at 20 Mbit/s had partial rounds at nearly every
    epoch, none with 15 s (docs/performance.md). Small models keep ``matchmaking_time``.

        >>> sized_next_chunk_timeout(18_000_000, matchmaking_time=3.0, averaging_timeout=120.0)
        28.8
        >>> sized_next_chunk_timeout(600_000, matchmaking_time=3.0, averaging_timeout=30.0)
        3.0
    """
    needed = 2 * tensor_bytes / REFERENCE_LINK_BYTES_PER_SECOND
    return max(matchmaking_time, min(needed, averaging_timeout / 3))


def hivemind_option_names() -> frozenset[str]:
    """``hivemind.Optimizer`` arguments users may pass through collabopt."""
    return compat.optimizer_parameter_names() - _MANAGED_BY_COLLABOPT


def option_names() -> frozenset[str]:
    """Every option name a :class:`CollabConfig` accepts (collabopt's own and hivemind's), for adapters that
    split their keyword arguments."""
    own = {f.name for f in dataclasses.fields(CollabConfig)} - {"hivemind_options"}
    return frozenset(own) | hivemind_option_names()


# ---------------------------------------------------------------------- objects (not part of the frozen config)


def check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            "optimizer", f"expected a torch.optim.Optimizer instance, got {type(optimizer).__name__}",
            "pass e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)",
        )
    if compat.is_hivemind_object(optimizer):
        raise ConfigurationError("optimizer", "it is already a hivemind optimizer",
                                 "pass the plain torch optimizer it wraps")
    if not any(p.requires_grad for group in optimizer.param_groups for p in group["params"]):
        raise ConfigurationError("optimizer", "none of its parameters requires grad",
                                 "create it on the trainable parameters")


def check_model(model: Any) -> None:
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ConfigurationError("model", f"expected a torch.nn.Module, got {type(model).__name__}",
                                 "pass the model you train")


def check_callable(name: str, value: Any, fix: str) -> None:
    if value is not None and not callable(value):
        raise ConfigurationError(name, f"must be callable, got {type(value).__name__}", fix)


def check_dht(dht: Any, config: CollabConfig) -> None:
    if dht is None:
        return
    if not compat.is_dht(dht):
        raise ConfigurationError("dht", f"expected a hivemind.DHT, got {type(dht).__name__}",
                                 "pass hivemind.DHT(..., start=True)")
    given = config.swarm_options_given()
    if given:
        raise ConfigurationError(
            ", ".join(given), "swarm options were given together with a dht you own",
            "configure the DHT you create, or pass no dht= and let collabopt start one",
            fixes=[{name: DROP for name in given}, {"dht": DROP}],
        )


# constructor arguments of the core that are objects, not options (a node hands them to rank 0's core)
CORE_OBJECTS = ("optimizer_factory", "dht", "scaler", "peer")


def make_config(config: CollabConfig | None, options: dict[str, Any]) -> CollabConfig:
    """``config`` if given (then no option may be), else a config built from ``options`` (``None`` values of
    ``run_id`` / ``target_batch_size`` count as not given)."""
    options = {k: v for k, v in options.items() if not (k in ("run_id", "target_batch_size") and v is None)}
    if config is None:
        return CollabConfig.from_options(**options)
    if not isinstance(config, CollabConfig):
        raise ConfigurationError("config", f"expected a CollabConfig, got {type(config).__name__}",
                                 "build it with CollabConfig.from_options(...)")
    if options:
        raise ConfigurationError(", ".join(sorted(options)), "options were given together with config=",
                                 "put them into the CollabConfig, or pass no config=")
    return config


def renamed_argument(arguments: dict[str, Any], old: str, new: str, value: Any, where: str) -> Any:
    """The value of argument ``new`` (given as ``value``), or of its deprecated name ``old`` taken out of
    ``arguments``: the old name still works, with one ``DeprecationWarning`` pointing at the caller of ``where``;
    both names at once are refused (which one should win is not ours to guess)."""
    if old not in arguments:
        return value
    old_value = arguments.pop(old)
    if value is not None:
        raise ConfigurationError(f"{new}, {old}", f"are the same argument ({old} is its deprecated name)",
                                 f"pass only {new}=", fixes=[{old: DROP}])
    warnings.warn(f"{where}({old}=...) is deprecated: pass {new}=... instead (the same object)", DeprecationWarning,
                  stacklevel=3)
    return old_value


OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]

__all__ = ["CORE_OBJECTS", "DEFAULT_NODE_TIMEOUT", "CollabConfig", "OptimizerFactory", "check_callable", "check_dht",
           "check_model", "check_optimizer", "hivemind_option_names", "make_config", "option_names", "positive_int",
           "positive_number", "renamed_argument"]
