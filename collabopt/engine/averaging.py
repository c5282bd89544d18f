"""The gradient averager the synchronous loop builds (:func:`gradient_averager_factory`): collabopt's gradient rounds
(:mod:`collabopt.engine.gradient_rounds`), or a hivemind averager of the user's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from collabopt.engine.gradient_rounds import GradientRounds
from collabopt.engine.powersgd_rounds import PowerSGDRounds, powersgd_options


def gradient_averager_factory(factory: Callable[..., Any] | None, request_timeout: float | None,
                              **options: Any) -> Callable[..., Any]:
    """The synchronous loop's gradient averager: without a factory of the user's, collabopt's gradient rounds
    (:class:`~collabopt.engine.gradient_rounds.GradientRounds`, aggregating as ``options`` say: those of
    :func:`~collabopt.engine.robust_averaging.aggregation_options`); with hivemind's ``PowerSGDGradientAverager``
    (the class or a ``functools.partial`` of it), collabopt's PowerSGD rounds with its options
    (:mod:`collabopt.engine.powersgd_rounds`); any other factory's averager, as it is. hivemind 1.1.12 hands
    ``averager_opts`` to its state averager only: give the gradient averager the same join-request timeout, where one
    is set."""
    extra = dict(options) if request_timeout is None else dict(options, request_timeout=request_timeout)
    powersgd = None if factory is None else powersgd_options(factory)
    if powersgd is not None:
        return functools.partial(PowerSGDRounds, **dict(powersgd, **extra))
    if factory is not None:  # (a hivemind averager of the user's: an instance of hivemind's class)
        return functools.partial(factory, **extra)
    return functools.partial(GradientRounds, **dict(dict(aggregation="mean"), **extra))


__all__ = ["gradient_averager_factory"]
