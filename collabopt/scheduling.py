"""Optimizer and LR-scheduler re-creation, and the one scheduler wrapper: a schedule that advances once per global
epoch (:class:`CollaborativeScheduler`).

hivemind re-creates the optimizer from a factory when it offloads it or delays its steps. Users hold an
optimizer *instance* and a scheduler *instance*; this module derives the factory from the optimizer instance
and moves the user's scheduler onto the optimizer that hivemind really steps, so no ``scheduler_fn`` is needed.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from collabopt.errors import ConfigurationError

Scheduler = Any  # LRScheduler or ReduceLROnPlateau (not an LRScheduler subclass on older torch)
_UNSUPPORTED_OPTIMIZERS = ("LBFGS", "SparseAdam")
PLATEAU_STATE_KEY = "collabopt_plateau_state"
SCHEDULER_STATE_FORMAT = "collabopt-scheduler/1"
_PLATEAU_COUNTERS = ("best", "num_bad_epochs", "cooldown_counter")


def is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (LRScheduler, ReduceLROnPlateau))


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per-group hyperparameters (everything but ``params``), deep-copied."""
    return [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups]


def optimizer_factory(optimizer: torch.optim.Optimizer) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """A factory ``f(param_groups) -> optimizer`` that rebuilds ``optimizer``'s class on new parameters.

    Constructor arguments come from ``optimizer.defaults`` filtered by the constructor's signature (``defaults``
    may hold keys the constructor does not accept, e.g. for AdamW); per-group values (lr, betas, ``initial_lr``
    set by schedulers, ...) travel in the param groups themselves; existing optimizer state is copied.
    """
    cls = type(optimizer)
    if cls.__name__ in _UNSUPPORTED_OPTIMIZERS:
        raise ConfigurationError(
            "optimizer",
            f"{cls.__name__} is not supported by hivemind (it needs a closure or sparse gradients)",
            "use a first-order optimizer such as AdamW or SGD",
        )
    signature = inspect.signature(cls.__init__)
    parameters = list(signature.parameters.values())[1:]  # drop self
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters}
    ctor_kwargs = {k: v for k, v in optimizer.defaults.items() if accepts_any or k in names}
    missing = [
        p.name
        for p in parameters[1:]
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name not in ctor_kwargs
    ]
    if missing:
        raise ConfigurationError(
            "optimizer",
            f"cannot rebuild {cls.__name__}: its constructor needs {missing}, which are not in optimizer.defaults",
            "pass optimizer_factory=lambda params: YourOptimizer(params, ...)",
        )
    hyperparameters = group_hyperparameters(optimizer)
    state = optimizer.state_dict() if optimizer.state else None

    def factory(param_groups: list[dict]) -> torch.optim.Optimizer:
        pairs = zip(hyperparameters, param_groups, strict=True)
        groups = [dict(hp, params=list(group["params"])) for hp, group in pairs]
        new_optimizer = cls(groups, **ctor_kwargs)
        if state is not None:
            new_optimizer.load_state_dict(copy.deepcopy(state))
        return new_optimizer

    return factory


def rebind_scheduler(scheduler: Scheduler, optimizer: torch.optim.Optimizer) -> None:
    """Point ``scheduler`` (and the schedulers it chains) at ``optimizer``, in place."""
    scheduler.optimizer = optimizer
    for child in getattr(scheduler, "_schedulers", ()):
        rebind_scheduler(child, optimizer)


