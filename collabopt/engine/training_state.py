"""This peer's training state, owned by collabopt: the model's parameters, their host copies (``offload_optimizer``),
the optimizer and its step (in the background too: ``delay_optimizer_step``), the scheduler, the extra tensors, the
epoch, and the parameter rounds (:mod:`collabopt.engine.parameter_rounds`) that average them.

Rules, and why:

* It is composed of hivemind's parts (``initialize_optimizer_state_``; the state it serves is hivemind's layout,
  :mod:`collabopt.engine.state`), not derived from hivemind's ``TrainingStateAverager``: what a step does is readable
  here. Its arguments and its ``step()`` keep that class's names and meanings, so that users' options keep theirs.
* :meth:`TrainingState.step` runs its actions in hivemind's order: wait for delayed work, apply what finished,
  count the epoch, then (in one executor, so that they never overlap) the optimizer step, the scheduler and the
  parameter round; the caller waits for those it does not delay.
* The averaged tensors are the optimizer's parameters, statistics and extras themselves where ``reuse_tensors``
  (a round's average is written into them as it ends), else host copies, whose average is applied by the next
  ``step()`` (a round in the background never writes tensors the training loop is using).
* Locks, always taken in this order: ``lock_optimizer`` (an optimizer step; an average applied; an install),
  ``lock_averaged_tensors`` (the averaged tensors); ``lock_averaging`` is held while a parameter round runs.
* An average is written into the averaged tensors only by the round last handed them (``_writer``), and not after a
  downloaded state replaced them (:meth:`_replaced`): else it would bring back the state they held (or, with the
  delta rule, add an older epoch's change). A round that outlived the step's wait is installed by the next step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

import torch

from collabopt.engine.parameter_rounds import ParameterRound, RoundFailed, round_infos
from collabopt.engine.training_components import build_components, param_groups

logger = logging.getLogger(__name__)


class TrainingState:
    """The training state of one peer (see the module). Arguments are hivemind's ``TrainingStateAverager``'s:
    ``optimizer`` (a torch optimizer, or a factory of one given ``params``), ``scheduler`` (or its factory),
    ``offload_optimizer``, ``custom_gradients``, ``reuse_tensors``, ``delta_rule_averaging``,
    ``average_opt_statistics``, ``extra_tensors``, ``initialize_optimizer``; ``rounds``: the parameter rounds
    (:class:`~collabopt.engine.parameter_rounds.ParameterRounds`, or ``NoRounds``)."""

    _writer: ParameterRound | None = None  # the round whose average may write the averaged tensors (their lock)

    def __init__(self, *, optimizer: Any, rounds: Any, params: Any = None, scheduler: Any = None,
                 initialize_optimizer: bool | None = None, offload_optimizer: bool = False,
                 custom_gradients: bool = False, reuse_tensors: bool | None = None,
                 delta_rule_averaging: bool = False, average_opt_statistics: Sequence[str] = (),
                 extra_tensors: Sequence[torch.Tensor] = (), allreduce_timeout: float = 30.0,
                 status_loglevel: int = logging.DEBUG):
        if reuse_tensors is None:
            reuse_tensors = offload_optimizer and not delta_rule_averaging
        if reuse_tensors and delta_rule_averaging:
            raise ValueError("reuse_tensors and delta_rule_averaging are mutually exclusive")
        groups = param_groups(optimizer, params)
        self.rounds, self.status_loglevel, self.allreduce_timeout = rounds, status_loglevel, allreduce_timeout
        self.offload_optimizer, self.custom_gradients = offload_optimizer, custom_gradients
        self.reuse_tensors, self.delta_rule_averaging = reuse_tensors, delta_rule_averaging
        self.main_parameters = tuple(chain.from_iterable(group["params"] for group in groups))
        if len(set(self.main_parameters)) != len(self.main_parameters):
            raise ValueError("params holds a parameter twice")
        self.parameter_names = tuple(range(len(self.main_parameters)))
        self._averaged_parameters = tuple(self._host_tensor(p, copy=offload_optimizer) for p in self.main_parameters)
        self.optimizer, self.scheduler = build_components(groups, optimizer, scheduler, initialize_optimizer,
                                                          offload_optimizer, reuse_tensors, self._averaged_parameters)
        self.opt_keys_for_averaging, self.extra_tensors = tuple(average_opt_statistics), tuple(extra_tensors)
        local = tuple(self._local_tensors())
        self._averaged_tensors = (*(t.detach() for t in self._averaged_parameters),
                                  *map(self._host_tensor, local[len(self.main_parameters):]))
        self._averaged_infos = round_infos(self._averaged_tensors, len(self.main_parameters),
                                           self.opt_keys_for_averaging, len(self.extra_tensors))
        self._old_tensors: tuple[torch.Tensor, ...] | None = None  # (delta rule: the tensors a round was handed)
        self._average_ready = False  # the averaged tensors hold a round's average not applied yet (not reused)
        self._label_lock = threading.Lock()
        self._epoch = 0
        self._steps_owed = 0  # epochs counted whose optimizer step has not run yet (the served epoch is behind)
        self._step_with_increment = False  # the epoch step() counts next comes with an optimizer step
        self._no_boundary = threading.Event()  # cleared while a boundary's foreground parameter round is unfinished
        self._no_boundary.set()
        self.step_executor = concurrent.futures.ThreadPoolExecutor(max_workers=2 if delta_rule_averaging else 1)
        self.finished_optimizer_step, self.finished_averaging_round = threading.Event(), threading.Event()
        self._ended_late = threading.Event()  # a round that outlived its step's wait ended (the next step installs it)
        self.lock_optimizer, self.lock_averaged_tensors = threading.Lock(), threading.Lock()
        self.lock_averaging = threading.Lock()
        self.pending_updates: set[concurrent.futures.Future] = set()

    # ---- building

    def _host_tensor(self, source: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """``source`` itself where tensors are reused (it must be on the CPU), else a float32 host copy."""
        if self.reuse_tensors and not copy:
            if source.device.type != "cpu":
                raise ValueError("reuse_tensors needs every averaged tensor on the CPU")
            return source
        return source.detach().to(device="cpu", dtype=torch.float32, copy=True).requires_grad_(source.requires_grad)

    def _local_tensors(self) -> Iterator[torch.Tensor]:
        """The tensors a parameter round averages: the optimizer's parameters, the averaged statistics, extras."""
        for group in self.optimizer.param_groups:
            yield from group["params"]
        for key in self.opt_keys_for_averaging:
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    yield self.optimizer.state[param][key]
        yield from self.extra_tensors

    # ---- the epoch

    @property
    def local_epoch(self) -> int:
        return self._epoch

    @local_epoch.setter
    def local_epoch(self, value: int) -> None:
        with self._label_lock:  # step() counts the epoch (+1) before that epoch's optimizer step runs
            if self._step_with_increment and value == self._epoch + 1:
                self._steps_owed += 1
                self._step_with_increment = False
            self._epoch = value

    def served_epoch(self) -> int:
        """The epoch whose update the optimizer's parameters hold (behind :attr:`local_epoch` while a counted
        epoch's optimizer step has not run). Call under ``lock_optimizer``."""
        with self._label_lock:
            return self._epoch - self._steps_owed

    def _pay(self) -> None:
        with self._label_lock:
            self._steps_owed -= 1

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """The averaged tensors, under ``lock_averaged_tensors``."""
        with self.lock_averaged_tensors:
            yield self._averaged_tensors

    @property
    def averaging_in_progress(self) -> bool:
        return self.lock_averaging.locked()

    # ---- the step

    def step(self, wait_for_delayed_updates: bool | None = None, apply_delayed_updates: bool = True,
             increment_epoch: bool = False, optimizer_step: bool = False, zero_grad: bool = False,
             delay_optimizer_step: bool = False, averaging_round: bool = False, delay_averaging: bool | None = None,
             averaging_control: ParameterRound | None = None, wait_for_trigger: Any = None,
             averaging_opts: dict[str, Any] | None = None) -> None:
        """hivemind's ``TrainingStateAverager.step``, with its arguments' meanings (see the module)."""
        if delay_averaging is None:
            delay_averaging = delay_optimizer_step
        should_wait = averaging_round or optimizer_step or zero_grad if self.delta_rule_averaging else averaging_round
        if wait_for_delayed_updates is None:
            wait_for_delayed_updates = should_wait
        if should_wait and not (wait_for_delayed_updates and apply_delayed_updates):
            raise ValueError("a new round or step waits for the background ones first")
        if delay_optimizer_step and not (self.offload_optimizer and delay_averaging):
            raise ValueError("a delayed optimizer step needs offload_optimizer and delayed averaging")
        timeout = (averaging_opts or {}).get("timeout")
        if wait_for_delayed_updates:
            for pending in list(self.pending_updates):
                try:
                    pending.result(timeout if timeout is not None else self.allreduce_timeout)
                except BaseException:
                    if not pending.done():
                        pending.cancel()
        finished = {pending for pending in self.pending_updates if pending.done()}
        self.pending_updates -= finished
        if apply_delayed_updates:
            self._apply_finished()
        self._step_with_increment = increment_epoch and optimizer_step
        pays = self._step_with_increment
        if increment_epoch:
            self.local_epoch += 1
        self._step_with_increment = False
        if not (optimizer_step or zero_grad or averaging_round):
            return
        boundary = increment_epoch and averaging_round and not delay_averaging and not delay_optimizer_step
        if boundary:
            self._no_boundary.clear()
        try:
            if self.offload_optimizer and not self.custom_gradients:
                self._load_local_grads_into_optimizer_()
            failed: list[Exception] = []  # (the optimizer step's error: raised here where it is awaited)
            pending = self.step_executor.submit(self._do, wait_for_trigger, optimizer_step, zero_grad,
                                                averaging_round, averaging_control, pays, timeout, failed)
            self.pending_updates.add(pending)
            await_optimizer = (optimizer_step or zero_grad) and not delay_optimizer_step
            await_averaging = averaging_round and not delay_averaging
            if await_optimizer:
                self.finished_optimizer_step.wait()
                self.finished_optimizer_step.clear()
                if failed:
                    self.pending_updates.discard(pending)
                    raise failed[0]
                if self.offload_optimizer and not await_averaging:
                    self._apply_optimizer_parameters_()
            if await_averaging:
                self.finished_averaging_round.wait()
                self.finished_averaging_round.clear()
                self._apply_averaging_results_()
                if self.offload_optimizer:
                    self._apply_optimizer_parameters_()
            if not ((averaging_round and delay_averaging) or ((optimizer_step or zero_grad) and delay_optimizer_step)):
                try:
                    pending.result()
                finally:
                    self.pending_updates.discard(pending)
        finally:
            self._no_boundary.set()

    def _apply_finished(self) -> None:
        """Apply a background round's average and a background optimizer step that finished."""
        background, late = self.finished_averaging_round.is_set(), self._ended_late.is_set()
        if background:  # (each cleared before its average is applied: a round that ends meanwhile sets it anew)
            self.finished_averaging_round.clear()
        if late:
            self._ended_late.clear()
        if background or late:
            self._apply_averaging_results_()
            if self.offload_optimizer and not self.finished_optimizer_step.is_set():
                self._apply_optimizer_parameters_()
        if self.finished_optimizer_step.is_set():
            if self.offload_optimizer:
                self._apply_optimizer_parameters_()
            self.finished_optimizer_step.clear()

    def _do(self, wait_for_trigger: Any, optimizer_step: bool, zero_grad: bool, averaging_round: bool,
            control: ParameterRound | None, pays: bool, timeout: float | None, failed: list[Exception]) -> Any:
        """(the executor) The optimizer step, the scheduler and the parameter round, each where asked."""
        timeout = timeout if timeout is not None else self.allreduce_timeout
        if control is not None and (control.triggered or control.done() or control.scheduled.done()):
            logger.log(self.status_loglevel, "collabopt: a parameter round scheduled earlier ended: a new one")
            control = None
        began = stepped = False
        try:
            if averaging_round and control is None:
                control = self.rounds.schedule(self._averaged_tensors, self.local_epoch, timeout, self._averaged_infos)
            if wait_for_trigger is not None:
                wait_for_trigger()
            began = True
            with self.lock_optimizer:
                if optimizer_step:
                    self._drop_late_round()
                    with self.lock_averaged_tensors if self.reuse_tensors else contextlib.nullcontext():
                        self.optimizer.step()
                    if pays:  # (only a step that ran pays its epoch: else the served state stays labelled behind)
                        self._pay()
                if zero_grad:
                    self.optimizer.zero_grad()
                self._update_scheduler()
                stepped = True
                self.finished_optimizer_step.set()
            if averaging_round:
                assert control is not None
                self._average(control, timeout)
        except Exception as e:
            logger.exception("collabopt: the training state's step failed%s", "" if began else " (its trigger raised)")
            if control is not None and not control.done():
                with contextlib.suppress(RuntimeError):  # (the service's loop closed at shutdown: the round is gone)
                    control.cancel()
            if began and not stepped:  # (the optimizer step itself raised: its epoch stays owed, served behind)
                failed.append(e)
            elif pays and not began:  # (its trigger raised, as a failed round: no step comes, none is owed)
                self._pay()
            self.finished_optimizer_step.set()
            self.finished_averaging_round.set()

    def _average(self, control: ParameterRound, timeout: float) -> None:
        with self.lock_averaging:
            with self.lock_averaged_tensors:  # (a round before it that ends late writes nothing from now on)
                self._writer = control
            if not self.reuse_tensors:
                self._load_local_tensors_into_averager_()
            if self.delta_rule_averaging:
                with torch.no_grad(), self.get_tensors() as averaged:
                    self._old_tensors = tuple(t.detach().cpu().clone() for t in averaged)
            try:
                gathered = self.rounds.finish(control, self._averaged_tensors, self.lock_averaged_tensors, timeout,
                                              functools.partial(self._may_write, control),
                                              late=self._ended_late.set)
                logger.log(self.status_loglevel, "collabopt: parameters averaged with %d peers", len(gathered))
            except RoundFailed as e:
                logger.log(self.status_loglevel, "collabopt: the parameter round failed (%s)", e)
            with self.lock_averaged_tensors:  # (decided: its result is not kept a whole epoch; no older round writes)
                if self._writer is control and not control.in_background:
                    self._writer = None
            self.finished_averaging_round.set()

    def _may_write(self, control: ParameterRound) -> bool:
        """(under ``lock_averaged_tensors``) Whether ``control``'s average may be written (see the module); if so,
        the next step applies it."""
        if self._writer is not control:
            return False
        self._average_ready = True
        return True

    def _replaced(self) -> None:
        """(under ``lock_averaged_tensors``) A downloaded state replaced the averaged tensors: no round handed them
        before writes its average over it, and no average of the old state is applied."""
        self._writer, self._average_ready = None, False

    def _drop_late_round(self) -> None:
        """An optimizer step comes before a round in the background ended: the round was handed the tensors before
        this step, so its average would undo the step's update (the delta rule adds only what the round changed)."""
        if self.delta_rule_averaging:
            return
        with self.lock_averaged_tensors:
            if self._writer is not None and self._writer.in_background:
                self._writer = None
                logger.log(self.status_loglevel, "collabopt: a parameter round still in the background writes "
                           "nothing: an optimizer step came first")

    def _install_late(self) -> None:
        """(under ``lock_averaged_tensors``) The average of a round that outlived its step's wait and has ended."""
        control = self._writer
        if control is None:
            return
        try:
            gathered = self.rounds.install_late(control, self._averaged_tensors,
                                                functools.partial(self._may_write, control))
        except RoundFailed as e:
            self._writer = None
            logger.log(self.status_loglevel, "collabopt: the parameter round in the background failed (%s)", e)
            return
        if gathered is not None:
            self._writer = None
        if gathered:
            logger.log(self.status_loglevel, "collabopt: parameters averaged with %d peers (in the background)",
                       len(gathered))

    # ---- moving tensors

    @torch.no_grad()
    def _load_local_grads_into_optimizer_(self) -> None:
        """The model's gradients into the offloaded optimizer's."""
        offloaded = [param for group in self.optimizer.param_groups for param in group["params"]]
        for main, param in zip(self.main_parameters, offloaded, strict=True):
            if main.grad is not None:
                if param.grad is None:
                    param.grad = main.grad.clone()
                else:
                    param.grad.copy_(main.grad, non_blocking=True)

    @torch.no_grad()
    def _apply_optimizer_parameters_(self) -> None:
        """The offloaded optimizer's parameters into the model's."""
        offloaded = [param for group in self.optimizer.param_groups for param in group["params"]]
        for main, param in zip(self.main_parameters, offloaded, strict=True):
            main.copy_(param, non_blocking=True)

    @torch.no_grad()
    def _load_local_tensors_into_averager_(self) -> None:
        with self.get_tensors() as averaged:
            for local, copy in zip(self._local_tensors(), averaged, strict=True):
                copy.copy_(local, non_blocking=True)

    @torch.no_grad()
    def _apply_averaging_results_(self) -> None:
        """The averaged tensors into the local ones (with the delta rule: what the round changed is added), under
        ``lock_optimizer``: an average is never served half copied. A round in the background that ended is
        installed first (in place: where tensors are reused, that is all)."""
        with self.lock_optimizer, self.get_tensors() as averaged:
            self._install_late()
            ready, self._average_ready = self._average_ready, False
            if not ready or self.reuse_tensors:  # (the round failed, or is still under way: the local tensors stay)
                return
            old, self._old_tensors = self._old_tensors, None
            for i, (local, new) in enumerate(zip(self._local_tensors(), averaged, strict=True)):
                if not self.delta_rule_averaging:
                    local.copy_(new, non_blocking=True)
                elif old is not None:
                    local.add_(torch.sub(new, old[i]).to(device=local.device, dtype=local.dtype))

    def _update_scheduler(self) -> None:
        """Step the scheduler until it is at :attr:`local_epoch`."""
        if self.scheduler:
            while self.scheduler._step_count <= self.local_epoch:
                self.scheduler.step()

    # ---- the services

    def is_alive(self) -> bool:
        return self.rounds.is_alive()

    def shutdown(self) -> None:
        """Stop: steps not begun are dropped (no worker outlives the peer)."""
        self.step_executor.shutdown(wait=False, cancel_futures=True)
        self.rounds.shutdown()


__all__ = ["TrainingState"]
