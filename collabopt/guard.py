"""The non-finite guard: NaN/inf never enters the swarm from this peer, and is never applied when it arrives.

hivemind's averager has no finiteness check outside its GradScaler path: one peer's NaN gradient makes every peer
of the round NaN, for good. collabopt refuses non-finite values at both ends:

* **outgoing**: nothing non-finite is contributed. Where gradients accumulate toward a global epoch (every
  synchronous mode but ``use_local_updates``), NaN and inf are sticky: once a step adds them, the accumulation
  holds them until it is reset. So the accumulation is checked (:meth:`NonFiniteGuard.accumulation_finite`, one
  read pass) at every global epoch's boundary, before it is averaged, and between boundaries at most once per
  :data:`CHECK_INTERVAL` seconds and never more often than :data:`CHECK_COST_SHARE` of the time allows (so a
  local step pays nothing for it: the check costs a pass over the gradients, as much as a tenth of a CPU step).
  A non-finite accumulation is dropped with its samples (retracted from the swarm's count), as an AMP overflow
  drops it with ``reuse_grad_buffers``. Where a step's gradients are applied at once with ``use_local_updates``
  they are checked at every step (:meth:`NonFiniteGuard.gradients_finite`) and a non-finite step contributes
  nothing. DiLoCo's inner steps are applied at once too, but what a round contributes is the change of the
  parameters: they are checked at every round and between rounds at most once per
  :data:`PARAMETER_CHECK_INTERVAL` seconds and :data:`CHECK_COST_SHARE` of the time
  (:meth:`NonFiniteGuard.parameters_finite`); a peer whose parameters turned non-finite restarts from the last
  round's (:mod:`collabopt.diloco`);
* **incoming** (:meth:`NonFiniteGuard.wrap_optimizer`): the optimizer hivemind steps refuses non-finite (averaged)
  gradients, leaving parameters and statistics as they were; after a global step whose parameter averaging
  brought non-finite values (a peer running plain hivemind or an older collabopt), the core restores the
  parameters this peer had after its own finite update (:meth:`NonFiniteGuard.restore_parameters`).

Refusals are counted and logged at most once per ``warn_interval`` seconds.

    >>> all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    False
"""

from __future__ import annotations

import logging
import math
import threading
import time
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["CHECK_COST_SHARE", "CHECK_INTERVAL", "PARAMETER_CHECK_INTERVAL", "NonFiniteGuard", "all_finite"]

CHECK_INTERVAL = 0.25  # seconds between checks of the accumulation, at least (it is always checked at a boundary)
CHECK_COST_SHARE = 0.005  # and at most this share of the time spent checking it
# seconds between checks of a DiLoCo peer's parameters, at least: a peer whose parameters turned non-finite restarts
# from the last round's whenever the check finds it, so a later check only wastes the (non-finite) steps in between
PARAMETER_CHECK_INTERVAL = 1.0


@torch.no_grad()
def all_finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether every value of ``tensors`` is finite. One read pass: NaN and inf survive a sum, so the sums are
    checked (an exact re-check runs only when a sum overflows, e.g. large fp16 values)."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        if tensor is not None and tensor.numel() > 0:
            by_device[tensor.device].append(tensor)
    for group in by_device.values():
        sums_finite = bool(torch.stack([t.sum().float() for t in group]).isfinite().all())
        if not sums_finite and not all(bool(t.isfinite().all()) for t in group):
            return False
    return True


