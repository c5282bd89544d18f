"""This peer's training state: parameters, optimizer statistics, epoch, scheduler, and their parameter rounds.

:class:`ConsistentStateAverager` is hivemind's state averager, giving the state it serves an epoch and tensors that
belong together, sizing the parameter-averaging group from the gradient round, and installing downloaded states.
Serving and downloading are collabopt's state service (:mod:`collabopt.engine.state_service`,
:mod:`collabopt.engine.downloads`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from hivemind.optim.state_averager import TrainingStateAverager, load_optimizer_state

from collabopt.engine.averaging import ShieldedReducers
from collabopt.engine.compat import HIVEMIND_REQUEST_TIMEOUT, SameHandlers
from collabopt.engine.download_votes import DownloadVotes
from collabopt.engine.member_checks import MemberChecks

logger = logging.getLogger(__name__)

# Parameter averaging in place: where the round runs inside step() on float32 CPU parameters, nothing else touches
# them during the round, so the averager averages the parameters themselves (hivemind's reuse_tensors) instead of a
# copy (1x the parameters less). See docs/decisions.md, "Parameter averaging in place".
AVERAGE_PARAMETERS_IN_PLACE = True


def averages_parameters_in_place(optimizer: Any, arguments: dict[str, Any]) -> bool:
    """Whether the state averager of ``optimizer`` (a ``hivemind.Optimizer`` being built; ``arguments`` those of
    its ``_make_state_averager``) can average the parameters themselves instead of a copy (see above): not offloaded
    (hivemind reuses the offloaded copy already), averaged inside step(), nothing averaged but float32 CPU
    parameters."""
    if not AVERAGE_PARAMETERS_IN_PLACE or optimizer.offload_optimizer or optimizer.delay_state_averaging:
        return False
    if any(arguments.get(key) for key in ("delta_rule_averaging", "average_opt_statistics", "extra_tensors")):
        return False
    inner, params = arguments.get("optimizer"), arguments.get("params")
    if params is None and isinstance(inner, torch.optim.Optimizer):
        params = inner.param_groups
    if params is None:
        return False
    if not isinstance(params, (list, tuple)):
        params = arguments["params"] = tuple(params)  # (an iterator: hivemind reads it after us)
    tensors: list[torch.Tensor] = []
    for item in params:
        group = item.get("params") if isinstance(item, dict) else [item]
        if not isinstance(group, (list, tuple)):
            return False
        tensors.extend(group)
    return bool(tensors) and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float32
                                 for t in tensors)


class _EventThatCalls(threading.Event):
    """A ``threading.Event`` that calls ``before_set`` each time it is set."""

    def __init__(self, before_set: Callable[[], None]):
        super().__init__()
        self._before_set = before_set

    def set(self) -> None:
        self._before_set()
        super().set()


SERVE_WAIT_SHARE = 0.5  # of the downloader's chunk timeout (taken as this peer's), a download waits out a boundary
DECLINED: tuple[dict, list, list] = ({}, [], [])  # no tensors: hivemind sends nothing, the next peer is tried
STEP_WAIT = 1.0  # seconds a challenge's copy of the parameters waits for an optimizer step to end


class ConsistentStateAverager(SameHandlers, MemberChecks, ShieldedReducers, TrainingStateAverager):
    """hivemind's state averager, whose state the state service serves (:meth:`served_state`) and whose downloads
    it installs (:meth:`install_state`). With ``verify_downloads=True`` downloads install only states most of the
    swarm holds and this peer answers download challenges (:mod:`collabopt.engine.downloads`; :attr:`votes` is set
    by the loop, which has the key to sign this peer's vote with).

    A state is served as a copy taken while no optimizer step runs, labelled with the epoch whose update its
    parameters hold: hivemind 1.1.12 served live tensors with an epoch read apart from them. It is not served during
    a boundary (:meth:`closed_for_downloads`, and a step's foreground parameter averaging): that state is about to be
    an epoch old. A download waits for the boundary's end for a share (:data:`SERVE_WAIT_SHARE`) of the chunk
    timeout, which is how long the downloader waits for the first part, then gets an empty answer and tries the next
    peer. See docs/decisions.md, "Consistent state serving"."""

    # hivemind's download RPC is the state service's (under hivemind's name); this averager's own is unreachable
    served_elsewhere = ("rpc_download_state",)
    votes: DownloadVotes | None = None  # this peer's and the swarm's votes, where downloads are verified
    model_names: list[str] | None = None  # the model's names of the parameters (set by the optimizer; hivemind's own
    # parameter_names are the keys of its served state, and stay as they are)

    def __init__(self, *args: Any, verify_downloads: bool = False, **kwargs: Any):
        self.verify_downloads = verify_downloads
        self._label_lock = threading.Lock()
        self._epoch = 0
        self._steps_owed = 0  # epochs counted whose optimizer step has not run yet
        self._step_with_increment = False  # the epoch step() counts next comes with an optimizer step
        self._owes: collections.deque[bool] = collections.deque()  # per submitted _do: does it pay one?
        self._paying = False  # the _do running now pays one when its optimizer step runs
        self._no_boundary = threading.Event()  # cleared while a boundary's foreground averaging is unfinished
        self._no_boundary.set()
        self._open_for_downloads = threading.Event()  # cleared while the loop ends an epoch (closed_for_downloads)
        self._open_for_downloads.set()
        self._closing_lock, self._closings = threading.Lock(), 0  # (closed_for_downloads nests)
        chunk_timeout = kwargs.get("next_chunk_timeout")  # (hivemind's, in the averager's process only)
        self._chunk_timeout = chunk_timeout if chunk_timeout is not None else kwargs.get(
            "request_timeout", HIVEMIND_REQUEST_TIMEOUT)
        super().__init__(*args, **kwargs)
        # _do sets this event right after the optimizer step, still holding lock_optimizer: the step is paid there
        self.finished_optimizer_step = _EventThatCalls(self._pay)

    @property
    def local_epoch(self) -> int:
        return self._epoch

    @local_epoch.setter
    def local_epoch(self, value: int) -> None:
        with self._label_lock:  # hivemind's step() counts the epoch (+1) before that epoch's optimizer step runs
            if self._step_with_increment and value == self._epoch + 1:
                self._steps_owed += 1
                self._step_with_increment = False
            self._epoch = value

    # (epoch, peers): the peers of this epoch's gradient round, who go on to its parameter averaging now
    group_size_hint: tuple[int, int] | None = None

    def step(self, *args: Any, increment_epoch: bool = False, optimizer_step: bool = False,
             zero_grad: bool = False, averaging_round: bool = False, **kwargs: Any) -> Any:
        if averaging_round and kwargs.get("averaging_control") is None:
            self._size_next_group()
        self._step_with_increment = increment_epoch and optimizer_step
        if optimizer_step or zero_grad or averaging_round:  # hivemind submits one _do for this call
            self._owes.append(increment_epoch and optimizer_step)
        boundary = (increment_epoch and averaging_round and not kwargs.get("delay_averaging")
                    and not kwargs.get("delay_optimizer_step"))  # step() returns once the result is applied
        if boundary:
            self._no_boundary.clear()
        try:
            return super().step(*args, increment_epoch=increment_epoch, optimizer_step=optimizer_step,
                                zero_grad=zero_grad, averaging_round=averaging_round, **kwargs)
        finally:
            self._step_with_increment = False
            self._no_boundary.set()

    def schedule_parameter_round(self, timeout: float) -> Any:
        """Begin matchmaking for the parameter round of the boundary about to be stepped (pass the control to
        :meth:`step` as ``averaging_control``), sized like the one :meth:`step` would begin. The caller holds the
        control: it sees the round fail, which hivemind's step only logs."""
        self._size_next_group()
        return self.schedule_step(gather=self.local_epoch + 1, timeout=timeout)  # (gathered as step()'s would be)

    def _size_next_group(self) -> None:
        """Set the next parameter averaging's ``target_group_size`` to :attr:`group_size_hint` (for this epoch),
        bounded by the user's: the peers of the epoch's gradient round reach the boundary together, so the group
        assembles as soon as they are in instead of idling a whole ``matchmaking_time``. See docs/decisions.md,
        "Group size hint"."""
        hint, self.group_size_hint = self.group_size_hint, None
        size = hint[1] if hint is not None and hint[0] == self.local_epoch else None
        configured = self.matchmaking_kwargs.get("target_group_size")
        if configured is not None:
            size = configured if size is None else min(size, configured)
        if size is not None:  # (a full group assembles at once: never one smaller than min_group_size allows)
            size = max(size, self.matchmaking_kwargs.get("min_group_size", 2))
        self._outer_pipe.send(("_set_target_group_size", [size], {}))  # before the step's own message

    async def _set_target_group_size(self, size: int | None) -> None:
        self._matchmaking.target_group_size = size  # (runs in the averager's process)

    def _do(self, *args: Any, **kwargs: Any) -> Any:
        self._paying = self._owes.popleft() if self._owes else False
        try:
            return super()._do(*args, **kwargs)
        finally:
            self._pay()  # the step did not run (an aborted trigger): it is owed no more

    def _pay(self) -> None:
        if self._paying:
            self._paying = False
            with self._label_lock:
                self._steps_owed -= 1

    def _apply_averaging_results_(self) -> None:
        with self.lock_optimizer:  # the copy of a round's result into the parameters is not served half done
            super()._apply_averaging_results_()

    @contextlib.contextmanager
    def closed_for_downloads(self) -> Iterator[None]:
        """Serve no download while the loop ends an epoch (from its gradient round to its parameter round) or a
        download is installed: a state served then is the epoch about to end, and its downloader, having missed that
        round, downloads again. Nested uses (an install during an epoch's end) reopen at the outermost's end."""
        with self._closing_lock:
            self._closings += 1
            self._open_for_downloads.clear()
        try:
            yield
        finally:
            with self._closing_lock:
                self._closings -= 1
                if self._closings == 0:
                    self._open_for_downloads.set()

    @property
    def chunk_timeout(self) -> float:
        """Seconds a download waits for each part of a state (hivemind's ``next_chunk_timeout``, else its
        ``request_timeout``)."""
        return self._chunk_timeout

    def serve_wait(self) -> float:
        """Seconds a download waits for a boundary to end (see the class)."""
        return SERVE_WAIT_SHARE * self._chunk_timeout

    def served_state(self) -> Any:
        """(the state service's executor) The state a download gets, as hivemind's ``get_current_state`` (metadata,
        tensors, infos): :meth:`state_copy`, after a boundary under way ends; :data:`DECLINED` where that takes
        longer than :meth:`serve_wait`."""
        wait = self.serve_wait()
        deadline = time.monotonic() + wait
        if not (self._open_for_downloads.wait(wait)
                and self._no_boundary.wait(max(0.0, deadline - time.monotonic()))):
            logger.debug("collabopt: a download came during a boundary that outlasted its wait: declined")
            return DECLINED
        return self.state_copy()

    def state_copy(self) -> Any:
        """The state served, as hivemind's ``get_current_state``: a copy taken while no optimizer step runs."""
        with self.lock_optimizer:  # no optimizer step runs meanwhile
            with self._label_lock:
                epoch = self._epoch - self._steps_owed
            metadata, tensors, infos = self.get_current_state()
            # copies, taken now: on CPU, hivemind's tensors are the live ones (GPU ones were copied by .cpu())
            tensors = [t.detach().clone() if t.device.type == "cpu" else t.detach().cpu() for t in tensors]
        return dict(metadata, epoch=epoch), tensors, infos

    def install_state(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """Install a downloaded state (hivemind's layout: parameters, extra tensors, optimizer statistics; the
        metadata's epoch and optimizer metadata), as hivemind's ``TrainingStateAverager.load_state_from_peers``
        installs what it downloads. Refused (False, logged) where its epoch is behind this peer's, it is short, or a
        tensor's shape is not this peer's. The whole install, its epoch included, runs closed for downloads and
        under ``lock_optimizer`` (then ``lock_averaged_tensors``, the order :meth:`state_copy` takes them in): a
        download served meanwhile gets the state before it or after it, never new tensors under the old epoch."""
        main = [*(p for group in self.optimizer.param_groups for p in group["params"]), *self.extra_tensors]
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        with self.closed_for_downloads(), self.lock_optimizer:
            if type(epoch) is not int or epoch < self.local_epoch:
                logger.warning("collabopt: a downloaded state of epoch %r is behind this peer's (%d): not installed",
                               epoch, self.local_epoch)
                return False
            if len(tensors) < len(main) or any(t.shape != p.shape for t, p in zip(tensors, main, strict=False)):
                logger.error("collabopt: a downloaded state's %d tensors are not this peer's %d parameters and "
                             "extras: not installed", len(tensors), len(main))
                return False
            with torch.no_grad(), self.lock_averaged_tensors:
                try:
                    load_optimizer_state(self.optimizer, metadata["optimizer_metadata"], tensors[len(main):])
                except StopIteration:
                    logger.warning("collabopt: a downloaded state's optimizer statistics do not fit: not installed")
                    return False
                for local, loaded in zip(main, tensors, strict=False):
                    local.copy_(loaded, non_blocking=True)
            if self.offload_optimizer:
                self._apply_optimizer_parameters_()
            if not self.reuse_tensors:
                self._load_local_tensors_into_averager_()  # (takes lock_averaged_tensors itself)
            self.local_epoch = epoch
            self._update_scheduler()
        return True

    def challenge_state(self) -> tuple[int, list[torch.Tensor]] | None:
        """(host process; a download's secret challenge) The epoch and a copy of the parameters this peer serves
        (the optimizer's: what its vote fingerprints; no optimizer state). None mid-boundary, rather than wait for
        it (a challenge has its own timeout), or if an optimizer step holds them over :data:`STEP_WAIT`."""
        if not self._no_boundary.is_set() or not self.lock_optimizer.acquire(timeout=STEP_WAIT):
            return None
        try:
            with self._label_lock:
                epoch = self._epoch - self._steps_owed
            with self.lock_averaged_tensors:  # (as a download's copy: DiLoCo writes its anchors under it)
                return epoch, [p.detach().clone() if p.device.type == "cpu" else p.detach().cpu()
                               for group in self.optimizer.param_groups for p in group["params"]]
        finally:
            self.lock_optimizer.release()
