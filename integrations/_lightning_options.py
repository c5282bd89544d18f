"""The strategy's arguments (lightning-hivemind's ``HivemindStrategy`` ones, and any core option) turned into the
options of :class:`~collabopt.CollaborativeOptimizer`.

Rule: every argument is checked when the strategy is built. Reason: a typo or a bad value then fails at the
``Trainer(strategy=...)`` line, not minutes later when ``fit`` starts and the swarm is joined.
"""

from __future__ import annotations

from typing import Any

from collabopt.config import CollabConfig, option_names
from collabopt.errors import ConfigurationError
from collabopt.option_rules import unknown_option
from collabopt.scheduling import is_scheduler
from collabopt.swarm import parse_initial_peers

# lightning-hivemind's arguments that go to the config unchanged
CONFIG_ARGUMENTS = ("delay_state_averaging", "delay_grad_averaging", "reuse_grad_buffers", "matchmaking_time",
                    "averaging_timeout", "verbose", "host_maddrs", "initial_peers", "use_ipfs", "wait_timeout",
                    "bootstrap_timeout", "use_relay", "use_auto_relay", "identity_path")
# options the strategy sets itself (from the Trainer, the module, or its own arguments)
MANAGED_HERE = {"optimizer", "scheduler", "model", "batch_size", "scaler", "grad_scaler", "initial_peers_env", "dht"}


def accepted_option_names() -> set[str]:
    """Options the strategy takes in ``**optimizer_kwargs``: the config's, less those it sets itself."""
    return (set(option_names()) | {"optimizer_factory"}) - MANAGED_HERE - {"target_batch_size", "run_id"}


def strategy_options(arguments: dict[str, Any], initial_peers_env: tuple[str, ...]) -> dict[str, Any]:
    """Check the strategy's ``arguments`` (its ``__init__``'s locals) and return the core options they set, without
    ``run_id`` and ``target_batch_size``; ``initial_peers_env`` are read when ``initial_peers`` is not given."""
    batch_size, scheduler_fn = arguments["batch_size"], arguments["scheduler_fn"]
    optimizer_kwargs: dict[str, Any] = arguments["optimizer_kwargs"]
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                   or batch_size <= 0):
        raise ConfigurationError("batch_size", f"must be a positive integer, got {batch_size!r}",
                                 "pass e.g. batch_size=32, or leave it out to measure every batch")
    accepted = accepted_option_names()
    for name in optimizer_kwargs:
        if name not in accepted:
            raise unknown_option(name, optimizer_kwargs[name], accepted, "is not an argument of "
                                 "CollaborativeStrategy, CollaborativeOptimizer or hivemind.Optimizer")
    if scheduler_fn is not None and not callable(scheduler_fn) and not is_scheduler(scheduler_fn):
        raise ConfigurationError("scheduler_fn", f"expected a callable(optimizer) -> scheduler, got "
                                 f"{type(scheduler_fn).__name__}", "return the scheduler from configure_optimizers")
    # fail now (not when fit starts) on malformed addresses
    parse_initial_peers(arguments["initial_peers"], env_vars=initial_peers_env)

    options = {name: arguments[name] for name in CONFIG_ARGUMENTS}
    delay_optimizer_step = arguments["delay_optimizer_step"]
    if delay_optimizer_step is None:  # hivemind's default
        delay_optimizer_step = arguments["delay_grad_averaging"]
    options.update(
        delay_optimizer_step=delay_optimizer_step,
        offload_optimizer=bool(arguments["offload_optimizer"]),
        initial_peers_env=initial_peers_env,
    )
    if arguments["averager_opts"] is not None:
        options["averager_opts"] = arguments["averager_opts"]
    options.update(optimizer_kwargs)
    # every option is checked now, not when fit starts
    CollabConfig.from_options(run_id=arguments["run_id"], target_batch_size=arguments["target_batch_size"],
                              **{name: value for name, value in options.items() if name in option_names()})
    return options
