"""The rules a :class:`~collabopt.config.CollabConfig` checks, each broken rule with a fix that is complete.

A rule reads the options by name (the config's fields and the other ``hivemind.Optimizer`` arguments) and returns a
:class:`Broken` when they break it: the parameter, the problem and the fixes, each a change of options. A fix must
lead to a configuration that is accepted, not to the next error, so :func:`check` completes each one: it applies
the fix, and while the result breaks a rule it adds that rule's first fix. The error gives the completed changes
in words (``fix``) and as data (:attr:`~collabopt.errors.ConfigurationError.fixes`), which the unit tests apply.

    >>> error = unknown_option("matchmaking_tmie", 5.0, {"matchmaking_time", "averaging_timeout"})
    >>> error.fix
    'did you mean matchmaking_time? (every option: docs/options.md)'
    >>> error.fixes
    [{'matchmaking_tmie': DROP, 'matchmaking_time': 5.0}]
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.compression import Float16Compression, NoCompression

from collabopt import diloco_options
from collabopt.engine import compat
from collabopt.engine.clipping import MIN_CLIPPED_GROUP
from collabopt.engine.robust_averaging import AGGREGATIONS
from collabopt.errors import DROP, ConfigurationError

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
OPTIONS_PAGE = "docs/options.md"  # where every option is described (named by errors instead of listing ~50 names)


@dataclass
class Broken:
    """A broken rule: ``parameter`` and its ``problem``; ``fixes``: changes of options (:data:`DROP`: leave it out),
    the first one the default; ``example``: the fix is one value among many; ``note``: said after the fixes."""

    parameter: str
    problem: str
    fixes: list[dict[str, Any]]
    example: bool = False
    note: str = ""


Rule = Callable[[Mapping[str, Any]], "Broken | None"]


class _OuterExample(functools.partial):
    """The outer optimizer a fix suggests, shown as it is written."""

    def __repr__(self) -> str:
        return diloco_options.OUTER_EXAMPLE


def outer_example() -> functools.partial:
    return _OuterExample(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


# ---------------------------------------------------------------------- numbers (also for arguments of methods)


def number_problem(value: Any, integer: bool, allow_zero: bool = False) -> str | None:
    """Why ``value`` is not a positive integer (``integer``) or a positive finite number; ``None`` if it is."""
    if integer:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return None if ok else f"must be a positive integer, got {value!r}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        return f"must be a positive number, got {value!r}"
    return None


def _example_value(example: Any) -> Any:
    return ast.literal_eval(example) if isinstance(example, str) else example


def positive_number(name: str, value: Any, example: Any, allow_zero: bool = False) -> None:
    problem = number_problem(value, integer=False, allow_zero=allow_zero)
    if problem:
        raise ConfigurationError(name, problem, f"pass e.g. {name}={example}",
                                 fixes=[{name: _example_value(example)}])


def positive_int(name: str, value: Any, example: Any) -> None:
    problem = number_problem(value, integer=True)
    if problem:
        raise ConfigurationError(name, problem, f"pass e.g. {name}={example}", fixes=[{name: _example_value(example)}])


# ---------------------------------------------------------------------- the rules, in the order they are checked

_NUMBERS = (("target_batch_size", True, 4096), ("batch_size", True, 32), ("matchmaking_time", False, 5.0),
            ("averaging_timeout", False, 30.0), ("load_state_timeout", False, 600.0),
            ("node_timeout", False, 86400.0), ("average_state_every", True, 1))


def _run_id(v: Mapping[str, Any]) -> Broken | None:
    run_id = v["run_id"]
    if isinstance(run_id, str) and _RUN_ID.match(run_id):
        return None
    return Broken("run_id", f"must be 1-128 characters of letters, digits, '_', '-', '.', got {run_id!r}",
                  [{"run_id": "my_experiment"}], example=True)


def _numbers(v: Mapping[str, Any]) -> Broken | None:
    for name, integer, example in _NUMBERS:
        if (name == "target_batch_size" and v["auxiliary"]) or (name == "batch_size" and v[name] is None):
            continue  # (an auxiliary peer does not train; batch_size is optional)
        problem = number_problem(v[name], integer)
        if problem:
            return Broken(name, problem, [{name: example}], example=True)
    return None


def _outer_optimizer(v: Mapping[str, Any]) -> Broken | None:
    if v["outer_optimizer"] is None:
        return None
    try:
        diloco_options.check_outer_optimizer(v["outer_optimizer"])
    except ConfigurationError as e:
        return Broken(e.parameter, e.problem, [{"outer_optimizer": outer_example()}], example=True)
    return None


def _diloco(v: Mapping[str, Any]) -> Broken | None:
    """DiLoCo mode (``outer_optimizer``) refuses the options that have no meaning in it; the fix drops them all."""
    if v["outer_optimizer"] is None:
        if v["overlap_rounds"]:
            return Broken("overlap_rounds", "applies to DiLoCo mode only",
                          [{"outer_optimizer": outer_example()}, {"overlap_rounds": DROP}])
        return None
    reasons = {**diloco_options.INCOMPATIBLE, **diloco_options.INCOMPATIBLE_HIVEMIND}
    given = [name for name in reasons if v.get(name)]
    if not given:
        return None
    return Broken(given[0], f"cannot be combined with outer_optimizer (DiLoCo mode): {reasons[given[0]]}",
                  [dict.fromkeys(given, DROP), {"outer_optimizer": DROP}],
                  note="without outer_optimizer, the synchronous mode")


def _pseudo_gradient_compression(v: Mapping[str, Any]) -> Broken | None:
    """``pseudo_gradient_compression``: a :class:`~collabopt.diloco_options.SparseLoCo`, in DiLoCo mode, which
    replaces ``grad_compression`` (the pseudo-gradient travels as its payload)."""
    value = v["pseudo_gradient_compression"]
    if value is None:
        return None
    name, drop = "pseudo_gradient_compression", {"pseudo_gradient_compression": DROP}
    if not isinstance(value, diloco_options.SparseLoCo):
        return Broken(name, f"expected collabopt.diloco_options.SparseLoCo(...), got {type(value).__name__}",
                      [{name: diloco_options.SparseLoCo()}, drop], example=True)
    if v["outer_optimizer"] is None:
        return Broken(name, "applies to DiLoCo mode only", [{"outer_optimizer": outer_example()}, drop])
    if v.get("grad_compression") is not None:
        return Broken("grad_compression", f"cannot be combined with {name}: the pseudo-gradient travels as its "
                      "payload", [{"grad_compression": DROP}, drop])
    if v["client_mode"]:
        return Broken("client_mode", f"cannot be combined with {name}: every member of the exchange receives the "
                      "others' payloads, so it must be reachable", [{"client_mode": DROP}, drop])
    if v["aggregation"] == "centered_clip" and value.max_contributors is not None and \
            value.max_contributors < MIN_CLIPPED_GROUP:
        return Broken(name, f"max_contributors={value.max_contributors} with aggregation='centered_clip': the robust "
                      f"aggregate needs at least {MIN_CLIPPED_GROUP} contributions a round",
                      [{name: dataclasses.replace(value, max_contributors=MIN_CLIPPED_GROUP)},
                       {"aggregation": "mean"}], example=True)
    return None


def _modes(v: Mapping[str, Any]) -> Broken | None:
    """The combinations of hivemind's modes that hivemind refuses or that would do nothing."""
    given = [name for name in ("reuse_grad_buffers", "delay_grad_averaging") if v[name]]
    if v["use_local_updates"] and given:
        return Broken(given[0], "has no effect with use_local_updates=True (gradients are not accumulated)",
                      [dict.fromkeys(given, DROP), {"use_local_updates": DROP}])
    if v["delay_grad_averaging"] and not v["delay_optimizer_step"]:
        return Broken("delay_grad_averaging", "requires delay_optimizer_step=True (the delayed averaging result is "
                      "applied by a delayed step)", [{"delay_optimizer_step": True}, {"delay_grad_averaging": DROP}])
    if v["delay_optimizer_step"] and not v["offload_optimizer"]:
        return Broken("delay_optimizer_step", "requires offload_optimizer=True (otherwise a background step would "
                      "race with your backward pass)", [{"offload_optimizer": True}])
    if v["delay_optimizer_step"] and not v["delay_state_averaging"]:
        return Broken("delay_optimizer_step", "requires delay_state_averaging=True (hivemind runs the delayed step "
                      "inside the background averaging)", [{"delay_state_averaging": True}])
    if v["client_mode"] and v["auxiliary"]:
        return Broken("auxiliary", "client-mode peers cannot serve as auxiliaries",
                      [{"client_mode": DROP}, {"auxiliary": DROP}])
    if v["auxiliary"] and v["batch_size"] is not None:
        return Broken("batch_size", "auxiliary peers do not train", [{"batch_size": DROP}])
    return None


