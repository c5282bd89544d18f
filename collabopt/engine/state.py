"""This peer's training state as the swarm sees it: the state it serves, the downloads it installs, and the
answers to download challenges.

:class:`ConsistentStateAverager` is collabopt's training state (:class:`~collabopt.engine.training_state.
TrainingState`, with its parameter rounds), giving the state it serves an epoch and tensors that belong together in
hivemind's layout, and installing downloaded states. Serving and downloading are collabopt's state service
(:mod:`collabopt.engine.state_service`, :mod:`collabopt.engine.downloads`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, TensorRole
from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state

from collabopt.engine.compat import HIVEMIND_REQUEST_TIMEOUT
from collabopt.engine.download_votes import DownloadVotes
from collabopt.engine.parameter_rounds import NoRounds, ParameterRound, ParameterRounds
from collabopt.engine.training_state import TrainingState

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


SERVE_WAIT_SHARE = 0.5  # of the downloader's chunk timeout (taken as this peer's), a download waits out a boundary
DECLINED: tuple[dict, list, list] = ({}, [], [])  # no tensors: hivemind sends nothing, the next peer is tried
STEP_WAIT = 1.0  # seconds a challenge's copy of the parameters waits for an optimizer step to end


class ConsistentStateAverager(TrainingState):
    """collabopt's training state (:class:`~collabopt.engine.training_state.TrainingState`), whose state the state
    service serves (:meth:`served_state`) and whose downloads it installs (:meth:`install_state`). With
    ``verify_downloads=True`` downloads install only states most of the swarm holds and this peer answers download
    challenges (:mod:`collabopt.engine.downloads`; :attr:`votes` is set by the loop, which has the key to sign this
    peer's vote with).

    A state is served as a copy taken while no optimizer step runs, labelled with the epoch whose update its
    parameters hold. It is not served during a boundary (:meth:`closed_for_downloads`, and a step's foreground
    parameter round): that state is about to be an epoch old. A download waits for the boundary's end for a share
    (:data:`SERVE_WAIT_SHARE`) of the chunk timeout, which is how long the downloader waits for the first part, then
    gets an empty answer and tries the next peer. See docs/decisions.md, "Consistent state serving".

    Its arguments are hivemind's ``TrainingStateAverager``'s, and of its ``averager_opts`` those that have a meaning
    for collabopt's parameter rounds (:class:`~collabopt.engine.parameter_rounds.ParameterRounds`:
    ``request_timeout``, ``target_group_size``, ``min_group_size``, ``sender_timeout``, ``reducer_timeout``,
    ``aggregation``); the others (``bandwidth``, ``initial_group_bits``...) are accepted and unused.
    ``parameter_rounds=False``: no parameter round ever (DiLoCo), and no averaging service."""

    votes: DownloadVotes | None = None  # this peer's and the swarm's votes, where downloads are verified
    model_names: list[str] | None = None  # the model's names of the parameters (set by the optimizer; the served
    # state's keys are parameter_names, the parameters' indices, as hivemind's)

    def __init__(self, *, dht: Any, prefix: str, optimizer: Any, min_matchmaking_time: float = 5.0,
                 allreduce_timeout: float = 30.0, request_timeout: float = HIVEMIND_REQUEST_TIMEOUT,
                 next_chunk_timeout: float | None = None, sender_timeout: float | None = None,
                 reducer_timeout: float | None = None,
                 target_group_size: int | None = None, min_group_size: int | None = None, aggregation: str = "mean",
                 compression: CompressionBase = NoCompression(), state_compression: CompressionBase = NoCompression(),
                 client_mode: bool = False, auxiliary: bool = False, verify_downloads: bool = False,
                 parameter_rounds: bool = True, status_loglevel: int = logging.DEBUG, **kwargs: Any):
        state_options = {key: kwargs.pop(key) for key in self._STATE_OPTIONS if key in kwargs}
        if kwargs:
            logger.debug("collabopt: averager options without a meaning for its parameter rounds: %s", sorted(kwargs))
        self.dht, self.prefix, self.client_mode, self.auxiliary = dht, prefix, client_mode, auxiliary
        self.verify_downloads, self.state_compression = verify_downloads, state_compression
        self._chunk_timeout = next_chunk_timeout if next_chunk_timeout is not None else request_timeout
        self._allow_state_sharing = not client_mode and not auxiliary
        self._state_sharing_priority = 0.0
        self.sharing_changed: Any = lambda: None  # (set by the state service: it declares this peer's state anew)
        self._open_for_downloads = threading.Event()  # cleared while the loop ends an epoch (closed_for_downloads)
        self._open_for_downloads.set()
        self._closing_lock, self._closings = threading.Lock(), 0  # (closed_for_downloads nests)
        rounds = ParameterRounds(
            dht, prefix=prefix, matchmaking_time=min_matchmaking_time, timeout=allreduce_timeout,
            sender_timeout=sender_timeout or next_chunk_timeout or min_matchmaking_time,
            request_timeout=request_timeout, reducer_timeout=reducer_timeout, target_group_size=target_group_size,
            min_group_size=min_group_size, aggregation=aggregation, compression=compression,
            client_mode=client_mode, auxiliary=auxiliary) if parameter_rounds else NoRounds()
        try:
            super().__init__(optimizer=optimizer, rounds=rounds, allreduce_timeout=allreduce_timeout,
                             status_loglevel=status_loglevel, **state_options)
        except BaseException:
            rounds.shutdown()
            raise

    _STATE_OPTIONS = ("params", "scheduler", "initialize_optimizer", "offload_optimizer", "custom_gradients",
                      "reuse_tensors", "delta_rule_averaging", "average_opt_statistics", "extra_tensors")

    # ---- sharing, as hivemind's averagers declare it

    @property
    def allow_state_sharing(self) -> bool:
        """Whether others may download this peer's state."""
        return self._allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if value and self.client_mode:
            raise ValueError("a client-mode peer cannot share its state (others cannot reach it)")
        changed, self._allow_state_sharing = value != self._allow_state_sharing, bool(value)
        if changed:
            self.sharing_changed()

    @property
    def state_sharing_priority(self) -> float:
        """Downloads prefer the peers of the highest priority (this peer's epoch, or below the others')."""
        return self._state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        if value and self.client_mode:
            raise ValueError("a client-mode peer shares no state: it has no priority")
        changed, self._state_sharing_priority = value != self._state_sharing_priority, float(value)
        if changed and self._allow_state_sharing:
            self.sharing_changed()

    # ---- the parameter rounds

    @property
    def group_size_hint(self) -> tuple[int, int] | None:
        """(epoch, peers): the peers of this epoch's gradient round, who go on to its parameter round now."""
        return self.rounds.group_size_hint

    @group_size_hint.setter
    def group_size_hint(self, value: tuple[int, int] | None) -> None:
        self.rounds.group_size_hint = value

    def schedule_parameter_round(self, timeout: float) -> ParameterRound:
        """Begin matchmaking for the parameter round of the boundary about to be stepped (pass it to :meth:`step` as
        ``averaging_control``), sized by :attr:`group_size_hint`. The caller holds the round: it sees it fail."""
        return self.rounds.schedule(self._averaged_tensors, self.local_epoch + 1, timeout,  # (the step's epoch)
                                    self._averaged_infos)

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
        """The state served, in hivemind's layout (``get_current_state``'s: metadata with the epoch and optimizer
        metadata; the optimizer's parameters, the extra tensors, the optimizer statistics; their compression
        infos): copies taken while no optimizer step runs, so that plain hivemind peers download it too."""
        with self.lock_optimizer, self.lock_averaged_tensors, torch.no_grad():  # no step, no average meanwhile
            epoch = self.served_epoch()
            parameters = [p.detach().to("cpu", copy=True) for g in self.optimizer.param_groups for p in g["params"]]
            extras = [t.detach().to("cpu", copy=True) for t in self.extra_tensors]
            optimizer_metadata, statistics = dump_optimizer_state(self.optimizer)
            statistics = [t.clone() if t.device.type == "cpu" else t for t in statistics]  # (.cpu() copied the rest)
        infos = [*(CompressionInfo.from_tensor(p, key=key, role=TensorRole.PARAMETER)
                   for p, key in zip(parameters, self.parameter_names, strict=True)),
                 *(CompressionInfo.from_tensor(t, key=i, role=TensorRole.UNSPECIFIED) for i, t in enumerate(extras)),
                 *(CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER) for i, t in enumerate(statistics))]
        metadata = dict(epoch=epoch, group_bits="", optimizer_metadata=optimizer_metadata)
        return metadata, [*parameters, *extras, *statistics], infos

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
                self._replaced()  # (no round handed the old state writes its average over this one)
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
        """(a download's secret challenge) The epoch and a copy of the parameters this peer serves
        (the optimizer's: what its vote fingerprints; no optimizer state). None mid-boundary, rather than wait for
        it (a challenge has its own timeout), or if an optimizer step holds them over :data:`STEP_WAIT`."""
        if not self._no_boundary.is_set() or not self.lock_optimizer.acquire(timeout=STEP_WAIT):
            return None
        try:
            epoch = self.served_epoch()
            with self.lock_averaged_tensors:  # (as a download's copy: DiLoCo writes its anchors under it)
                return epoch, [p.detach().clone() if p.device.type == "cpu" else p.detach().cpu()
                               for group in self.optimizer.param_groups for p in group["params"]]
        finally:
            self.lock_optimizer.release()
