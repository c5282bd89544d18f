"""DiLoCo mode's options: the outer optimizer a peer is given, and the options that cannot be combined with it.

:class:`~collabopt.config.CollabConfig` checks these when ``outer_optimizer`` is set (:mod:`collabopt.option_rules`,
each error with a fix that is complete), before any network starts, so that a misconfigured peer fails with the
option's name and a fix rather than inside a round.

    >>> import functools, torch
    >>> check_outer_optimizer(functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))
"""

from __future__ import annotations

from typing import Any

import torch

from collabopt.errors import ConfigurationError

OUTER_EXAMPLE = "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)"
# options of CollabConfig that cannot be combined with outer_optimizer, and why
INCOMPATIBLE = {
    "reuse_grad_buffers": "gradients are applied by your optimizer at every step, not accumulated",
    "offload_optimizer": "collabopt keeps the outer optimizer in host memory already",
    "delay_optimizer_step": "the outer step is part of the round",
    "delay_grad_averaging": "the outer step is part of the round",
    "delay_state_averaging": "DiLoCo averages pseudo-gradients, not parameters",
    "use_local_updates": "DiLoCo takes local steps already (and adds the outer step)",
    "auxiliary": "auxiliary peers do not train, so they have no pseudo-gradient",
}
# hivemind.Optimizer options that have no meaning in DiLoCo mode
INCOMPATIBLE_HIVEMIND = {
    "grad_averager_factory": "collabopt averages pseudo-gradients with its own averager",
    "average_opt_statistics": "the inner optimizer's statistics stay local (as in DiLoCo)",
}


def check_outer_optimizer(outer_optimizer: Any) -> None:
    """Raise a :class:`ConfigurationError` unless ``outer_optimizer`` builds a torch optimizer from parameters."""
    if isinstance(outer_optimizer, torch.optim.Optimizer) or not callable(outer_optimizer):
        raise ConfigurationError(
            "outer_optimizer",
            f"must be a callable(params) -> torch.optim.Optimizer, got {type(outer_optimizer).__name__}",
            f"pass e.g. outer_optimizer={OUTER_EXAMPLE}",
        )
    probe = torch.nn.Parameter(torch.zeros(1))
    try:
        built = outer_optimizer([{"params": [probe]}])
    except Exception as e:
        raise ConfigurationError(
            "outer_optimizer", f"calling it on a list of parameter groups failed ({type(e).__name__}: {e})",
            f"pass e.g. outer_optimizer={OUTER_EXAMPLE}",
        ) from None
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigurationError(
            "outer_optimizer", f"returned {type(built).__name__}, not a torch.optim.Optimizer",
            f"pass e.g. outer_optimizer={OUTER_EXAMPLE}",
        )


def check_config(config: Any) -> None:
    """The checks of a :class:`~collabopt.config.CollabConfig` with ``outer_optimizer`` set, for callers that hold a
    config-like object (a config itself is checked when built, by :mod:`collabopt.option_rules`)."""
    check_outer_optimizer(config.outer_optimizer)
    for name, why in INCOMPATIBLE.items():
        if getattr(config, name):
            raise ConfigurationError(name, f"cannot be combined with outer_optimizer (DiLoCo mode): {why}",
                                     f"drop {name}, or drop outer_optimizer for the synchronous mode")
    for name, why in INCOMPATIBLE_HIVEMIND.items():
        if config.hivemind_options.get(name):
            raise ConfigurationError(name, f"cannot be combined with outer_optimizer (DiLoCo mode): {why}",
                                     f"drop {name}")