class NonFiniteGuard:
    """Counts and reports the non-finite values the core refused; holds the parameters to restore after a global
    step whose averaging brought non-finite values."""

    def __init__(self, warn_interval: float = 60.0):
        self.warn_interval = warn_interval
        self.refused_steps = 0  # accumulations (or, checked each step, local steps) not contributed: non-finite
        self.refused_updates = 0  # optimizer steps refused: the averaged gradients were not finite
        self.restored_parameters = 0  # global steps whose averaged parameters were not finite (restored)
        self._snapshot: list[torch.Tensor] | None = None
        self._wrapped: tuple[torch.optim.Optimizer, Any] | None = None
        self._active = False
        self._lock = threading.Lock()
        self._last_warning = -math.inf
        self._unreported: dict[str, int] = defaultdict(int)
        self._next_check = -math.inf

    # ------------------------------------------------------------------ outgoing

    def gradients_finite(self, parameters: Sequence[torch.Tensor]) -> bool:
        """Check a local step's gradients; count and report a refusal."""
        if all_finite([p.grad for p in parameters]):
            return True
        self.refused_steps += 1
        self._report("local steps with non-finite gradients were not contributed")
        return False

    def check_due(self) -> bool:
        """Whether the accumulation should be checked now (between boundaries; see the module's docstring)."""
        return time.monotonic() >= self._next_check

    def accumulation_finite(self, accumulators: Sequence[torch.Tensor | None]) -> bool:
        """Check the gradients accumulated toward the next global epoch; count and report a refusal. Schedules
        the next periodic check from what this one cost."""
        finite = self._check_now(accumulators)
        if not finite:
            self.refused_steps += 1
            self._report("accumulations holding non-finite gradients were not contributed (their samples are "
                         "counted in samples_skipped)")
        return finite

    def parameters_finite(self, parameters: Sequence[torch.Tensor]) -> bool:
        """Check a DiLoCo peer's parameters (its inner steps since the last check); schedules the next periodic
        check from what this one cost. The caller decides what a refusal costs (see :mod:`collabopt.diloco`)."""
        return self._check_now(parameters, PARAMETER_CHECK_INTERVAL)

    def _check_now(self, tensors: Sequence[torch.Tensor | None], interval: float | None = None) -> bool:
        start = time.monotonic()
        finite = all_finite(tensors)
        took = time.monotonic() - start
        self._next_check = start + max(CHECK_INTERVAL if interval is None else interval, took / CHECK_COST_SHARE)
        return finite

    # ------------------------------------------------------------------ incoming

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, keep_snapshot: bool | Callable[[], bool]) -> None:
        """Make ``optimizer.step()`` refuse non-finite gradients until :meth:`unwrap`. Where ``keep_snapshot`` (or
        what it returns at a step) is true, the parameters after the step are kept (one copy in host memory, until
        :meth:`release`) so that a non-finite averaging result can be undone: only a step that a parameter round
        follows needs one (on a GPU the copy costs a synchronizing transfer of every parameter). The step stays a
        bound method (torch's LR schedulers wrap it)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        step = optimizer.step
        guard = self

        def guarded_step(_optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not guard._active:
                return step(*args, **kwargs)
            result = None
            if all_finite([p.grad for p in params]):
                result = step(*args, **kwargs)
            else:
                guard.refused_updates += 1
                guard._report("optimizer steps with non-finite averaged gradients were refused")
            wanted = keep_snapshot() if callable(keep_snapshot) else keep_snapshot
            if wanted:  # the parameters to keep if the averaging that follows brings non-finite ones
                with torch.no_grad():
                    guard._snapshot = [p.detach().to("cpu", copy=True) for p in params]
            return result

        self._wrapped = (optimizer, optimizer.__dict__.get("step"))
        self._active = True
        optimizer.step = types.MethodType(guarded_step, optimizer)  # type: ignore[method-assign]

    def unwrap(self) -> None:
        """Give the optimizer its own ``step()`` back (a wrapper installed after ours stays, as a pass-through)."""
        self._active = False
        self._snapshot = None
        if self._wrapped is None:
            return
        optimizer, original = self._wrapped
        self._wrapped = None
        current = optimizer.__dict__.get("step")
        if getattr(current, "__func__", None) is not None and current.__func__.__name__ == "guarded_step":
            if original is None:
                del optimizer.step
            else:
                optimizer.step = original  # type: ignore[method-assign]

    def restore_parameters(self, optimizer_params: Sequence[torch.Tensor], *others: Sequence[torch.Tensor]) -> bool:
        """After a global step: if the parameters are not finite, put back those of this peer's own last update
        (into the optimizer's parameters and any ``others``, e.g. the model's when offloading). Returns whether the
        parameters are finite now."""
        if all_finite(optimizer_params) and all(all_finite(group) for group in others):
            return True
        if self._snapshot is None or not all_finite(self._snapshot):
            return False
        with torch.no_grad():
            for group in (optimizer_params, *others):
                for target, saved in zip(group, self._snapshot, strict=True):
                    target.copy_(saved)
        self.restored_parameters += 1
        self._report("averaging rounds brought non-finite parameters; this peer's own update was kept")
        return True

    def release(self) -> None:
        """Drop the snapshot (called after every step: it is needed only right after a global step)."""
        self._snapshot = None

    # ------------------------------------------------------------------ reporting

    def note_refusal(self, counter: str, what: str) -> None:
        """Count a refusal decided elsewhere (DiLoCo rounds, see :mod:`collabopt.diloco`) in ``counter``
        (``refused_steps`` or ``refused_updates``) and report it like the guard's own."""
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
        self._report(what)

    def _report(self, what: str) -> None:
        with self._lock:  # delayed optimizer steps report from hivemind's background thread
            self._unreported[what] += 1
            now = time.monotonic()
            if now - self._last_warning < self.warn_interval:
                return
            self._last_warning = now
            summary = "; ".join(f"{count} {text}" for text, count in self._unreported.items())
            self._unreported.clear()
        logger.warning("collabopt: NaN/inf refused: %s (at most one such message per %.0f s)", summary,
                       self.warn_interval)