def scheduler_optimizers(scheduler: Scheduler) -> list[torch.optim.Optimizer]:
    found = [scheduler.optimizer]
    for child in getattr(scheduler, "_schedulers", ()):
        found.extend(scheduler_optimizers(child))
    return found


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Raise a :class:`ConfigurationError` if ``scheduler`` is not a scheduler bound to ``optimizer``."""
    if not is_scheduler(scheduler):
        raise ConfigurationError(
            "scheduler",
            f"expected a torch LR scheduler instance, got {type(scheduler).__name__}",
            "pass e.g. torch.optim.lr_scheduler.OneCycleLR(optimizer, ...), or scheduler_fn=callable(optimizer)",
        )
    if any(bound is not optimizer for bound in scheduler_optimizers(scheduler)):
        raise ConfigurationError(
            "scheduler",
            "it is bound to a different optimizer than the one being wrapped",
            "create the scheduler on the same optimizer instance you pass to CollaborativeOptimizer",
        )


def check_scheduler_arguments(scheduler: Any, scheduler_fn: Any, optimizer: torch.optim.Optimizer) -> None:
    """Raise a :class:`ConfigurationError` unless at most one of ``scheduler`` (bound to ``optimizer``) and
    ``scheduler_fn`` (a callable, not a scheduler) is given."""
    if scheduler is not None and scheduler_fn is not None:
        raise ConfigurationError("scheduler", "both scheduler and scheduler_fn were given", "pass only one of them")
    if scheduler is not None:
        check_scheduler(scheduler, optimizer)
    if scheduler_fn is not None and (not callable(scheduler_fn) or is_scheduler(scheduler_fn)):
        raise ConfigurationError(
            "scheduler_fn", f"expected a callable(optimizer) -> scheduler, got {type(scheduler_fn).__name__}",
            "pass e.g. functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.99), "
            "or the instance as scheduler=",
        )


class CollaborativeScheduler:
    """The user's LR scheduler, advanced once per global epoch: the one scheduler wrapper of collabopt.

    The core drives it (:meth:`advance_to` after every step); adapters hand it to their framework in place of the
    scheduler, so the framework's ``step()`` calls do nothing (``ReduceLROnPlateau.step(metric)`` reports the
    metric). Every other attribute is the wrapped scheduler's. Its state (:meth:`state_dict`) has one format,
    also saved inside the optimizer's checkpoint.

    After ``k`` global epochs the scheduler is in the state of ``k`` plain ``step()`` calls. One epoch forward is
    one ``step()``. A jump (a late joiner downloading state, a peer catching up) resets the scheduler and the group
    hyperparameters to their state at ``base_epoch`` and replays the steps, so every peer holds the same learning
    rate whatever the downloaded optimizer carried. ``ReduceLROnPlateau`` is stepped with the mean of the metrics
    reported during the epoch; on a jump it keeps the downloaded learning rate.

        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> schedule = CollaborativeScheduler(torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5))
        >>> schedule.step()          # a framework's per-batch call: ignored
        >>> schedule.advance_to(2)   # two global epochs
        >>> schedule.get_last_lr()
        [0.25]
    """

    def __init__(self, scheduler: Scheduler, base_epoch: int = 0):
        self.__dict__["scheduler"] = scheduler
        self.is_plateau = isinstance(scheduler, ReduceLROnPlateau)
        self.epoch = base_epoch
        self._metrics: list[float] = []
        self._last_metric: float | None = None
        self._warned_no_metric = False
        self.rebase(base_epoch)

    def __getattr__(self, name: str) -> Any:  # only called for names this wrapper does not have
        scheduler = self.__dict__.get("scheduler")
        if scheduler is None:
            raise AttributeError(name)
        return getattr(scheduler, name)

    # ------------------------------------------------------------------ what frameworks and users call

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Does nothing (collabopt steps the scheduler once per global epoch), except that
        ``ReduceLROnPlateau.step(metric)`` reports ``metric``."""
        metric = step_metric(args, kwargs)
        if self.is_plateau and metric is not None:
            self.report_metric(metric)

    def report_metric(self, value: float) -> None:
        """Report a metric for ``ReduceLROnPlateau``; the mean over the epoch is used."""
        value = float(value.item() if isinstance(value, torch.Tensor) else value)
        if math.isfinite(value):
            self._metrics.append(value)

    def get_last_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.scheduler.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"format": SCHEDULER_STATE_FORMAT, "scheduler": self.scheduler.state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned; a plain scheduler state (a checkpoint of ordinary training) is
        taken as the state at the current epoch."""
        ours = isinstance(state, dict) and (state.get("format") == SCHEDULER_STATE_FORMAT
                                            or set(state) == {"scheduler", "epoch"})  # collabopt 0.1 checkpoints
        if ours:
            self.scheduler.load_state_dict(state["scheduler"])
            self.rebase(int(state["epoch"]))
        else:
            self.scheduler.load_state_dict(state)
            self.rebase(self.epoch)

    # ------------------------------------------------------------------ driven by the core

    def rebase(self, epoch: int) -> None:
        """Declare the scheduler's current state to be the state at global epoch ``epoch``."""
        self.base_epoch = self.epoch = epoch
        self._base_state = copy.deepcopy(self.scheduler.state_dict())
        self._base_groups = group_hyperparameters(self.scheduler.optimizer)
        self._last_groups = self._base_groups  # hyperparameters this schedule set last (see advance_to)
        self._metrics.clear()
        if self.is_plateau:
            self._share_plateau_state()

    def _step(self, *args: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            original_class(self.scheduler).step(self.scheduler, *args)

    def _reset_to_base(self) -> None:
        self.scheduler.load_state_dict(copy.deepcopy(self._base_state))
        self._restore_groups(self._base_groups)

    def advance_to(self, epoch: int) -> None:
        """Bring the schedule to global epoch ``epoch``."""
        if epoch == self.epoch:
            if not self.is_plateau and self._learning_rates_replaced():
                # a state download at the same epoch brought the serving peer's param groups: keep our schedule's
                self._restore_groups(self._last_groups)
            return
        if self.is_plateau:
            self._advance_plateau(epoch)
            return
        if epoch == self.epoch + 1:
            # hivemind may have reached this epoch by downloading a peer's state, whose param groups already hold
            # the stepped hyperparameters: step from this schedule's own values, not from the downloaded ones
            self._restore_groups(self._last_groups)
            self._step()
        else:
            self._reset_to_base()
            for _ in range(max(0, epoch - self.base_epoch)):
                self._step()
        self.epoch = epoch
        self._last_groups = group_hyperparameters(self.scheduler.optimizer)

    def _advance_plateau(self, epoch: int) -> None:
        shared = self.scheduler.optimizer.param_groups[0].get(PLATEAU_STATE_KEY)
        if isinstance(shared, dict) and shared.get("epoch") != self.epoch:
            # hivemind downloaded a peer's state: its LR and plateau counters came in the param group
            self._load_shared_plateau_state(shared, epoch)
        elif epoch == self.epoch + 1:
            if self._metrics:
                self._last_metric = sum(self._metrics) / len(self._metrics)
                self._step(self._last_metric)
            elif not self._warned_no_metric:
                self._warned_no_metric = True
                warnings.warn(
                    "ReduceLROnPlateau was not stepped at this global epoch: no metric was reported. Call "
                    "scheduler.step(metric) or copt.report_metric(metric) during each epoch.",
                    stacklevel=4,
                )
        self.scheduler.last_epoch = epoch
        self._metrics.clear()
        self.epoch = epoch
        self._share_plateau_state()

    def _learning_rates_replaced(self) -> bool:
        current = self.scheduler.optimizer.param_groups
        return any(group["lr"] != last["lr"] for group, last in zip(current, self._last_groups, strict=True))

    def _restore_groups(self, hyperparameters: list[dict[str, Any]]) -> None:
        for group, values in zip(self.scheduler.optimizer.param_groups, hyperparameters, strict=True):
            group.update(copy.deepcopy(values))

    def _share_plateau_state(self) -> None:
        """Keep the plateau counters in the optimizer's first param group: hivemind sends param groups (and so
        these counters) to peers that download state, so a late joiner continues the same plateau schedule."""
        self.scheduler.optimizer.param_groups[0][PLATEAU_STATE_KEY] = dict(
            {key: getattr(self.scheduler, key) for key in _PLATEAU_COUNTERS},
            epoch=self.epoch,
            last_metric=self._last_metric,
        )

    def _load_shared_plateau_state(self, shared: dict[str, Any], epoch: int) -> None:
        """Continue a downloaded plateau schedule. The serving peer may have been an epoch behind its own counter
        (hivemind bumps the epoch of a peer that downloads state one epoch old): replay the missing epochs with
        the last metric it used."""
        for key in _PLATEAU_COUNTERS:
            if key in shared:
                setattr(self.scheduler, key, shared[key])
        self._last_metric = shared.get("last_metric")
        self.scheduler._last_lr = [float(group["lr"]) for group in self.scheduler.optimizer.param_groups]
        missing = epoch - int(shared.get("epoch", epoch))
        if self._last_metric is not None:
            for _ in range(max(0, missing)):
                self._step(self._last_metric)

    def __repr__(self) -> str:
        return f"CollaborativeScheduler({type(self.scheduler).__name__}, epoch={self.epoch})"


def step_metric(args: tuple, kwargs: dict) -> Any:
    """The metric of a ``ReduceLROnPlateau.step(metrics)`` call (positional or keyword), or None."""
    return args[0] if args else kwargs.get("metrics")


def install_step_guard(scheduler: Scheduler, on_metric: Callable[[float], None]) -> None:
    """Make the user's ``scheduler.step()`` safe: collabopt steps it once per global epoch.

    ``scheduler.step(metric)`` on ``ReduceLROnPlateau`` reports the metric; any other call is ignored with one
    warning (stepping per local batch would desynchronize peers). The instance gets a subclass of its own class
    (so ``state_dict()`` stays picklable); :func:`remove_step_guard` undoes it.
    """
    original = type(scheduler)
    if getattr(original, "_collabopt_original_class", None) is not None:
        original = original._collabopt_original_class
    warned = False

    def guarded_step(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal warned
        if isinstance(self, ReduceLROnPlateau):
            metric = step_metric(args, kwargs)
            if metric is not None:
                on_metric(metric)
            return
        if not warned:
            warned = True
            warnings.warn(
                f"{original.__name__}.step() is called by collabopt once per global epoch; your call was "
                "ignored. Remove it from your loop.",
                stacklevel=2,
            )

    guarded = type(original.__name__, (original,), {"step": guarded_step, "_collabopt_original_class": original})
    guarded.__module__ = original.__module__
    scheduler.__class__ = guarded


def original_class(scheduler: Scheduler) -> type:
    return getattr(type(scheduler), "_collabopt_original_class", None) or type(scheduler)


def remove_step_guard(scheduler: Scheduler) -> None:
    scheduler.__class__ = original_class(scheduler)