def _hivemind_options(v: Mapping[str, Any]) -> Broken | None:
    for name in ("grad_compression", "state_averaging_compression"):
        if name in v and not compat.check_compression(v[name]):
            return Broken(name, f"expected a hivemind compression instance, got {type(v[name]).__name__}",
                          [{name: Float16Compression()}], example=True,
                          note="or another one, e.g. hivemind.compression.Uniform8BitQuantization()")
    averager_opts = v.get("averager_opts")
    if averager_opts is not None and not isinstance(averager_opts, dict):
        return Broken("averager_opts", f"expected a dict, got {type(averager_opts).__name__}",
                      [{"averager_opts": {"request_timeout": 1.0}}], example=True)
    if v["use_local_updates"] and v.get("grad_averager_factory") is not None:
        return Broken("grad_averager_factory", "is not used with use_local_updates=True",
                      [{"grad_averager_factory": DROP}, {"use_local_updates": DROP}])
    return None


def lossy(compression: Any) -> bool:
    """Whether ``compression`` (a hivemind option's value) changes the tensors it sends: anything but none or
    ``NoCompression``."""
    return compression is not None and type(compression) is not NoCompression


def _aggregation(v: Mapping[str, Any]) -> Broken | None:
    aggregation = v["aggregation"]
    if aggregation not in AGGREGATIONS:
        return Broken("aggregation", f"must be one of {', '.join(map(repr, AGGREGATIONS))}, got {aggregation!r}",
                      [{"aggregation": name} for name in AGGREGATIONS],
                      note="'mean' is the default; 'centered_clip' is robust to a hostile member, every peer the same")
    if aggregation == "mean":
        return None
    to_mean = {"aggregation": "mean"}
    if v.get("grad_averager_factory") is not None:
        return Broken("grad_averager_factory", f"cannot be combined with aggregation={aggregation!r} (collabopt's "
                      "averager aggregates robustly)", [{"grad_averager_factory": DROP}, to_mean])
    if lossy(v.get("load_state_compression")):
        return Broken("load_state_compression", f"cannot be combined with aggregation={aggregation!r}: a "
                      "downloaded state is checked against the fingerprint most of the swarm holds, which a lossy "
                      f"{type(v['load_state_compression']).__name__} changes",
                      [{"load_state_compression": DROP}, to_mean])
    if v["outer_optimizer"] is not None:  # (DiLoCo: every member gets the average)
        return None
    # Verified downloads need honest peers to serve the same parameters (to 1e-5). hivemind's all-reduce leaves each
    # member its own tensor plus a compressed difference: a lossy parameter round leaves them apart by its error at
    # once, and lossy gradient rounds do between parameter rounds (docs/faults.md).
    if lossy(v.get("state_averaging_compression")):
        return Broken("state_averaging_compression", f"cannot be combined with aggregation={aggregation!r}: a lossy "
                      f"{type(v['state_averaging_compression']).__name__} leaves honest peers with parameters apart "
                      "by its error, and verified downloads would refuse their states",
                      [{"state_averaging_compression": DROP}, to_mean])
    if lossy(v.get("grad_compression")) and v["average_state_every"] > 1:
        return Broken("grad_compression", f"a lossy {type(v['grad_compression']).__name__} cannot be combined with "
                      f"aggregation={aggregation!r} and average_state_every={v['average_state_every']}: honest "
                      "peers' parameters drift apart by its error until a parameter round, and verified downloads "
                      "would refuse their states", [{"average_state_every": 1}, {"grad_compression": DROP}, to_mean])
    return None


