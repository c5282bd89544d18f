"""One frozen configuration of a peer: every option validated once, before any network starts.

Where it sits: :class:`~collabopt.CollaborativeOptimizer` (the core), :class:`~collabopt.node.NodeOptimizer` (several
ranks as one peer) and every adapter (``collabopt.integrations.*``) turn their keyword arguments into a
:class:`CollabConfig` with :meth:`CollabConfig.from_options`; its :data:`OPTION_NAMES` are the names they accept.
The config builds hivemind's arguments (:meth:`CollabConfig.hivemind_arguments`) and the DHT's
(:meth:`CollabConfig.swarm_options`). Objects (optimizer, scheduler, model, dht) are checked by the ``check_*``
functions here and stay arguments of the constructors.

    >>> config = CollabConfig.from_options(run_id="demo", target_batch_size=4096, matchmaking_time=2.0)
    >>> config.hivemind_arguments()["averager_opts"]
    {'request_timeout': 1.0}
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.compression import NoCompression

from collabopt import diloco_options
from collabopt.engine import compat
from collabopt.engine.averaging import gradient_averager_factory
from collabopt.engine.robust_averaging import AGGREGATIONS, aggregation_options
from collabopt.errors import ConfigurationError
from collabopt.membership import swarm_key_from
from collabopt.swarm import DhtOptions, SwarmOptions, parse_initial_peers, validate_listen_maddrs

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
DEFAULT_NODE_TIMEOUT = 24 * 3600.0  # seconds other ranks of a node may wait for rank 0 (matchmaking, download)
# hivemind.Optimizer arguments collabopt sets itself (never accepted from users)
_MANAGED_BY_COLLABOPT = frozenset({"dht", "run_id", "target_batch_size", "batch_size_per_step", "optimizer", "params",
                                   "scheduler", "client_mode"})
# DHT options (cannot be combined with a dht= the caller owns)
_SWARM_FIELDS = ("initial_peers", "host_maddrs", "announce_maddrs", "identity_path", "client_mode", "use_ipfs",
                 "bootstrap_timeout", "relay_peers", "swarm_key")


def positive_number(name: str, value: Any, example: str, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ConfigurationError(name, f"must be a positive number, got {value!r}", f"pass e.g. {name}={example}")


def positive_int(name: str, value: Any, example: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigurationError(name, f"must be a positive integer, got {value!r}", f"pass e.g. {name}={example}")


@dataclass(frozen=True, kw_only=True)
class CollabConfig(DhtOptions):
    """Options of one peer (see the README's option table). Build it with :meth:`from_options`, which also
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

    @classmethod
    def from_options(cls, **options: Any) -> CollabConfig:
        """Split ``options`` into collabopt's own and other ``hivemind.Optimizer`` arguments; refuse the rest."""
        own = {f.name for f in dataclasses.fields(cls)} - {"hivemind_options"}
        mine = {name: value for name, value in options.items() if name in own}
        extra = {name: value for name, value in options.items() if name not in own}
        for name in extra:
            if name not in hivemind_option_names():
                raise ConfigurationError(
                    name, "is not an argument of collabopt or hivemind.Optimizer",
                    f"check the spelling; accepted options: {', '.join(sorted(option_names()))}",
                )
        for name in ("run_id", "target_batch_size"):
            if name not in mine:
                raise ConfigurationError(name, "is required", f"pass {name}=...")
        return cls(**mine, hivemind_options=extra)

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id):
            raise ConfigurationError(
                "run_id", f"must be 1-128 characters of letters, digits, '_', '-', '.', got {self.run_id!r}",
                "pass e.g. run_id='my_experiment'",
            )
        if not self.auxiliary:
            positive_int("target_batch_size", self.target_batch_size, "4096")
        if self.batch_size is not None:
            positive_int("batch_size", self.batch_size, "32")
        for name, example in (("matchmaking_time", "5.0"), ("averaging_timeout", "30.0"),
                              ("load_state_timeout", "600.0"), ("node_timeout", "86400")):
            positive_number(name, getattr(self, name), example)
        positive_int("average_state_every", self.average_state_every, "1")
        self._check_modes()
        self._check_hivemind_options()
        self._check_aggregation()
        if self.outer_optimizer is not None:
            diloco_options.check_config(self)
        elif self.overlap_rounds:
            raise ConfigurationError("overlap_rounds", "applies to DiLoCo mode only",
                                     f"pass outer_optimizer= as well (e.g. {diloco_options.OUTER_EXAMPLE}), or drop it")
        # DHT options: parsed now (bad addresses fail here), normalized in place
        if self.initial_peers is not None:  # the environment variable is read when a DHT is started
            object.__setattr__(self, "initial_peers", parse_initial_peers(self.initial_peers, env_vars=()))
        object.__setattr__(self, "host_maddrs", validate_listen_maddrs(self.host_maddrs, "host_maddrs"))
        object.__setattr__(self, "announce_maddrs", validate_listen_maddrs(self.announce_maddrs, "announce_maddrs"))
        # parsed now (a malformed key fails here); the environment variable is read when a DHT is started
        object.__setattr__(self, "swarm_key", swarm_key_from(self.swarm_key, environment=False))
        self.validate()  # the DHT options

    def _check_modes(self) -> None:
        if self.delay_grad_averaging and not self.delay_optimizer_step:
            raise ConfigurationError(
                "delay_grad_averaging",
                "requires delay_optimizer_step=True (the delayed averaging result is applied by a delayed step)",
                "pass delay_optimizer_step=True and offload_optimizer=True as well",
            )
        if self.delay_optimizer_step and not self.offload_optimizer:
            raise ConfigurationError(
                "delay_optimizer_step",
                "requires offload_optimizer=True (otherwise a background step would race with your backward pass)",
                "pass offload_optimizer=True",
            )
        if self.delay_optimizer_step and not self.delay_state_averaging:
            raise ConfigurationError(
                "delay_optimizer_step",
                "requires delay_state_averaging=True (hivemind runs the delayed step inside the background averaging)",
                "pass delay_state_averaging=True as well",
            )
        if self.use_local_updates and (self.reuse_grad_buffers or self.delay_grad_averaging):
            name = "reuse_grad_buffers" if self.reuse_grad_buffers else "delay_grad_averaging"
            raise ConfigurationError(
                name, "has no effect with use_local_updates=True (gradients are not accumulated)", f"drop {name}"
            )
        if self.client_mode and self.auxiliary:
            raise ConfigurationError("auxiliary", "client-mode peers cannot serve as auxiliaries",
                                     "pass client_mode=False")
        if self.auxiliary and self.batch_size is not None:
            raise ConfigurationError("batch_size", "auxiliary peers do not train", "drop batch_size")

    def _check_hivemind_options(self) -> None:
        options = self.hivemind_options
        for name in ("grad_compression", "state_averaging_compression"):
            if name in options and not compat.check_compression(options[name]):
                raise ConfigurationError(
                    name, f"expected a hivemind compression instance, got {type(options[name]).__name__}",
                    "pass e.g. hivemind.Float16Compression() or hivemind.Uniform8BitQuantization()",
                )
        averager_opts = options.get("averager_opts")
        if averager_opts is not None and not isinstance(averager_opts, dict):
            raise ConfigurationError("averager_opts", f"expected a dict, got {type(averager_opts).__name__}",
                                     "pass e.g. averager_opts=dict(request_timeout=1.0)")
        if self.use_local_updates and options.get("grad_averager_factory") is not None:
            raise ConfigurationError("grad_averager_factory", "is not used with use_local_updates=True",
                                     "drop one of them")

    def _check_aggregation(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ConfigurationError("aggregation", f"must be one of {', '.join(map(repr, AGGREGATIONS))}, got "
                                     f"{self.aggregation!r}", "pass aggregation='mean' (the default) or "
                                     "aggregation='centered_clip' (robust to a hostile member; every peer the same)")
        if self.aggregation != "mean" and self.hivemind_options.get("grad_averager_factory") is not None:
            raise ConfigurationError("grad_averager_factory", f"cannot be combined with aggregation="
                                     f"{self.aggregation!r} (collabopt's averager aggregates robustly)",
                                     "drop grad_averager_factory, or pass aggregation='mean'")
        compression = self._lossy_compression("load_state_compression")
        if self.aggregation != "mean" and compression is not None:
            raise ConfigurationError("load_state_compression", f"cannot be combined with aggregation="
                                     f"{self.aggregation!r}: a downloaded state is checked against the fingerprint "
                                     f"most of the swarm holds, which a lossy {type(compression).__name__} changes",
                                     "drop load_state_compression, or pass aggregation='mean'")
        if self.aggregation != "mean" and self.outer_optimizer is None:  # (DiLoCo: every member gets the average)
            self._check_exact_parameters()

    def _check_exact_parameters(self) -> None:
        """Verified downloads need honest peers to serve the same parameters (to 1e-5). hivemind's all-reduce leaves
        each member its own tensor plus a compressed difference: a lossy parameter round leaves them apart by its
        error at once, and lossy gradient rounds do between parameter rounds (docs/faults.md)."""
        for name in ("state_averaging_compression", "grad_compression"):
            compression = self._lossy_compression(name)
            if compression is None:
                continue
            if name == "state_averaging_compression":
                raise ConfigurationError(name, f"cannot be combined with aggregation={self.aggregation!r}: a lossy "
                                         f"{type(compression).__name__} leaves honest peers with parameters apart "
                                         "by its error, and verified downloads would refuse their states",
                                         "drop state_averaging_compression, or pass aggregation='mean'")
            if self.average_state_every > 1:
                raise ConfigurationError(name, f"a lossy {type(compression).__name__} cannot be combined with "
                                         f"aggregation={self.aggregation!r} and average_state_every="
                                         f"{self.average_state_every}: honest peers' parameters drift apart by its "
                                         "error until a parameter round, and verified downloads would refuse "
                                         "their states", "pass average_state_every=1, or drop grad_compression")

    def _lossy_compression(self, name: str) -> Any:
        """The compression given as hivemind option ``name`` if it is lossy (anything but ``NoCompression``)."""
        compression = self.hivemind_options.get(name)
        return None if compression is None or type(compression) is NoCompression else compression

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
        )


# constructor arguments of the core that are objects, not options (a node hands them to rank 0's core)
CORE_OBJECTS = ("optimizer_factory", "dht", "grad_scaler", "peer")


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


OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]

__all__ = ["CORE_OBJECTS", "DEFAULT_NODE_TIMEOUT", "CollabConfig", "OptimizerFactory", "check_callable", "check_dht",
           "check_model", "check_optimizer", "hivemind_option_names", "make_config", "option_names", "positive_int",
           "positive_number"]