RULES: tuple[Rule, ...] = (_run_id, _numbers, _outer_optimizer, _diloco, _pseudo_gradient_compression, _modes,
                           _hivemind_options, _aggregation)


# ---------------------------------------------------------------------- checking, completing and saying the fixes


def _applied(values: Mapping[str, Any], changes: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with ``changes``: a dropped option takes its default (a hivemind option is left out)."""
    result = dict(values)
    for name, value in changes.items():
        if value is not DROP:
            result[name] = value
        elif name in defaults:
            result[name] = defaults[name]
        else:
            result.pop(name, None)
    return result


def first_broken(values: Mapping[str, Any]) -> Broken | None:
    for rule in RULES:
        broken = rule(values)
        if broken is not None:
            return broken
    return None


def complete(values: Mapping[str, Any], changes: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` and what the options need besides, so that no rule is broken (each further rule's first fix)."""
    changes = dict(changes)
    for _ in range(4 * len(RULES)):
        broken = first_broken(_applied(values, changes, defaults))
        if broken is None:
            return changes
        changes.update(broken.fixes[0])
    raise RuntimeError(f"collabopt: the fixes of the option rules do not settle from {changes}")  # (a bug of ours)


def _shown(value: Any) -> str:
    if type(value).__module__.startswith("hivemind.compression"):
        return f"hivemind.{type(value).__name__}()"
    return repr(value)


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def describe(changes: Mapping[str, Any], example: bool = False) -> str:
    """``changes`` in words: ``pass a=1, b=True and drop c``."""
    passed = [f"{name}={_shown(value)}" for name, value in changes.items() if value is not DROP]
    dropped = [name for name, value in changes.items() if value is DROP]
    parts = [("pass e.g. " if example else "pass ") + ", ".join(passed)] if passed else []
    return " and ".join(parts + ([f"drop {_listed(dropped)}"] if dropped else []))


def check(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Raise a :class:`ConfigurationError` for the first rule ``values`` break, with its fixes completed."""
    broken = first_broken(values)
    if broken is None:
        return
    fixes: list[dict[str, Any]] = []
    for fix in broken.fixes:
        completed = complete(values, fix, defaults)
        if completed not in fixes:
            fixes.append(completed)
    words = ", or ".join(describe(fix, broken.example) for fix in fixes)
    raise ConfigurationError(broken.parameter, broken.problem, words + (f" ({broken.note})" if broken.note else ""),
                             fixes=fixes)


def unknown_option(name: str, value: Any, accepted: Iterable[str],
                   problem: str = "is not an argument of collabopt or hivemind.Optimizer") -> ConfigurationError:
    """The error for an option no one accepts: the closest accepted names (not all ~50 of them, which hide the
    one meant), and the page that lists them all."""
    close = difflib.get_close_matches(name, sorted(accepted), n=3)
    if not close:
        return ConfigurationError(name, problem, f"check the spelling, or drop it (every option: {OPTIONS_PAGE})",
                                  fixes=[{name: DROP}])
    return ConfigurationError(name, problem, f"did you mean {' or '.join(close)}? (every option: {OPTIONS_PAGE})",
                              fixes=[{name: DROP, match: value} for match in close])


__all__ = ["OPTIONS_PAGE", "RULES", "Broken", "check", "complete", "describe", "first_broken", "lossy",
           "number_problem", "outer_example", "positive_int", "positive_number", "unknown_option"]
