"""Every use of hivemind beyond its documented constructor arguments, behind one module.

collabopt drives ``hivemind.Optimizer`` through a handful of internals (its progress tracker, state averager and
gradient averager). They are reached only from here, and ``pyproject.toml`` pins the hivemind version this module
was tested with (``hivemind==1.1.12``), so a hivemind upgrade is this one file's work. The rest of the package talks
to :class:`HivemindPeer`, whose small surface is also what the in-process fakes of ``tests/unit`` implement.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import inspect
import logging
import multiprocessing
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from hivemind.dht.validation import RecordValidatorBase

from collabopt import lineage
from collabopt.lifeline import children_follow_parent

try:  # hivemind >= 1.1.11 vendors its multiaddr implementation
    from hivemind.utils.multiaddr import Multiaddr
except ImportError:  # pragma: no cover - older layouts
    from multiaddr import Multiaddr

HIVEMIND_REQUEST_TIMEOUT = 3.0  # hivemind's default averager request_timeout (seconds)

__all__ = [
    "HIVEMIND_REQUEST_TIMEOUT",
    "MAX_RECORD_BYTES",
    "HivemindPeer",
    "Multiaddr",
    "RecordSizeValidator",
    "RunRecords",
    "check_compression",
    "dht_time",
    "gradient_averager_factory",
    "is_dht",
    "is_hivemind_object",
    "optimizer_parameter_names",
    "read_progress_records",
    "read_run_records",
    "reader_validators",
    "start_dht",
    "versions",
]


@functools.lru_cache(maxsize=1)
def optimizer_parameter_names() -> frozenset[str]:
    """Names of ``hivemind.Optimizer.__init__``'s arguments."""
    import hivemind

    return frozenset(inspect.signature(hivemind.Optimizer.__init__).parameters) - {"self"}


def is_dht(obj: Any) -> bool:
    import hivemind

    return isinstance(obj, hivemind.DHT)


def is_hivemind_object(obj: Any) -> bool:
    return type(obj).__module__.startswith("hivemind")


def check_compression(value: Any) -> bool:
    from hivemind.compression import CompressionBase

    return isinstance(value, CompressionBase)


def gradient_averager_factory(factory: Callable[..., Any] | None,
                              request_timeout: float | None) -> Callable[..., Any]:
    """Without a factory of the user's: :func:`gradient_averager_class`. hivemind 1.1.12 hands ``averager_opts`` to
    its state averager only: give the gradient averager the same join-request timeout, where one is set."""
    extra = {} if request_timeout is None else dict(request_timeout=request_timeout)
    return functools.partial(factory or gradient_averager_class(), **extra)


class _SameHandlers:
    """A mixin for subclasses of a hivemind averager: serve and call its RPCs under the names of hivemind's class.
    hivemind names a servicer's handlers after its class (``ServicerBase._get_handle_name``): a subclass would
    answer only peers running the same subclass (no round, no state download with plain hivemind or an older
    collabopt)."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        hivemind_class = next(base for base in cls.__mro__ if base.__module__.startswith("hivemind."))
        handle_name = f"{hivemind_class.__name__}.{method_name}"
        return handle_name if namespace is None else f"{namespace}::{handle_name}"


@functools.lru_cache(maxsize=1)
def shielded_part_reducer_class() -> type:
    """hivemind's ``TensorPartReducer`` whose senders wait for a part's average through ``asyncio.shield``.

    Every sender of a part awaits one shared future. In hivemind 1.1.12 a sender that dies mid-round (its stream
    closes) has its handler task cancelled, and cancelling a task cancels the future it awaits: the part's future,
    shared by all. The reducer then loses its own share without marking it failed and every member waits for it
    until ``allreduce_timeout`` (``averaging_timeout``). Measured in the churn test: a peer SIGKILLed during a 0.2 s
    all-reduce held its 4 survivors 30 s, their training threads too (the round holds the gradients' lock). With the
    shield only the dead sender's task ends; its parts not sent are left out as hivemind intends
    (``on_sender_failed``) and the round ends within the reducer timeout, usually at once."""
    from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

    class ShieldedTensorPartReducer(TensorPartReducer):
        async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                                  weight: float = 1.0) -> torch.Tensor:
            # hivemind 1.1.12's accumulate_part; only its last line differs (the shield)
            assert 0 <= sender_index < self.num_senders, "invalid sender index"
            assert 0 <= part_index < self.num_parts, "invalid part index"
            self.num_parts_received[sender_index] += 1
            while part_index > self.current_part_index:
                await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                                   return_when=asyncio.FIRST_COMPLETED)
                if self.finished.is_set():
                    raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
            if self.sender_failed_after[sender_index] != float("inf"):
                raise BannedException(f"sender {sender_index} was banned in background")
            assert part_index == self.current_part_index
            current_part_future = self.current_part_future
            if part_index < self.sender_failed_after[sender_index]:
                self.accumulator.add_(tensor_part, alpha=weight)
                self.current_part_accumulated_from += 1
                self.denominator += weight
                self.check_current_part_finished()
            return await asyncio.shield(current_part_future)

    return ShieldedTensorPartReducer


def shield_part_reducers() -> None:
    """Make every all-reduce of this process (and of the averager processes it forks afterwards) use
    :func:`shielded_part_reducer_class`; hivemind's ``AllReduceRunner`` builds its reducer from this global."""
    from hivemind.averaging import allreduce

    allreduce.TensorPartReducer = shielded_part_reducer_class()


@functools.lru_cache(maxsize=1)
def gradient_averager_class() -> type:
    from hivemind.optim.grad_averager import GradientAverager

    class GradientAveragerThatTellsGaps(_SameHandlers, GradientAverager):
        """hivemind's gradient averager, telling its optimizer which share of a round's results arrived.

        When a reducer's part of the average does not arrive in time, hivemind 1.1.12 uses this peer's own values
        for it (``TensorPartContainer.register_failed_reducer``) and the round still succeeds: this peer's
        parameters then differ from every other member's ("Averaging: received 75.7% results"). The share received
        is added to this peer's own entry of the round's gathered metadata (``"received"``, only when below 1), which
        only this peer sees; the lineage check reads it (see ``_judge_lineage``)."""

        # set by collabopt's optimizer where it awaits the round within its step (no delay_grad_averaging)
        keeps_accumulation = False
        # the accumulators are the round's buffers (accumulate_in_place)
        accumulates_in_place = False

        def __init__(self, *args: Any, **kwargs: Any):
            # whether an all-reduce may write into the buffers now: set as a round is triggered, cleared (under the
            # buffers' lock) when the epoch's accumulation is reset. Shared with the averager process (forked below)
            self._round_open = multiprocessing.Value(ctypes.c_bool, False, lock=False)
            self._scaled = False  # the accumulation was scaled into the round's input this epoch
            super().__init__(*args, **kwargs)

        def accumulate_in_place(self) -> None:
            """Accumulate the local steps' gradients in the round's shared-memory buffers instead of accumulators
            of their own (1x the parameters less; see :data:`ACCUMULATE_IN_PLACE`). Needs ``keeps_accumulation``."""
            assert self.keeps_accumulation and not self.reuse_grad_buffers
            with self.get_tensors() as buffers:
                for buffer in buffers:
                    buffer.zero_()
                self._local_accumulators = tuple(buffers)
            self.accumulates_in_place = True

        def step(self, weight: float | None = None, reset_accumulators: bool = True, control: Any = None,
                 timeout: float | None = None, wait: bool = True, **kwargs: Any) -> Any:
            """hivemind 1.1.12 zeroes the accumulators as it hands them to the round. When the round then fails
            (no group, a timeout), its optimizer logs "Proceeding with local gradients" and reloads the zeroed
            accumulators: the epoch's optimizer step got zero gradients and the peer's samples of that epoch were
            lost. With ``keeps_accumulation`` they stay until the epoch ends (hivemind's optimizer resets them
            there), so that a failed round steps with this peer's own accumulated gradients."""
            if self.accumulates_in_place:
                self._round_open.value = True
            return super().step(weight, reset_accumulators and not self.keeps_accumulation, control, timeout, wait,
                                **kwargs)

        @torch.no_grad()
        def load_accumulators_into_averager_(self) -> None:
            if not self.accumulates_in_place:
                return super().load_accumulators_into_averager_()
            with self.get_tensors() as buffers:
                if not self._scaled:  # once an epoch: a failed round's fallback loads again what the buffers hold
                    scale = 1.0 / self.local_times_accumulated if self.local_times_accumulated else 0.0
                    for buffer in buffers:
                        buffer.mul_(scale)
                    self._scaled = True

        @torch.no_grad()
        def reset_accumulated_grads_(self) -> None:
            if not self.accumulates_in_place:
                return super().reset_accumulated_grads_()
            with self.get_tensors():  # an all-reduce still writing the buffers holds this lock: it finishes first
                super().reset_accumulated_grads_()
                self._scaled = False
                self._round_open.value = False

        async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, group_id: Any = None,
                                          **kwargs: Any) -> Any:
            # (in the averager process, holding the buffers' lock) a round whose epoch this peer has ended must not
            # write into the next epoch's accumulation
            if self.accumulates_in_place and not self._round_open.value:
                from hivemind.averaging.partition import AllreduceException

                raise AllreduceException("collabopt: this peer ended the round's epoch, its buffers accumulate anew")
            return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)

        async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any) -> Any:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            runner = self._running_groups.get(group_info.group_id)  # (set by _run_allreduce_inplace_)
            done = runner is not None and runner.done() and not runner.cancelled()
            container = getattr(runner.result(), "tensor_part_container", None) if done else None
            mine = gathered.get(self.peer_id) if isinstance(gathered, dict) else None
            if container is not None and container.failed_size and isinstance(mine, dict):
                gathered[self.peer_id] = dict(mine, received=1.0 - container.failed_size / container.total_size)
            return gathered

    return GradientAveragerThatTellsGaps


class _HivemindHandlerUnlessConfigured(logging.Handler):
    """Hands a record to hivemind's own handler while the application has configured no logging (the root logger
    has no handler); otherwise the record propagates to the application's handlers only."""

    def __init__(self, target: logging.Handler):
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.target.handle(record)


def log_like_hivemind() -> None:
    """collabopt's log lines in hivemind's format and at ``HIVEMIND_LOGLEVEL`` while the application configured no
    logging: otherwise collabopt's status lines (INFO with ``verbose=True``, like hivemind's) were dropped and its
    warnings printed without a time, between hivemind's timed lines. A level set on the ``collabopt`` logger is kept."""
    from hivemind.utils import logging as hivemind_logging

    hivemind_logging.get_logger("hivemind")  # hivemind creates its handler on first use
    target = getattr(hivemind_logging, "_default_handler", None)
    ours = logging.getLogger("collabopt")
    if target is None or any(isinstance(h, _HivemindHandlerUnlessConfigured) for h in ours.handlers):
        return
    ours.addHandler(_HivemindHandlerUnlessConfigured(target))
    if ours.level == logging.NOTSET:
        ours.setLevel(hivemind_logging.loglevel)


def start_dht(**kwargs: Any) -> Any:
    """Start a ``hivemind.DHT``; unless it is a client, it also serves collabopt's dial-back check (see
    :mod:`collabopt.doctor`) so that ``collabopt doctor`` on another machine can learn whether it is reachable."""
    import hivemind

    relays_only = _static_relays() if kwargs.get("trusted_relays") else contextlib.nullcontext()
    with children_follow_parent(), relays_only:  # the DHT process and its p2pd end with this process, even on SIGKILL
        dht = hivemind.DHT(start=True, **kwargs)
    if not kwargs.get("client_mode"):
        try:
            from collabopt.doctor import DIALBACK_PROTOCOL, serve_dialback

            dht.run_coroutine(functools.partial(_add_stream_handler, DIALBACK_PROTOCOL, serve_dialback))
        except Exception as e:  # a convenience for others' diagnosis: never a reason not to start
            logging.getLogger(__name__).debug("collabopt: could not serve the dial-back check: %r", e)
    return dht


@contextlib.contextmanager
def _static_relays() -> Iterator[None]:
    """While a DHT starts (its process forks inside), p2pd daemons given ``trusted_relays`` use those relays only.

    hivemind 1.1.12 passes ``-trustedRelays`` but leaves p2pd's ``-relayDiscovery`` on (``use_relay_discovery`` is
    ignored), so p2pd feeds the named relays to libp2p's autorelay as mere candidates among those its DHT finds;
    autorelay then reserves no relay slot before it has 4 candidates or 3 minutes have passed (go-libp2p 0.32
    autorelay defaults), and every connection through the relay fails with NO_RESERVATION until then. With
    ``-relayDiscovery=0`` p2pd configures static relays: a reservation within seconds.

    Such a daemon connects to its static relays as soon as it starts, and p2pd's own bootstrap counts only the
    initial peers it was not yet connected to: when the relay is an initial peer (the usual case: the first peer
    relays) and its connection came first, p2pd exited with "failed to connect to bootstrap peers" (seen in a CI
    run). So these daemons start without p2pd's bootstrap and connect to the initial peers once started (within
    ``startup_timeout``, as p2pd's bootstrap was). They lose what else p2pd's bootstrap does: its reconnection to the
    bootstrap peers every 15 minutes when it has fewer than 4 connections (the relay, usually the initial peer,
    stays connected through autorelay).
    """
    from hivemind.p2p.p2p_daemon import P2P

    original_args, original_create = P2P.__dict__["_make_process_args"], P2P.__dict__["create"]

    def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("trustedRelays"):
            kwargs.setdefault("relayDiscovery", False)
            kwargs.pop("bootstrapPeers", None)
            kwargs["b"] = False
        return original_args.__func__(*args, **kwargs)

    async def create(cls: type, **kwargs: Any) -> Any:
        p2p = await original_create.__func__(cls, **kwargs)
        if kwargs.get("trusted_relays") and kwargs.get("initial_peers"):
            await _connect_initial_peers(p2p, kwargs["initial_peers"], timeout=kwargs.get("startup_timeout", 15.0))
        return p2p

    P2P._make_process_args, P2P.create = staticmethod(make_process_args), classmethod(create)
    try:
        yield
    finally:
        P2P._make_process_args, P2P.create = original_args, original_create


async def _connect_initial_peers(p2p: Any, initial_peers: Sequence[Any], timeout: float) -> None:
    """Connect a started ``p2p`` to ``initial_peers`` (full multiaddrs): return once one answers (the others go on
    connecting); shut ``p2p`` down and raise as p2pd's bootstrap does if none answers within ``timeout`` seconds."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    loop = asyncio.get_running_loop()
    deadline, errors = loop.time() + timeout, []
    pending = {asyncio.ensure_future(connect(p2p, str(maddr))) for maddr in initial_peers}
    for task in pending:  # whatever the outcome, nobody waits for it after an early return
        task.add_done_callback(lambda task: task.cancelled() or task.exception())
    while pending:
        done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                           return_when=asyncio.FIRST_COMPLETED)
        if not done:
            errors.append(f"{len(pending)} gave no answer in {timeout} s")
            break
        for task in done:
            if task.exception() is None:
                return
            errors.append(task.exception())
    for task in pending:
        task.cancel()
    await p2p.shutdown()
    raise P2PDaemonError(f"failed to connect to bootstrap peers: {errors}")


async def _add_stream_handler(name: str, handler: Callable[..., Any], _dht: Any, node: Any) -> None:
    await node.p2p.add_binary_stream_handler(name, handler)


# ---- libp2p for `collabopt doctor`: a daemon of its own, no DHT


async def create_p2p(**kwargs: Any) -> Any:
    """Start a libp2p daemon (``hivemind.P2P``) that listens like a peer would, without a DHT."""
    from hivemind.p2p import P2P

    return await P2P.create(**kwargs)


async def visible_maddrs(p2p: Any) -> list[Any]:
    return await p2p.get_visible_maddrs()


async def shutdown_p2p(p2p: Any) -> None:
    await p2p.shutdown()


def _peer_id(maddr: str) -> Any:
    from hivemind.p2p import PeerID

    return PeerID.from_base58(Multiaddr(maddr)["p2p"])


async def connect(p2p: Any, maddr: str) -> None:
    """Open a libp2p connection to the peer at full multiaddr ``maddr`` (raises when it fails)."""
    peer_id = _peer_id(maddr)
    await p2p._client.connect(peer_id, [Multiaddr(maddr).decapsulate(Multiaddr(f"/p2p/{peer_id}"))])


async def dht_ping(p2p: Any, maddr: str, timeout: float = 10.0) -> float:
    """Ping the DHT of the peer at ``maddr`` without joining it (no sender info: it adds nobody to its routing
    table); return the peer's DHT time."""
    from hivemind.proto import dht_pb2

    response = await asyncio.wait_for(p2p.call_protobuf_handler(
        _peer_id(maddr), "DHTProtocol.rpc_ping", dht_pb2.PingRequest(), dht_pb2.PingResponse), timeout)
    return float(response.dht_time)


async def open_stream(p2p: Any, maddr: str, protocol: str) -> tuple[Any, Any]:
    """A binary stream to ``protocol`` of the peer at ``maddr``: its (reader, writer)."""
    _info, reader, writer = await p2p.call_binary_stream_handler(_peer_id(maddr), protocol)
    return reader, writer


def dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


# Parameter averaging in place. hivemind's state averager keeps its own copy of the parameters in shared memory (1x
# the parameters), copies the parameters into it before each averaging round and the result back after it. Where
# the round runs inside step() (no delay_state_averaging) on float32 CPU parameters, nothing reads or writes them
# during the round but the round itself, so collabopt lets the averager average the parameters themselves
# (hivemind's reuse_tensors, which it uses for offloaded parameters): B4 measured 6x -> 5x the parameters beyond
# them in the default mode and 5x -> 4x with reuse_grad_buffers (plain Adam: 3x). A round applies its parts to the
# parameters as they arrive, as it applied them to the copy that was copied back whole or partial.
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


# Gradient accumulation in place. hivemind's gradient averager accumulates the local steps' gradients in
# accumulators of its own (1x the parameters), copies them into the round's shared-memory buffers (1x) at the
# boundary, and the optimizer steps with what the round leaves there. Where the round is awaited within step() and
# the optimizer steps there too (no delay_grad_averaging or delay_optimizer_step), on CPU gradients without
# reuse_grad_buffers, the accumulation happens in those buffers: scaled in place as the round begins, averaged in
# place, zeroed as the epoch ends. A failed round's fallback steps with what they hold: this peer's accumulation, or
# where the all-reduce failed midway, whole tensors of the group's average beside it (as in a partial round).
ACCUMULATE_IN_PLACE = True


def can_accumulate_in_place(optimizer: Any, averager: Any) -> bool:
    """Whether ``averager`` (the gradient averager of ``optimizer``, a ``hivemind.Optimizer`` being built) can
    accumulate in the round's buffers (see above)."""
    # (keeps_accumulation: no delay_grad_averaging)
    if not ACCUMULATE_IN_PLACE or not averager.keeps_accumulation or averager.reuse_grad_buffers:
        return False
    if optimizer.delay_optimizer_step:
        return False
    return all(acc.device.type == "cpu" and param.device.type == "cpu"
               for acc, param in zip(averager._grad_accumulators(), averager.parameters, strict=True))


@functools.lru_cache(maxsize=1)
def optimizer_class() -> type:
    """``hivemind.Optimizer`` with a progress tracker that shuts down cleanly (see :func:`make_progress_tracker`), a
    state averager that serves consistent states (:func:`state_averager_class`) and a state download that does not
    relabel an older state as the swarm's epoch (:func:`download_state`); its averagers survive a member killed
    mid-round (:func:`shield_part_reducers`)."""
    import hivemind

    shield_part_reducers()

    def _make_state_averager(self: Any, **kwargs: Any) -> Any:
        if "reuse_tensors" not in kwargs and averages_parameters_in_place(self, kwargs):
            kwargs["reuse_tensors"] = True
        return state_averager_class()(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)

    def _make_gradient_averager(self: Any, factory: Any, **kwargs: Any) -> Any:
        averager = hivemind.Optimizer._make_gradient_averager(self, factory, **kwargs)
        if isinstance(averager, gradient_averager_class()):  # (in the background, the next epoch accumulates)
            averager.keeps_accumulation = not self.delay_grad_averaging
            if can_accumulate_in_place(self, averager):
                averager.accumulate_in_place()
        return averager

    def _update_global_epoch(self: Any, grad_scaler: Any) -> None:
        if self.local_epoch < self.tracker.global_epoch - 1:
            # step() checked the sync on one view of the swarm, a newer one (its fetcher runs in the background)
            # made it "ready": that is the swarm 2+ epochs ahead (a peer back from a cut link). Its gradients and
            # parameters are stale: download instead of joining the swarm's rounds with them
            logging.getLogger(__name__).log(
                self.status_loglevel, "collabopt: the swarm is at epoch %d, this peer at %d: downloading its state",
                self.tracker.global_epoch, self.local_epoch)
            self.load_state_from_peers()
            return
        before_averaging = getattr(self, "collabopt_before_averaging", None)
        if before_averaging is not None and self.use_gradient_averaging:
            before_averaging()  # the non-finite guard's last look at the accumulation (CollaborativeOptimizer)
        skips = _skips_state_round(self)
        if skips:
            # this peer reaches the boundary of an epoch whose state it downloaded: the others' state groups may be
            # closed, and a round started now met their next epoch's and left it counting one epoch behind them for
            # good (the churn test: a restarted peer downloaded epoch 8 as the others reached its boundary, and its
            # epoch 11 was the others' 12). Its parameters and statistics are the swarm's and it receives the others'
            # averaged gradients, so it skips this epoch's parameter averaging; the next one includes it
            logging.getLogger(__name__).log(
                self.status_loglevel, "collabopt: no parameter averaging at the end of epoch %d (its state was "
                "downloaded)", self.local_epoch)
        every = self.average_state_every
        if skips:
            self.average_state_every = sys.maxsize
        try:  # (_judge_lineage may turn this epoch's parameter averaging off too)
            hivemind.Optimizer._update_global_epoch(self, grad_scaler)
        finally:
            self.average_state_every = every
        if skips:
            self.collabopt_skipped_epoch, self.collabopt_skipped_at = self.local_epoch - 1, dht_time()
        if out_of_sync(self):
            _serve_below_the_others(self)  # hivemind just declared this peer's state at its new epoch

    def _average_gradients_and_load_into_optimizer(self: Any, maybe_step_control: Any) -> None:
        if self.delay_grad_averaging and maybe_step_control is not None:
            _average_gradients_in_background(self, maybe_step_control)
        else:
            hivemind.Optimizer._average_gradients_and_load_into_optimizer(self, maybe_step_control)
        _hint_state_group(self, maybe_step_control)
        if getattr(self, "collabopt_checks_lineage", False):
            _judge_lineage(self, maybe_step_control)

    def _should_load_state_from_peers(self: Any) -> bool:
        resync = getattr(self, "collabopt_resync", None)
        if resync is not None and time.monotonic() >= resync.next_try:
            return True  # step() downloads, then starts over (this step's gradients came from the other lineage)
        return hivemind.Optimizer._should_load_state_from_peers(self)

    def _tag_along_with_zero_weight(self: Any, control: Any) -> None:
        if control is self.scheduled_grads and self.grad_averager is not None and not control.triggered:
            # weight 0 does not keep NaN out of the others' average (0 * NaN is NaN), and the buffers may hold one:
            # a refused non-finite result, or a dropped accumulation's round whose every member had weight 0 (0/0)
            with torch.no_grad(), self.grad_averager.get_tensors() as buffers:
                for buffer in buffers:
                    buffer.zero_()
        hivemind.Optimizer._tag_along_with_zero_weight(self, control)

    def _maybe_schedule_state_averaging(self: Any) -> None:
        if _skips_state_round(self):  # (a round scheduled and then cancelled can leave the averager stuck)
            return
        if getattr(self, "collabopt_skipped_epoch", None) == self.local_epoch - 1 and not _swarm_moved_on(self):
            # without the round it skipped, this peer ended that boundary before the others: a state round it
            # scheduled now would join the group of theirs still in progress (groups are matched by time, not
            # epoch) and hold it open without averaging (the demo: they waited 4 s for its part, "received 66.7% of
            # input tensors", and ended 0.0077 apart)
            return
        hivemind.Optimizer._maybe_schedule_state_averaging(self)

    return type("Optimizer", (hivemind.Optimizer,), dict(_make_progress_tracker=make_progress_tracker,
                                                          _make_state_averager=_make_state_averager,
                                                          _make_gradient_averager=_make_gradient_averager,
                                                          _update_global_epoch=_update_global_epoch,
                                                          _maybe_schedule_state_averaging=_maybe_schedule_state_averaging,
                                                          _tag_along_with_zero_weight=_tag_along_with_zero_weight,
                                                          _average_gradients_and_load_into_optimizer=(
                                                              _average_gradients_and_load_into_optimizer),
                                                          _should_load_state_from_peers=_should_load_state_from_peers,
                                                          load_state_from_peers=download_state,
                                                          __module__=__name__))


def _average_gradients_in_background(optimizer: Any, control: Any) -> None:
    """hivemind 1.1.12's ``_average_gradients_and_load_into_optimizer`` for ``delay_grad_averaging``, but a failed
    round steps with the gradients this peer handed to it. hivemind's fallback reloaded the accumulators, which by then
    hold the next epoch's first gradients: the delayed step applied those, and the next epoch's round included them
    again, while this epoch's were lost. The round's buffers (the offloaded optimizer's gradients) still hold this
    peer's contribution, or, where the round failed midway, whole tensors of the group's average beside it (as in a
    partial round)."""
    from hivemind.optim.optimizer import logger as hivemind_logger

    try:
        group_info = control.result(optimizer.averaging_timeout)
        hivemind_logger.log(optimizer.status_loglevel, f"Averaged gradients with {len(group_info)} peers")
    except BaseException as e:
        hivemind_logger.log(optimizer.status_loglevel, f"Averaging gradients failed with {e!r}")
        hivemind_logger.log(optimizer.status_loglevel, "Proceeding with local gradients")
        with optimizer.grad_averager.get_tensors():
            pass  # an all-reduce still writing them holds this lock: let it finish first
    optimizer._load_averaged_gradients_into_optimizer_()


def _skips_state_round(optimizer: Any) -> bool:
    """Whether ``optimizer`` (pre-scheduling its state rounds, averaging gradients) ends its current epoch without
    one: the epoch's state came from a download (see ``_update_global_epoch`` in :func:`optimizer_class`)."""
    return (getattr(optimizer, "collabopt_preschedules_state", False) and optimizer.use_gradient_averaging
            and getattr(optimizer, "collabopt_downloaded_epoch", None) == optimizer.local_epoch)


def _swarm_moved_on(optimizer: Any) -> bool:
    """Whether the others have ended the boundary ``optimizer`` left without its state round: the progress records
    of every peer, fetched since, show its epoch, or a ``matchmaking_time`` has passed since (their groups for that
    round closed at most half a ``matchmaking_time`` after it began; a killed peer's record of its old epoch stays
    for a minute: the churn test's restarted peers never scheduled, missed the others' groups and counted one epoch
    behind)."""
    tracker = optimizer.tracker
    if dht_time() >= getattr(optimizer, "collabopt_skipped_at", 0.0) + optimizer.matchmaking_time:
        return True
    return (getattr(tracker, "lowest_epoch", None) is not None and tracker.lowest_epoch[1] >= optimizer.local_epoch
            and tracker.lowest_epoch[0] >= optimizer.local_epoch)


# The lineage check. A gradient round gives all its members the same averaged gradients, so it keeps in sync only
# peers that already held the same parameters. Peers that trained apart (the two sides of a healed partition) or
# came out of different parameter-averaging groups hold two lineages, and rounds of all of them kept both: with
# state-round pre-scheduling off, the 2 | 2 partition test ended 0.005-0.04 apart in 4 of 5 runs (each side's state
# round gathered whoever reached the boundary first, in groups of 2 and 3). So every member tells its gradient
# round its epoch and a fingerprint of its parameters (hivemind's ``gather``); after the round, a peer whose
# fingerprint is not the round's canonical one (lineage.judge) skips that boundary's parameter averaging (it would
# mix the lineages), serves its state below the others and, at its next step, downloads the state of a member that
# holds the canonical one. The same check catches two other ways of drifting apart without parameter averaging
# (average_state_every > 1), both seen in a fresh-clone suite's run of the lineage test on 2 loaded cores: a partial
# round (a member's part of the average arrived late, the others used their own values for it and ended 0.0066
# apart: each says "apart" at its next round and adopts the lineage of a member whose round was whole), and a member
# one epoch behind (it missed a round and counted the next one as its own: it adopts the newest epoch's lineage).
# Off where the optimizer step or averaging runs in the background (delay_*: parameters at scheduling time are not
# the epoch's) and in DiLoCo mode (which checks its anchors the same way).
CHECK_LINEAGE = True
RESYNC_RETRY = 1.0  # seconds between downloads while the canonical peers have not served the new state yet


@dataclasses.dataclass
class Resync:
    """A pending re-synchronization: download the state of one of ``peers`` (base58 peer ids) until ``until``."""

    peers: list[str]
    epoch: int
    until: float
    next_try: float = 0.0


def check_lineage(optimizer: Any) -> None:
    """Make ``optimizer`` (a ``hivemind.Optimizer`` of :func:`optimizer_class`) take part in the lineage check
    (see above), where its mode allows it."""
    if not (CHECK_LINEAGE and optimizer.use_gradient_averaging and not optimizer.auxiliary
            and not optimizer.delay_optimizer_step and not optimizer.delay_grad_averaging
            and not optimizer.delay_state_averaging):
        return
    optimizer.collabopt_checks_lineage = True
    averager = optimizer.grad_averager
    schedule_step = averager.schedule_step  # GradientAverager.step() begins an unscheduled round through it too

    def schedule_step_telling_lineage(scheduled_time: float | None = None, **kwargs: Any) -> Any:
        if kwargs.get("gather") is None:  # the parameters stay as they are until this epoch's optimizer step
            kwargs["gather"] = lineage_metadata(optimizer)
        return schedule_step(scheduled_time, **kwargs)

    averager.schedule_step = schedule_step_telling_lineage


def lineage_metadata(optimizer: Any) -> dict[str, Any]:
    return {"epoch": int(optimizer.local_epoch), "serves": not optimizer.client_mode,
            "apart": bool(getattr(optimizer, "collabopt_apart", False)),
            "lineage": lineage.fingerprint(optimizer.state_averager.main_parameters)}


def out_of_sync(optimizer: Any) -> bool:
    """Whether ``optimizer`` knows its parameters differ from its swarm's: its last gradient round was partial, or
    a round found it on another lineage and its re-synchronization is pending."""
    apart = bool(getattr(optimizer, "collabopt_apart", False))
    return apart or getattr(optimizer, "collabopt_resync", None) is not None


def _hint_state_group(optimizer: Any, control: Any) -> None:
    """After a boundary's gradient round (``control``): if every peer this one counts in the swarm was in it, tell
    the state averager to expect that many peers in the parameter averaging that follows (see
    ``ConsistentStateAverager._size_next_group``); otherwise (a failed round, groups split under load) no hint.

    A hint too small would be harmful: a peer that finds the group full waits for another until
    ``averaging_timeout``. One too large costs what no hint costs (the group waits out its matchmaking time)."""
    hint = None  # (a delayed gradient round ends after the state round's matchmaking began: no hint)
    group = None if optimizer.delay_grad_averaging else _finished_group(control)
    if isinstance(group, dict) and len(group) >= max(2, optimizer.tracker.global_progress.num_peers):
        hint = (optimizer.local_epoch, len(group))
    optimizer.state_averager.group_size_hint = hint


def _finished_group(control: Any) -> Any:
    """What a gradient round (a StepControl) gathered from its group, or None if it did not finish successfully."""
    if control is None or not control.done() or control.cancelled() or control.exception() is not None:
        return None
    return control.result()


def _judge_lineage(optimizer: Any, control: Any) -> None:
    """After a gradient round (``control``): if this peer's parameters are not its group's canonical lineage (see
    :func:`collabopt.lineage.judge`), turn this boundary's parameter averaging off and plan a download from a peer
    that holds it. Then note whether this round was partial (see :func:`gradient_averager_class`)."""
    group = _finished_group(control)
    me = optimizer.dht.peer_id
    mine = group.get(me) if isinstance(group, dict) else None
    if not isinstance(mine, dict) or not isinstance(mine.get("epoch"), int):
        return
    verdict = lineage.judge(group, me) if getattr(optimizer, "collabopt_resync", None) is None else None
    if verdict is not None and verdict.reason == "holds":
        optimizer.collabopt_apart = False
    elif verdict is not None:
        logging.getLogger(__name__).warning("collabopt: %s: it downloads their state after this step",
                                            _verdict_text(verdict, group, mine["epoch"]))
        optimizer.collabopt_resync = Resync(peers=[str(peer) for peer in verdict.peers], epoch=mine["epoch"],
                                            until=time.monotonic() + optimizer.averaging_timeout)
        optimizer.average_state_every = sys.maxsize  # no parameter averaging at this boundary (_update_global_epoch
        _join_state_round_with_nothing(optimizer)    # restores it): it would mix the lineages
        _serve_below_the_others(optimizer)
    received = mine.get("received", 1.0)
    if isinstance(received, float) and received < 1.0:  # (a pending download clears it when it brings a state)
        optimizer.collabopt_apart = True
        _serve_below_the_others(optimizer)  # others' downloads should not fetch parameters only this peer holds
        logging.getLogger(__name__).warning(
            "collabopt: %.1f%% of this peer's gradient round at epoch %d arrived (hivemind used its own gradients for "
            "the rest): its parameters now differ from its group's; its next gradient round re-synchronizes it",
            100 * received, mine["epoch"])


def _verdict_text(verdict: lineage.Verdict, group: dict, epoch: int) -> str:
    newest = group[verdict.peers[0]]["epoch"]
    if verdict.reason == "behind":
        return (f"this peer is at epoch {epoch}, {len(verdict.peers)} peer(s) of its gradient round at epoch "
                f"{newest} (it missed a round)")
    if verdict.reason == "apart":
        return (f"this peer's last gradient round was partial, so its parameters are its own; {len(verdict.peers)} "
                f"peer(s) of its gradient round at epoch {epoch} hold the group's")
    if verdict.reason == "nonfinite":
        return (f"this peer's parameters are not finite; {len(verdict.peers)} peer(s) of its gradient round at epoch "
                f"{epoch} hold the group's")
    peers_at_epoch = sum(1 for m in group.values() if isinstance(m, dict) and m.get("epoch") == epoch)
    return (f"this peer's parameters differ from those of {len(verdict.peers)} of the {peers_at_epoch} peers of its "
            f"gradient round at epoch {epoch} (they trained apart, e.g. across a network partition)")


def _serve_below_the_others(optimizer: Any) -> None:
    """Others' downloads prefer peers of higher priority: serve this peer's state (of the other lineage) below
    theirs at the same epoch."""
    if not optimizer.client_mode:
        optimizer.state_averager.state_sharing_priority = optimizer.local_epoch - 0.5


def _join_state_round_with_nothing(optimizer: Any) -> None:
    state_round, optimizer.scheduled_state = optimizer.scheduled_state, None
    if state_round is not None and not state_round.triggered and not state_round.done():
        # a pre-scheduled state round may have a group already: take part with nothing (the others' round would
        # wait for this peer's part until it timed out), without waiting for it (it may start seconds from now)
        state_round.weight = 0
        state_round.allow_allreduce()


def _resync_outcome(optimizer: Any, resync: Resync, before: list[float]) -> None:
    """After a download for ``resync``: done if the parameters changed (they came from another lineage), else try
    again at a later step (the canonical peers had not served the boundary's state yet), until ``resync.until``."""
    logger = logging.getLogger(__name__)
    if not lineage.same_fingerprint(before, lineage.fingerprint(optimizer.state_averager.main_parameters)):
        logger.log(optimizer.status_loglevel, "collabopt: re-synchronized with its gradient round's parameters "
                   "(epoch %d)", optimizer.local_epoch)
        optimizer.collabopt_resync = None
        optimizer.collabopt_apart = False
    elif time.monotonic() >= resync.until:
        logger.warning("collabopt: no peer of the other lineage served its state within %.0f s; this peer goes on "
                       "with its own parameters (the next gradient round checks again)", optimizer.averaging_timeout)
        optimizer.collabopt_resync = None
    else:
        resync.next_try = time.monotonic() + RESYNC_RETRY
        _serve_below_the_others(optimizer)


def download_state(optimizer: Any, **kwargs: Any) -> None:
    """``hivemind.Optimizer.load_state_from_peers`` without its relabelling, for :func:`optimizer_class`.

    hivemind 1.1.12, when the state it downloaded is one epoch older than the swarm's newest epoch (the peer that
    served it had not reached the boundary that others had passed), sets the local epoch to the swarm's: the peer
    then counts epoch e+1 with epoch e's parameters, joins the others' rounds and stays one update apart from them
    for good (a restarted peer of the churn test, 0.012 apart before its first step). Here the peer downloads again
    once its progress view is fresh, until its state is as new as the swarm's, for up to ``averaging_timeout``
    (the boundary the others are passing ends within it); only then does it fall back on hivemind's relabelling.
    A re-synchronization of the lineage check downloads from the peers of the group's lineage first."""
    resync = getattr(optimizer, "collabopt_resync", None)
    apart = getattr(optimizer, "collabopt_apart", False)
    before = lineage.fingerprint(optimizer.state_averager.main_parameters) if resync is not None or apart else []
    if resync is not None:  # (the lineage check) a download from a peer of the group's lineage
        optimizer.state_averager.prefer_sources(resync.peers)
    try:
        _download_until_current(optimizer, **kwargs)
    finally:
        if resync is not None:
            optimizer.state_averager.prefer_sources([])
    if resync is not None:
        _resync_outcome(optimizer, resync, before)
    elif apart and not lineage.same_fingerprint(before, lineage.fingerprint(optimizer.state_averager.main_parameters)):
        optimizer.collabopt_apart = False  # (after a partial round) it holds a served state now


def _download_until_current(optimizer: Any, **kwargs: Any) -> None:
    from hivemind.utils import get_dht_time

    deadline = time.monotonic() + optimizer.averaging_timeout
    while True:
        _download_state_once(optimizer, **kwargs)
        swarm_epoch = optimizer.tracker.global_epoch
        if optimizer.local_epoch >= swarm_epoch or time.monotonic() >= deadline:
            break
        logging.getLogger(__name__).log(
            optimizer.status_loglevel, "collabopt: the state downloaded is epoch %d's, the swarm's is %d: downloading "
            "again", optimizer.local_epoch, swarm_epoch)
        with optimizer.tracker.pause_updates():  # fetch the swarm's progress now, then look again
            optimizer.tracker.global_progress.next_fetch_time = get_dht_time()
        optimizer.tracker.global_state_updated.set()
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if optimizer.local_epoch == optimizer.tracker.global_epoch - 1:  # hivemind's rule, as a last resort
        logging.getLogger(__name__).warning(
            "collabopt: no peer served the swarm's epoch %d within %.0f s; continuing from epoch %d's state as epoch "
            "%d", optimizer.tracker.global_epoch, optimizer.averaging_timeout, optimizer.local_epoch,
            optimizer.tracker.global_epoch)
        optimizer.state_averager.local_epoch = optimizer.tracker.global_epoch
        _after_download(optimizer)
    forget_stale_progress(optimizer.tracker, optimizer.local_epoch)


def _download_state_once(optimizer: Any, **kwargs: Any) -> None:
    """hivemind 1.1.12's ``Optimizer.load_state_from_peers`` minus its one-epoch relabelling."""
    logger = logging.getLogger(__name__)
    if optimizer.scheduled_grads is not None and not optimizer.scheduled_grads.done():
        optimizer._tag_along_with_zero_weight(optimizer.scheduled_grads)  # as hivemind: the round may have started
        optimizer.scheduled_grads = None
    _join_state_round_with_nothing(optimizer)
    optimizer.state_averager.step(wait_for_delayed_updates=True)
    with optimizer.tracker.pause_updates():
        while True:
            try:
                optimizer.state_averager.load_state_from_peers(timeout=optimizer.load_state_timeout, **kwargs)
                if optimizer.grad_averager is not None:
                    optimizer.grad_averager.load_state_from_peers(timeout=optimizer.load_state_timeout, **kwargs)
                break
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                logger.exception(f"Failed to load state from peers: {e}, retrying ...")
        _after_download(optimizer)


def _after_download(optimizer: Any) -> None:
    optimizer.collabopt_downloaded_epoch = optimizer.local_epoch
    optimizer.tracker.report_local_progress(local_epoch=optimizer.local_epoch, samples_accumulated=0)
    if not optimizer.client_mode:
        optimizer.state_averager.state_sharing_priority = optimizer.local_epoch
    if optimizer.use_gradient_averaging:
        optimizer.grad_averager.reset_accumulated_grads_()
        if not optimizer.client_mode:
            optimizer.grad_averager.state_sharing_priority = optimizer.local_epoch


class _GatedEvent(threading.Event):
    """A ``threading.Event`` whose ``set()`` does nothing unless ``allow()`` says so."""

    def __init__(self, allow: Callable[[], bool]):
        super().__init__()
        self._allow = allow

    def set(self) -> None:
        if self._allow():
            super().set()


class _EventThatCalls(threading.Event):
    """A ``threading.Event`` that calls ``before_set`` each time it is set."""

    def __init__(self, before_set: Callable[[], None]):
        super().__init__()
        self._before_set = before_set

    def set(self) -> None:
        self._before_set()
        super().set()


PREFERRED_SOURCES_BYTES = 4096
PREFERRED_BOOST = 1e9  # added to the priority of a preferred source (priorities are epochs)


def raise_priority(found: Any, preferred: set[str]) -> Any:
    """``found`` (the DHT's ``{subkey: priority}`` record of the peers that serve their state) with the priority
    of the ``preferred`` peers raised above every other's."""
    from hivemind.p2p import PeerID
    from hivemind.utils import ValueWithExpiration

    if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
        return found
    raised = {}
    for subkey, info in found.value.items():
        with contextlib.suppress(Exception):  # a malformed subkey stays as it is (hivemind skips it)
            if (isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
                    and str(PeerID(subkey)) in preferred):
                info = ValueWithExpiration(float(info.value) + PREFERRED_BOOST, info.expiration_time)
        raised[subkey] = info
    return ValueWithExpiration(raised, found.expiration_time)


SERVE_WAIT = 30.0  # seconds a download waits for a boundary's averaging to be applied (hivemind's default timeout)


@functools.lru_cache(maxsize=1)
def state_averager_class() -> type:
    from hivemind.optim.state_averager import TrainingStateAverager

    class ConsistentStateAverager(_SameHandlers, TrainingStateAverager):
        """hivemind's state averager, serving states whose epoch and tensors belong together.

        hivemind 1.1.12 serves a download from the live tensors (on CPU, ``.cpu()`` is no copy; they are read while
        they stream out) with the epoch read apart from them, and it counts the next epoch before that epoch's
        optimizer step has run (``step`` increments, then the step runs in its executor). A download at that moment
        got epoch e+1 with epoch e's parameters, or parameters torn between the two. Here a state is served as a
        copy taken while no optimizer step runs, labelled with the epoch whose update its parameters hold. And while
        a boundary's foreground parameter averaging runs (after the optimizer step, before its result is applied),
        a download waits for it, for up to :data:`SERVE_WAIT` seconds: served then, it got epoch e+1 with parameters
        the averaging had not yet moved (the churn soak: a restarted peer 0.004 from the swarm; once in a
        fresh-clone suite's churn test, 0.0048), and it skips that boundary's averaging after a download."""

        def __init__(self, *args: Any, **kwargs: Any):
            import collections

            self._label_lock = threading.Lock()
            self._epoch = 0
            self._steps_owed = 0  # epochs counted whose optimizer step has not run yet
            self._step_with_increment = False  # the epoch step() counts next comes with an optimizer step
            self._owes: collections.deque[bool] = collections.deque()  # per submitted _do: does it pay one?
            self._paying = False  # the _do running now pays one when its optimizer step runs
            self._no_boundary = threading.Event()  # cleared while a boundary's foreground averaging is unfinished
            self._no_boundary.set()
            # peers whose state a download tries first (base58, comma-separated), shared with the averager process
            self._preferred_sources = multiprocessing.Array(ctypes.c_char, PREFERRED_SOURCES_BYTES)
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

        def _size_next_group(self) -> None:
            """The parameter averaging at a boundary starts its matchmaking there. hivemind's group leader waits out
            the whole ``matchmaking_time`` for more peers unless the group reaches ``target_group_size`` (unset: one
            ``matchmaking_time`` of idle at every epoch, measured in B5 and in every swarm test's epochs). The peers
            of this epoch's gradient round reach the boundary together (its all-reduce just ended): a group of that
            many assembles as soon as they are in. Without a hint (its gradient round failed, a delayed one), the
            leader waits as before. A peer the hint does not count finds the group full: its round fails, as one that
            reaches the boundary after the group closed does. A ``target_group_size`` of the user's (in
            ``averager_opts``, to split a large swarm into groups) stays the upper bound."""
            hint, self.group_size_hint = self.group_size_hint, None
            size = hint[1] if hint is not None and hint[0] == self.local_epoch else None
            configured = self.matchmaking_kwargs.get("target_group_size")
            if configured is not None:
                size = configured if size is None else min(size, configured)
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

        def prefer_sources(self, peers: Sequence[str]) -> None:
            """Make the next downloads try ``peers`` (base58 peer ids) before any other, as many as fit."""
            chosen: list[str] = []
            for peer in peers:
                if len(",".join([*chosen, peer])) < PREFERRED_SOURCES_BYTES:
                    chosen.append(peer)
            self._preferred_sources.value = ",".join(chosen).encode()

        async def _load_state_from_peers(self, future: Any, timeout: float | None = None) -> None:
            # (runs in the averager's process) hivemind tries the peers the DHT lists, highest priority first
            # (self.dht.get is called before its first await): from now on, the record of the peers that serve
            # their state is read with the preferred peers' priority raised, whichever download reads it
            if not getattr(self, "_reads_preferring", False):
                dht_get = self.dht.get

                def get_preferring(key: Any, *args: Any, **kwargs: Any) -> Any:
                    found = dht_get(key, *args, **kwargs)
                    preferred = {peer for peer in self._preferred_sources.value.decode().split(",") if peer}
                    if preferred and isinstance(key, str) and key.endswith(".all_averagers"):
                        found = raise_priority(found, preferred)
                    return found

                self.dht.get, self._reads_preferring = get_preferring, True
            return await super()._load_state_from_peers(future, timeout)

        def get_current_state(self) -> Any:
            self._no_boundary.wait(SERVE_WAIT)  # (runs in hivemind's thread that serves downloads)
            with self.lock_optimizer:  # no optimizer step runs meanwhile
                with self._label_lock:
                    epoch = self._epoch - self._steps_owed
                metadata, tensors, infos = super().get_current_state()
                # copies, taken now: on CPU, hivemind's tensors are the live ones (GPU ones were copied by .cpu())
                tensors = [t.detach().clone() if t.device.type == "cpu" else t.detach().cpu() for t in tensors]
            return dict(metadata, epoch=epoch), tensors, infos

    return ConsistentStateAverager


# Pre-scheduling the parameter-averaging ("state") round. hivemind 1.1.12 pre-schedules it only once it has timed a
# pre-scheduled one (_maybe_schedule_state_averaging waits for delay_before_state_averaging.num_updates > 0) and times
# only those, so it never does: every state round begins its matchmaking at the boundary, one matchmaking_time of
# idle per epoch (benchmark B5: 19-30% of an epoch of 4x matchmaking_time). And when it does pre-schedule, it computes
# when the round should start but does not pass that time on, so the round's group closes about when the first peers
# reach the boundary: a peer that reaches it a moment later (one progress refresh, a slower step, a state download
# just done) found no group, waited alone until averaging_timeout, missed the next gradient round and stepped alone
# (the demo's peers once ended 0.019 apart). preschedule_state_rounds pre-schedules from the first epoch, closing at
# hivemind's own estimate of the round's start plus a slack: half the matchmaking_time, at most STATE_ROUND_SLACK
# seconds (peers reach the boundary up to a progress refresh, 0.5 s, and a local step apart). Every peer waits for the
# slack at each boundary: B5 (quick runs, matchmaking_time 1 s, epochs of 4 s) measured idle 14% of the epoch with a
# 1 s slack, 8.5% with 0.5 s, 6.2% with none, 19-30% without pre-scheduling; full runs (matchmaking_time 5 s, epochs
# of 4x it, 3 and 4 peers) 5.3-5.5% with a 1 s slack, where peers arrived at the boundary 0.07 s apart. A 0.5 s
# slack passed the fault tests (7 of 7) but not a fresh-clone suite: with epochs shorter than matchmaking_time
# (tests/swarm/test_swarm_training.py) peers paired off across epochs and ended 0.02 apart; with 1 s, 4 of 4 passed.
# It was off for a while: with it, a peer back from a cut link (2 epochs behind) joined the others' state rounds
# without downloading and kept counting 2 epochs behind (2 of 5 cut-link runs). optimizer_class() now makes a peer
# that begins a boundary 2+ epochs behind download first, and downloads no longer relabel an older state; with both,
# the cut-link test passed 5 of 7 runs (the other two failed on over-strict checks of the test, relaxed since) and the
# 2 | 2 partition ended bit-identical in 5 of 5 (3 of 3 in session 9). A peer skips the state round of its first
# boundary after a download (see _update_global_epoch in optimizer_class) and schedules its next one once the others
# have left that boundary (_swarm_moved_on). The demo's 3 peers once ended 0.0074 apart with it on (3 of 10 runs in
# session 9): the cause was the first epoch, not pre-scheduling (hivemind read the swarm's progress 10 s apart while
# its ETA warmed up; make_progress_tracker fixes it: 16 of 16 demo runs bit-identical since).
# OFF by default: the churn test (5 peers, a kill every 10-12 s, epochs about one matchmaking_time long) failed 2 of 4
# runs with it on in session 9 (restarted peers that downloaded as the others passed a boundary counted one epoch
# behind and their skipped state round left them apart), 0 of 2 with it off.
# With it off, the round started at the boundary no longer idles a matchmaking_time either: its group assembles as
# soon as the peers of the epoch's gradient round are in (ConsistentStateAverager._size_next_group).
PRESCHEDULE_STATE_ROUND = False
STATE_ROUND_SLACK = 1.0


def preschedule_state_rounds(optimizer: Any) -> None:
    """Make ``optimizer`` (a ``hivemind.Optimizer``) pre-schedule its state rounds from the first epoch, each group
    open until the round's estimated start plus a slack (see the comment above).

    A client-mode peer never leads a group, and a leader takes a peer only if the peer's round ends no earlier
    than its own (hivemind's matchmaking: BAD_EXPIRATION_TIME otherwise). Each peer schedules from its own estimate,
    so a client whose estimate came out earliest found no group at all (the NAT test: a client's state round
    failed, the other two averaged without it). A client's round is scheduled a ``matchmaking_time`` later: it
    waits for whichever leader takes it, and costs nobody any time."""
    averager, tracker = optimizer.state_averager, optimizer.tracker
    optimizer.collabopt_preschedules_state = True  # optimizer_class()._update_global_epoch relies on it
    slack = min(STATE_ROUND_SLACK, 0.5 * optimizer.matchmaking_time)
    if optimizer.client_mode:
        slack += optimizer.matchmaking_time
    optimizer.delay_before_state_averaging.update(task_size=1, interval=0.0)
    schedule_step = averager.schedule_step

    def schedule_at_the_estimate(scheduled_time: float | None = None, **kwargs: Any) -> Any:
        if scheduled_time is None:  # what _maybe_schedule_state_averaging estimates, plus the slack
            scheduled_time = (tracker.estimated_next_update_time
                              + optimizer.delay_before_state_averaging.ema_seconds_per_sample
                              + averager.delay_before_averaging.ema_seconds_per_sample + slack)
            if kwargs.get("timeout") is not None:  # hivemind asserts it lies before the round's deadline
                scheduled_time = min(scheduled_time, dht_time() + kwargs["timeout"] - 0.01)
        return schedule_step(scheduled_time=scheduled_time, **kwargs)

    averager.schedule_step = schedule_at_the_estimate


def forget_stale_progress(tracker: Any, local_epoch: int) -> None:
    """After a state download, drop the tracker's view of an epoch this peer has left, and fetch the swarm's now.

    hivemind 1.1.12 keeps the view fetched before the download: a peer that caught up from epoch 10 to 12 still held
    epoch 11's progress (ETA passed), so ``ready_to_update_epoch`` was true and it began the boundary of epoch 12 at
    once, with no samples, before the others had any; its state round then found no group (the others had
    pre-scheduled theirs) and it ended the run apart (the 2 | 2 partition test)."""
    with tracker.pause_updates():
        if tracker.global_progress.epoch > local_epoch:
            return  # news: the swarm moved on during the download (hivemind downloads again)
        fetch_progress_anew(tracker, epoch=local_epoch, samples_accumulated=0)


def fetch_progress_anew(tracker: Any, **changes: Any) -> None:
    """Drop the ETA of the tracker's view of the swarm (with ``changes`` to that view) and make it fetch the swarm's
    progress now. Call under ``tracker.pause_updates()``."""
    from hivemind.utils import get_dht_time

    tracker.global_progress = dataclasses.replace(tracker.global_progress, eta_next_epoch=float("inf"),
                                                  next_fetch_time=get_dht_time(), **changes)
    tracker.global_state_updated.set()  # the fetcher re-reads next_fetch_time: it fetches now


def _record_not_older_than(record: Any, oldest: float) -> Any:
    """A progress record (a ``ValueWithExpiration`` of a dict) whose ``time`` is at least ``oldest``: as it was, or
    a copy with ``time = oldest``; anything else as it was (hivemind's parser skips what it cannot read)."""
    from hivemind.utils.timed_storage import ValueWithExpiration

    value = getattr(record, "value", None)
    if not isinstance(value, dict) or not isinstance(value.get("time"), float) or value["time"] >= oldest:
        return record
    return ValueWithExpiration(dict(value, time=oldest), record.expiration_time)


def make_progress_tracker(optimizer: Any, target_batch_size: int, **kwargs: Any) -> Any:
    """``hivemind.Optimizer._make_progress_tracker``, building :func:`_progress_tracker_class`'s tracker (a
    subclass of ``hivemind.Optimizer`` gets it with ``_make_progress_tracker = make_progress_tracker``).

    It fetches the swarm's progress at least every half ``matchmaking_time`` (hivemind: every 10 s at most). Between
    fetches a peer counts only its own samples, and hivemind spaces fetches by its ETA, which is far too long while
    its throughput estimates warm up (the demo's first fetches: ETA 34-96 s for epochs of 4 s): each peer began the
    first boundary when its own samples reached the target, seconds apart, the slowest missed the first round and
    counted one epoch behind the others from then on."""
    kwargs.setdefault("max_refresh_period", max(kwargs.get("min_refresh_period", 0.5), optimizer.matchmaking_time / 2))
    return _progress_tracker_class()(dht=optimizer.dht, prefix=optimizer.run_id, target_batch_size=target_batch_size,
                                     client_mode=optimizer.client_mode, status_loglevel=optimizer.status_loglevel,
                                     start=True, **kwargs)


@functools.lru_cache(maxsize=1)
def _progress_tracker_class() -> type:
    from hivemind.optim.progress_tracker import ProgressTracker

    class ProgressTrackerThatDrains(ProgressTracker):
        """hivemind's tracker, with these changes.

        * **Throttled reports.** hivemind stores this peer's progress record in the DHT at every step: a signed record
          to 5 replicas, ~25 kB sent across the swarm each (measured: 390 kB/s sent per peer of 4 at 20 steps/s on the
          WAN bed, with no round at all; a 10 Mbit/s uplink is 1,250 kB/s). Others fetch the records at most every
          ``min_refresh_period`` and extrapolate each by its samples per second, so this one stores the record at
          most once per :meth:`report_period` (``min_refresh_period``), at once when the epoch changes or the count
          drops, and a count held back goes out when its period ends.
        * **A clean exit.** hivemind 1.1.12's tracker stops its event loop while its last progress report (a DHT
          store it has just cancelled) is still pending, and asyncio prints "Task was destroyed but it is pending!"
          when that task is garbage-collected: at nearly every peer's exit. This one lets the loop finish those
          tasks, then closes it, before it reports the shutdown complete (and so before hivemind stores the peer's
          goodbye record).
        * **Fetches outside the lock.** hivemind holds ``lock_global_progress`` (:meth:`pause_updates`) while its DHT
          get of the records is in flight, and a peer's step takes that lock at every epoch boundary: when a peer
          holding a replica of the records cannot be reached (a cut link), each get waits out the DHT's timeout
          (3 s) and so did every other peer's training thread at its boundary (profiled in the cut-link test:
          every peer's training thread waited there on the lock, up to 3.6 s). This one fetches without the lock
          and takes it only to apply the records. Records fetched while a :meth:`pause_updates` section ran are
          dropped and fetched again, as hivemind's lock kept them out: such a section changes the epoch, downloads
          a state or (DiLoCo, a round not applied) resets the count toward the next round, and records from
          before it would restore the old count (the next step would start another round at once), its ETA and
          ``fetched_global_progress_this_epoch``.
        * **No extrapolation of idle peers.** hivemind extrapolates each record's count by its samples per second
          until the record expires, also for a peer that stopped stepping; this one for at most
          :meth:`extrapolation_limit` seconds (:meth:`_parse_swarm_progress_data`).

        The gate is the reporter's event itself: hivemind's reporter thread waits on it, so setting it and clearing
        it a moment later (as collabopt once did) still woke the reporter, which stored anyway."""

        _pauses = 0  # pause_updates() sections ended so far: a fetch that straddles one is dropped

        lowest_epoch: tuple[int, int] | None = None  # (the lowest epoch in the last records fetched, this peer's then)
        _next_report = -float("inf")  # time.monotonic() before which a step's report waits
        _gated = False  # set while report_local_progress runs for a report that may wait
        _flush: threading.Timer | None = None  # pending: sends a held-back count when its period ends
        _flush_lock = threading.RLock()

        def report_period(self) -> float:
            """Seconds between two stores of this peer's record (a change of epoch goes out at once)."""
            return self.min_refresh_period

        def _get_local_progress(self, local_epoch: int, samples_accumulated: int) -> Any:
            """hivemind's record of this peer's progress, built at every step: without pydantic's validation of
            values that have the record's types already (a third of hivemind's per-step work in a DiLoCo peer's
            profile; the peers that fetch the record validate it)."""
            from hivemind.optim.progress_tracker import LocalTrainingProgress
            from hivemind.utils import get_dht_time

            rate, now = self.performance_ema.samples_per_second, get_dht_time()
            if not (type(local_epoch) is int and type(samples_accumulated) is int and min(local_epoch,
                    samples_accumulated) >= 0 and type(rate) is float and rate >= 0 and type(now) is float
                    and type(self.client_mode) is bool):  # what the validation may refuse: validate (and raise)
                return super()._get_local_progress(local_epoch, samples_accumulated)
            return LocalTrainingProgress.construct(
                peer_id=self.dht.peer_id.to_bytes(), epoch=local_epoch, samples_accumulated=samples_accumulated,
                samples_per_second=rate, time=now, client_mode=self.client_mode)

        @property
        def should_report_progress(self) -> threading.Event:
            return self._report_event

        @should_report_progress.setter
        def should_report_progress(self, _event: threading.Event) -> None:  # hivemind's __init__ assigns one
            self._report_event = _GatedEvent(self._may_report)

        def _may_report(self) -> bool:
            now = time.monotonic()
            if self._gated and now < self._next_report:
                self._hold_back(self._next_report - now)
                return False
            self._next_report = now + self.report_period()
            return True

        def _hold_back(self, delay: float) -> None:
            with self._flush_lock:
                if self._flush is None:
                    self._flush = threading.Timer(delay, self._report_held_back)
                    self._flush.daemon = True
                    self._flush.start()

        def _report_held_back(self) -> None:
            with self._flush_lock:
                self._flush = None
                now = time.monotonic()
                if now < self._next_report:  # a change of epoch went out meanwhile: wait for its period
                    self._hold_back(self._next_report - now)
                    return
                self._next_report = now + self.report_period()
            threading.Event.set(self._report_event)

        def report_local_progress(self, local_epoch: int, samples_accumulated: int,
                                  update_global_samples: bool = True) -> None:
            previous = self.local_progress
            urgent = local_epoch != previous.epoch or samples_accumulated < previous.samples_accumulated
            self._gated = not urgent
            try:
                super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
            finally:
                self._gated = False

        def update_epoch(self, new_epoch: int | None = None) -> int:
            """hivemind's, but where the swarm's view already was at the new epoch (a peer entered it first), its ETA
            is dropped and the swarm's progress fetched now. hivemind kept that ETA: extrapolated, at the last fetch
            before this peer's boundary, from every peer's rate, it could have passed while this peer was busy in its
            boundary, and the peer then began the epoch's global step at its next step (a suite run: 0.07 s after
            entering the epoch, while another peer downloaded; its rounds found no group and waited out
            ``averaging_timeout``). :func:`forget_stale_progress` does the same after a download."""
            joins = new_epoch is not None and new_epoch <= self.global_progress.epoch
            epoch = super().update_epoch(new_epoch)
            if joins:
                fetch_progress_anew(self)
            return epoch

        def shutdown(self, *args: Any, **kwargs: Any) -> Any:
            with self._flush_lock:
                if self._flush is not None:
                    self._flush.cancel()
            return super().shutdown(*args, **kwargs)

        @contextlib.contextmanager
        def pause_updates(self) -> Iterator[None]:
            with super().pause_updates():
                try:
                    yield
                finally:
                    self._pauses += 1  # (still under lock_global_progress)

        async def _progress_fetcher(self) -> None:
            """hivemind 1.1.12's fetcher, with the DHT get moved out of ``lock_global_progress`` (see above)."""
            from hivemind.utils.asyncio import enter_asynchronously
            from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

            loop = asyncio.get_event_loop()
            shutdown = asyncio.create_task(asyncio.wait_for(loop.run_in_executor(None, self.shutdown_triggered.wait),
                                                            None))
            try:
                while not self.shutdown_triggered.is_set():
                    wait = max(0.0, self.global_progress.next_fetch_time - get_dht_time())
                    if await loop.run_in_executor(None, self.global_state_updated.wait, wait):
                        self.global_state_updated.clear()
                        continue
                    pauses = self._pauses
                    getter = asyncio.create_task(asyncio.wait_for(  # (wraps hivemind's MPFuture in a coroutine)
                        self.dht.get(self.training_progress_key, latest=True, return_future=True), None))
                    await asyncio.wait({getter, shutdown}, return_when=asyncio.FIRST_COMPLETED)
                    if self.shutdown_triggered.is_set():
                        break
                    found = await getter
                    metadata = found.value if isinstance(found, ValueWithExpiration) else None
                    async with enter_asynchronously(self.lock_global_progress):
                        if self._pauses != pauses:
                            continue  # a paused section ran while the records were in flight: fetch them again
                        self.global_progress = self._parse_swarm_progress_data(metadata)
                        self.fetched_global_progress_this_epoch.set()
            finally:
                logging.getLogger("hivemind.optim.progress_tracker").log(
                    self.status_loglevel, f"No longer fetching {self.training_progress_key}")

        def extrapolation_limit(self) -> float:
            """Seconds past its record's time for which a peer's samples are extrapolated (see
            :meth:`_parse_swarm_progress_data`): a peer that steps stores its record at least once per
            :meth:`report_period` (peers of a run share it); ``min_refresh_period`` more for the store's latency."""
            return self.report_period() + self.min_refresh_period

        def _parse_swarm_progress_data(self, metadata: Any) -> Any:
            """hivemind's, but a peer's samples are extrapolated for at most :meth:`extrapolation_limit` seconds past
            its record's time.

            hivemind adds ``samples_per_second * (now - record time)`` to each record's count, without limit, until
            the record expires. A peer that stopped stepping (blocked in a state download, paused, at a finish line,
            or killed) still counted as training: 2 s of an idle peer's rate filled a 512-sample epoch, and a peer
            that had just entered it began the global step at its next step with none of its own (a suite run of the
            unguarded-NaN test: its rounds found no group and waited out ``averaging_timeout``). A peer that steps
            stores its record at least once per report period (collabopt) or at every step (hivemind), so within the
            limit its count is extrapolated as before; a peer whose steps take longer than the limit has its samples
            counted when its step reports them."""
            from hivemind.utils import get_dht_time

            if isinstance(metadata, dict):
                oldest = get_dht_time() - self.extrapolation_limit()
                metadata = {key: _record_not_older_than(record, oldest) for key, record in metadata.items()}
            progress = super()._parse_swarm_progress_data(metadata)
            epochs = [self.local_progress.epoch]
            for record in metadata.values() if isinstance(metadata, dict) else ():
                with contextlib.suppress(Exception):  # a goodbye (None) or a record hivemind skipped too
                    epochs.append(int(record.value["epoch"]))
            self.lowest_epoch = (min(epochs), self.local_progress.epoch)
            return progress

        def run(self) -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
                pending = asyncio.all_tasks(loop)
                if pending:  # cancelled already, or a last fetch: both end within a few loop iterations
                    loop.run_until_complete(asyncio.wait(pending, timeout=2.0))
                for task in asyncio.all_tasks(loop):
                    task.cancel()
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        loop.run_until_complete(asyncio.wait_for(task, timeout=1.0))
            finally:
                loop.close()
                self.shutdown_complete.set()

    return ProgressTrackerThatDrains


def reader_validators() -> list:
    """Validators for a DHT that serves a run's records without training (the demo's bootstrap DHT): it refuses to
    store a record under a peer's key that this peer did not sign.

    Readers do not need them: :func:`read_run_records` checks every record itself.
    """
    from hivemind.dht.crypto import RSASignatureValidator

    return [RSASignatureValidator()]


def versions() -> dict[str, str]:
    """Versions a peer publishes: collabopt, hivemind, torch, Python."""
    import platform

    import hivemind

    from collabopt import __version__

    return dict(collabopt=__version__, hivemind=hivemind.__version__, torch=torch.__version__.split("+")[0],
                python=platform.python_version())


# ---------------------------------------------------------------- the run's records on the DHT

MAX_RECORD_BYTES = 4096  # a real progress record takes ~150 bytes, a metrics record ~600: bigger ones are refused
_MAX_ENTRIES_PER_SOURCE = 2048  # records read from one DHT node per key (the rest are counted as oversized)
_K_NEAREST = 16  # DHT nodes asked for a key (hivemind stores each record on the 5 nearest)


@functools.lru_cache(maxsize=1)
def _record_models() -> dict[str, Any]:
    """The pydantic (v1, as hivemind uses) models of the per-peer records, built on first use (they import hivemind).

    ``PeerMetrics`` is a peer's metrics record (see :mod:`collabopt.metrics`): strict types and bounded strings, and
    finite numbers only (hivemind's schema check compares the parsed value with the stored one, and NaN != NaN).
    """

    from hivemind.dht.schema import BytesWithPublicKey
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from pydantic.v1 import StrictBool, StrictFloat, confloat, conint, constr, create_model

    count = (conint(strict=True, ge=0), ...)
    name = (constr(strict=True, max_length=64), ...)
    metrics = create_model(
        "PeerMetrics", __module__=__name__,
        peer_id=(constr(strict=True, min_length=1, max_length=128), ...),
        time=(StrictFloat, ...),
        interval=(confloat(strict=True, gt=0.0, le=3600.0), ...),
        epoch=count, global_epoch=count,
        samples_per_second=(confloat(strict=True, ge=0.0), ...),
        samples_reported=count, samples_skipped=count, nonfinite_steps=count,
        target_batch_size=(conint(strict=True, ge=1), ...),
        loss=(StrictFloat | None, None),
        losses_reported=count, nonfinite_losses=count,
        client_mode=(StrictBool, ...), relayed=(StrictBool, ...), auxiliary=(StrictBool, ...),
        collabopt_version=name, hivemind_version=name, torch_version=name, python_version=name,
    )
    schema = create_model("MetricsSchema", __module__=__name__,
                          metrics=(dict[BytesWithPublicKey, metrics | None], ...))
    return dict(progress=LocalTrainingProgress, metrics=metrics, PeerMetrics=metrics, MetricsSchema=schema)


def __getattr__(name: str) -> Any:
    """``PeerMetrics`` and ``MetricsSchema`` (built on first use): pickle finds them here when hivemind sends a
    peer's validators to its DHT process."""
    if name in ("PeerMetrics", "MetricsSchema"):
        return _record_models()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def metrics_fields() -> list[str]:
    """Names of the fields of a peer's metrics record."""
    return list(_record_models()["metrics"].__fields__)


def metrics_validators(run_id: str) -> list:
    """What a peer's DHT checks records under ``<run_id>_metrics`` with: signed by the key in the subkey, and the
    schema of :func:`metrics_fields` (as hivemind's tracker does for ``<run_id>_progress``)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator

    return [SchemaValidator(_record_models()["MetricsSchema"], prefix=run_id), RSASignatureValidator()]


class RecordSizeValidator(RecordValidatorBase):
    """Refuses records of more than ``max_bytes`` (subkey and signed value) under ``keys``; checked before the
    signature (cheaper). Several instances merge into one."""

    def __init__(self, keys: list[str], max_bytes: int):
        from hivemind.dht.routing import DHTID

        self.key_ids = {DHTID.generate(source=key).to_bytes() for key in keys}
        self.max_bytes = max_bytes

    def validate(self, record: Any) -> bool:
        return record.key not in self.key_ids or len(record.subkey) + len(record.value) <= self.max_bytes

    @property
    def priority(self) -> int:
        return 20  # RSASignatureValidator's is 10: higher runs first on validation

    def merge_with(self, other: Any) -> bool:
        if not isinstance(other, RecordSizeValidator) or other.max_bytes != self.max_bytes:
            return False
        self.key_ids |= other.key_ids
        return True


async def _find_raw(keys: list[str], k_nearest: int, _dht: Any, node: Any) -> dict[str, Any]:
    """Runs in the DHT process: every record stored under ``keys`` as the nearest DHT nodes (and this one) hold
    it, unchecked. hivemind's own get() drops a node's whole dictionary when one record in it fails validation and
    merges the rest by expiration time, so one forged record would hide (or shadow) real ones: reading raw,
    :func:`read_run_records` judges every record on its own."""
    import asyncio

    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.proto import dht_pb2

    serializer = node.protocol.serializer
    output: dict[str, Any] = {key: dict(records=[], bad_responses=0, sources=0) for key in keys}
    key_ids = {DHTID.generate(source=key): key for key in keys}

    def add(key: str, source: str, found: Any) -> None:
        if found is None:
            return
        records = output[key]["records"]

        def record(subkey: bytes | None, value: bytes, expiration: float) -> None:
            size = len(subkey or b"") + len(value)
            if size > MAX_RECORD_BYTES:  # refused anyway: only a fingerprint travels back (and fits hivemind's pipes)
                subkey = hashlib.sha256(subkey).digest() if subkey is not None else None
                value = hashlib.sha256(value).digest()
            records.append((source, subkey, value, float(expiration), size))

        value = found.value
        if isinstance(value, DictionaryDHTValue):
            for i, (subkey, entry) in enumerate(value.items()):
                if i >= _MAX_ENTRIES_PER_SOURCE:
                    record(b"", b"x" * (MAX_RECORD_BYTES + 1), entry.expiration_time)  # one more, counted oversized
                    break
                try:
                    subkey_bytes = serializer.dumps(subkey)
                except Exception:
                    subkey_bytes = b""
                record(subkey_bytes, bytes(entry.value), entry.expiration_time)
        elif isinstance(value, bytes):
            record(None, value, found.expiration_time)

    for key_id, key in key_ids.items():
        for storage in (node.protocol.storage, node.protocol.cache):
            add(key, "local", storage.get(key_id))

    nearest = await node.find_nearest_nodes(list(key_ids), k_nearest=k_nearest, exclude_self=True)

    async def ask(key_id: Any, peer_id: Any) -> None:
        key = key_ids[key_id]
        request = dht_pb2.FindRequest(keys=[key_id.to_bytes()], peer=node.protocol.node_info)
        try:
            response = await node.protocol.get_stub(peer_id).rpc_find(request, timeout=node.protocol.wait_timeout)
        except Exception:
            return  # no answer: not a record
        output[key]["sources"] += 1
        try:
            result = response.results[0]
            if result.type == dht_pb2.FOUND_DICTIONARY:
                found = serializer.loads(result.value)
                if not isinstance(found, DictionaryDHTValue):
                    raise TypeError(type(found).__name__)
                add(key, peer_id.to_base58(), _WithExpiration(found, result.expiration_time))
            elif result.type == dht_pb2.FOUND_REGULAR:
                add(key, peer_id.to_base58(), _WithExpiration(bytes(result.value), result.expiration_time))
        except Exception:
            output[key]["bad_responses"] += 1  # an answer that does not decode: a rogue node's

    await asyncio.gather(*(ask(key_id, peer_id) for key_id, peers in nearest.items()
                           for node_id, peer_id in peers.items() if node_id != node.node_id))
    return output


class _WithExpiration:
    def __init__(self, value: Any, expiration_time: float):
        self.value, self.expiration_time = value, expiration_time


@functools.lru_cache(maxsize=1)
def _signature_checker() -> Any:
    from hivemind.dht.crypto import RSASignatureValidator

    return RSASignatureValidator()


def _check_record(key_id: bytes, subkey: bytes | None, value: bytes, expiration: float, model: Any,
                  size: int | None = None) -> tuple[str, bytes | None, Any]:
    """Judge one raw record (``size``: its size as stored, when ``subkey``/``value`` are fingerprints of a bigger
    one): ``("ok", owner key, parsed record or None for a peer that left)`` or ``(reason, None, None)`` with reason
    ``oversized`` / ``unsigned`` / ``bad_signature`` / ``malformed``."""
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    if subkey is None:
        return "malformed", None, None  # one plain value where every peer keeps its own record
    if (size if size is not None else len(subkey) + len(value)) > MAX_RECORD_BYTES:
        return "oversized", None, None
    checker = _signature_checker()
    try:
        subkey_value = MSGPackSerializer.loads(subkey)
    except Exception:
        return "malformed", None, None
    owners = checker._PUBLIC_KEY_RE.findall(subkey_value) if isinstance(subkey_value, bytes) else []
    if len(set(owners)) != 1:
        return "unsigned", None, None  # anyone may write under a subkey that names no key
    record = DHTRecord(key_id, subkey, value, expiration)
    try:
        if not checker.validate(record):
            return "bad_signature", None, None
    except Exception:  # e.g. the subkey names something that is not an RSA key
        return "bad_signature", None, None
    try:
        content = MSGPackSerializer.loads(checker.strip_value(record))
    except Exception:
        return "malformed", None, None
    if content is None:
        return "ok", owners[0], None  # what a peer stores when it leaves
    try:
        parsed = model.parse_obj(content)
        if parsed.dict() != content:  # as hivemind's SchemaValidator: no conversions, no extra fields
            raise ValueError("the record needs conversions")
    except Exception:
        return "malformed", None, None
    return "ok", owners[0], parsed


class RunRecords:
    """The records of a run read from the DHT: ``progress`` and ``metrics`` map each peer's key (bytes) to
    ``(record dict or None if it left, expiration time)``, the newest valid record of each peer;
    ``rejected`` holds ``(key, fingerprint, reason)`` of every record that failed its checks."""

    def __init__(self) -> None:
        self.progress: dict[bytes, tuple[dict | None, float]] = {}
        self.metrics: dict[bytes, tuple[dict | None, float]] = {}
        self.rejected: list[tuple[str, bytes, str]] = []
        self.sources = 0
        self.bad_responses = 0


def read_run_records(dht: Any, run_id: str, timeout: float = 10.0) -> RunRecords:
    """Read the progress records (hivemind's tracker) and metrics records (:mod:`collabopt.metrics`) of ``run_id``
    from the nearest DHT nodes, checking each record on its own: signed by the key its subkey names, within
    :data:`MAX_RECORD_BYTES`, matching its schema. Works with any DHT (no validators needed); a record that fails
    is left out and reported in :attr:`RunRecords.rejected`."""
    from hivemind.dht.routing import DHTID

    models = _record_models()
    names = {f"{run_id}_progress": "progress", f"{run_id}_metrics": "metrics"}
    result = RunRecords()
    try:
        raw = dht.run_coroutine(functools.partial(_find_raw, list(names), _K_NEAREST),
                                return_future=True).result(timeout=timeout)
    except FutureTimeout:
        return result
    for key, found in raw.items():
        kind = names[key]
        key_id = DHTID.generate(source=key).to_bytes()
        result.sources = max(result.sources, found["sources"])
        result.bad_responses += found["bad_responses"]
        newest = getattr(result, kind)
        seen: set[bytes] = set()
        for _source, subkey, value, expiration, size in found["records"]:
            fingerprint = hashlib.sha256(repr((key, subkey, value, expiration)).encode()).digest()[:16]
            if fingerprint in seen:
                continue  # the same record, held by another node too
            seen.add(fingerprint)
            reason, owner, parsed = _check_record(key_id, subkey, value, expiration, models[kind], size)
            if reason != "ok":
                result.rejected.append((kind, fingerprint, reason))
                continue
            if owner not in newest or newest[owner][1] < expiration:
                newest[owner] = (_plain(parsed.dict()) if parsed is not None else None, expiration)
    return result


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """A record with the peer id as text (progress records hold hivemind's PeerID bytes)."""
    peer_id = record.get("peer_id")
    if isinstance(peer_id, bytes):
        from hivemind.p2p import PeerID

        record = dict(record, peer_id=PeerID(peer_id).to_base58())
    return record


def read_progress_records(dht: Any, run_id: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The progress records of the peers of ``run_id`` that are training (hivemind's ``LocalTrainingProgress``, peer
    id as text), each checked on its own (see :func:`read_run_records`)."""
    records = read_run_records(dht, run_id, timeout).progress
    return [record for record, _expiration in records.values() if record is not None]


class HivemindPeer:
    """This process's ``hivemind.Optimizer``, seen through what collabopt needs of it.

    Built in the process's main thread (hivemind installs signal handlers). ``arguments`` are
    ``hivemind.Optimizer`` keyword arguments without ``dht``.
    """

    def __init__(self, dht: Any, arguments: dict[str, Any]):
        # hivemind's Optimizer ignores its own client_mode argument: the DHT's is the one that counts
        with children_follow_parent():  # its averager processes end with this process, even on SIGKILL
            self.hivemind_optimizer = self._create_optimizer(dht, dict(arguments, client_mode=dht.client_mode))
        self.dht = dht
        run_id = arguments["run_id"]
        self.metrics_key = f"{run_id}_metrics"
        # this peer accepts (to store for others, or read) only metrics records signed by their owner and
        # well-formed, and no record over MAX_RECORD_BYTES under the run's keys: hivemind's progress schema leaves the
        # peer id's length open, so a well-formed, self-signed, 100 kB record would otherwise count as a peer
        dht.add_validators([*metrics_validators(run_id),
                            RecordSizeValidator([f"{run_id}_progress", self.metrics_key], MAX_RECORD_BYTES)])

    def _create_optimizer(self, dht: Any, arguments: dict[str, Any]) -> Any:
        optimizer = optimizer_class()(dht=dht, **arguments)
        check_lineage(optimizer)
        if PRESCHEDULE_STATE_ROUND:
            preschedule_state_rounds(optimizer)
        return optimizer

    # ---- stepping

    def step(self, samples: int | None) -> bool:
        """One local step of ``samples`` samples (``None``: an auxiliary peer's step). Returns whether hivemind
        accepted the samples (False when it dropped the step to download the swarm's state first)."""
        opt = self.hivemind_optimizer
        if samples is None:
            opt.step()
            return False
        reported_before = opt.tracker.local_progress.samples_accumulated
        epoch_before = opt.local_epoch
        opt.step(batch_size=samples)
        return opt.local_epoch != epoch_before or opt.tracker.local_progress.samples_accumulated != reported_before

    @property
    def accumulated_steps(self) -> int:
        """Local steps whose gradients hivemind holds toward the next global epoch (0 right after one)."""
        averager = self.hivemind_optimizer.grad_averager
        return averager.local_times_accumulated if averager is not None else 0

    @property
    def accumulated_samples(self) -> int:
        averager = self.hivemind_optimizer.grad_averager
        return averager.local_samples_accumulated if averager is not None else 0

    def accumulators(self) -> list[torch.Tensor] | None:
        """The tensors the local steps' gradients accumulate in toward the next global epoch (``param.grad`` with
        ``reuse_grad_buffers``, else hivemind's accumulators); ``None`` where gradients are applied, not accumulated
        (``use_local_updates``), or an averager keeps them its own way."""
        from hivemind.optim.grad_averager import GradientAverager

        averager = self.hivemind_optimizer.grad_averager
        if not isinstance(averager, GradientAverager) or type(averager) is not gradient_averager_class() and any(
                # an averager that accumulates its own way
                getattr(type(averager), name) is not getattr(GradientAverager, name)
                for name in ("accumulate_grads_", "_grad_accumulators", "load_accumulators_into_averager_")):
            return None
        return list(averager._grad_accumulators())

    def set_before_averaging(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` at each global epoch's boundary, before hivemind averages the accumulated gradients
        (it may drop them: :meth:`drop_accumulated`; hivemind then takes part with weight 0)."""
        self.hivemind_optimizer.collabopt_before_averaging = callback

    def drop_accumulated(self) -> None:
        """Forget the gradients and samples accumulated toward the next global epoch."""
        self.hivemind_optimizer.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
        if self.hivemind_optimizer.grad_averager is not None:
            self.hivemind_optimizer.grad_averager.reset_accumulated_grads_()

    def jump_to_epoch(self, epoch: int) -> None:
        """Continue from this peer's own parameters at ``epoch`` (nobody could serve the swarm's state)."""
        self.hivemind_optimizer.state_averager.local_epoch = epoch
        self.hivemind_optimizer.tracker.report_local_progress(epoch, samples_accumulated=0)

    def restore_epoch(self, epoch: int) -> None:
        """Set the local epoch from a checkpoint; the tracker's view of the swarm moves along with it (otherwise
        local samples do not count toward the restored epoch until its next fetch)."""
        self.hivemind_optimizer.state_averager.local_epoch = epoch
        with self.hivemind_optimizer.tracker.pause_updates():
            self.hivemind_optimizer.tracker.update_epoch(epoch)

    def finish_background_work(self, apply: bool = True) -> None:
        """Wait for delayed optimizer steps and averaging rounds (and apply their results)."""
        self.hivemind_optimizer.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=apply)

    def load_state_from_peers(self) -> None:
        self.hivemind_optimizer.load_state_from_peers()

    # ---- what the peer holds

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer hivemind really steps (a copy of the user's when offloading)."""
        return self.hivemind_optimizer.state_averager.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return list(self.hivemind_optimizer.param_groups)

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters (those the gradients are read from)."""
        return list(self.hivemind_optimizer.state_averager.main_parameters)

    # ---- the swarm as this peer sees it

    @property
    def local_epoch(self) -> int:
        return self.hivemind_optimizer.local_epoch

    @property
    def global_epoch(self) -> int:
        return self.hivemind_optimizer.tracker.global_epoch

    @property
    def num_peers(self) -> int:
        return self.hivemind_optimizer.tracker.global_progress.num_peers

    @property
    def samples_accumulated(self) -> int:
        return self.hivemind_optimizer.tracker.global_progress.samples_accumulated

    @property
    def samples_per_second(self) -> float:
        tracker = self.hivemind_optimizer.tracker
        # hivemind 1.1.12's GlobalTrainingProgress has no samples_per_second field
        value = getattr(tracker.global_progress, "samples_per_second", None)
        if value is None:
            value = tracker.performance_ema.samples_per_second * max(1, tracker.global_progress.num_peers)
        return float(value)

    @property
    def eta_next_epoch(self) -> float:
        return max(0.0, self.hivemind_optimizer.tracker.estimated_next_update_time - dht_time())

    @property
    def local_samples_per_second(self) -> float:
        """This peer's own throughput (hivemind's moving average)."""
        return float(self.hivemind_optimizer.tracker.performance_ema.samples_per_second)

    @property
    def client_mode(self) -> bool:
        return bool(self.dht.client_mode)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def relayed(self) -> bool:
        """Whether this peer is reached through a relay (a ``/p2p-circuit`` address among those it announces)."""
        return any("p2p-circuit" in str(m) for m in self.dht.get_visible_maddrs())

    def publish_metrics(self, record: dict[str, Any] | None, expiration: float) -> None:
        """Store this peer's metrics record (``None``: it leaves) under its signed subkey, without waiting."""
        tracker = self.hivemind_optimizer.tracker
        self.dht.store(key=self.metrics_key, subkey=tracker._local_public_key, value=record,
                       expiration_time=expiration, return_future=True)

    def announce(self, timeout: float = 10.0) -> None:
        """Publish this peer's progress record now, with zero samples, and make the tracker fetch the swarm's.

        hivemind publishes a peer's record only once it has accumulated samples, so peers that wait for each other
        before their first step never see each other. Stored under the tracker's own signed subkey; the tracker
        replaces it with its own reports as soon as this peer trains.
        """
        tracker = self.hivemind_optimizer.tracker
        future = tracker.dht.store(key=tracker.training_progress_key, subkey=tracker._local_public_key,
                                   value=tracker.local_progress.dict(),
                                   expiration_time=dht_time() + tracker.metadata_expiration, return_future=True)
        with contextlib.suppress(FutureTimeout):  # not stored in time: the next call tries again
            future.result(timeout=timeout)
        tracker.global_progress.next_fetch_time = dht_time()
        tracker.global_state_updated.set()  # wakes the fetcher, which then finds its next fetch due

    def shutdown(self) -> None:
        self.hivemind_optimizer.shutdown()


# ---------------------------------------------------------------- DiLoCo mode (the algorithm: collabopt/diloco.py)


def default_pseudo_gradient_compression() -> Any:
    """How pseudo-gradients travel unless ``grad_compression=`` says otherwise: fp16 (OpenDiLoCo found it lossless)."""
    from hivemind.compression import Float16Compression

    return Float16Compression()


def pseudo_gradient_averager_factory(request_timeout: float | None) -> Callable[..., Any]:
    """``grad_averager_factory`` of a DiLoCo peer: the pseudo-gradient averager (with ``request_timeout``, see
    :func:`gradient_averager_factory`)."""
    averager = _diloco_classes()["averager"]
    return functools.partial(averager, request_timeout=request_timeout) if request_timeout is not None else averager


class DiLoCoPeer(HivemindPeer):
    """A DiLoCo peer (see :mod:`collabopt.diloco`): ``step()`` applies the inner optimizer at once, then reports the
    samples; hivemind's optimizer is the outer one and its rounds average pseudo-gradients. ``optimizer`` is the
    inner optimizer (the one the scheduler drives, whose statistics are checkpointed)."""

    def __init__(self, dht: Any, arguments: dict[str, Any], diloco: Any):
        self.diloco = diloco
        super().__init__(dht, arguments)

    def _create_optimizer(self, dht: Any, arguments: dict[str, Any]) -> Any:
        return _diloco_classes()["optimizer"](dht=dht, diloco=self.diloco, **arguments)

    def step(self, samples: int | None) -> bool:
        if samples is not None:
            self.diloco.inner_step(samples)
        return super().step(samples)

    def accumulators(self) -> None:
        """None: the inner optimizer applies every step's gradients at once."""
        return None

    def restart_from_last_round(self) -> None:
        """The parameters turned non-finite: restart from the last round's (see :mod:`collabopt.diloco`)."""
        self.diloco.restart_from_last_round(self.hivemind_optimizer)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.diloco.inner

    @property
    def param_groups(self) -> list[dict]:
        return self.diloco.inner.param_groups

    def finish_background_work(self, apply: bool = True) -> None:
        """Also wait for the round in flight (``overlap_rounds``): applied, or with ``apply=False`` dropped (a
        checkpoint is being loaded: the parameters are the checkpoint's, not those the round started from)."""
        self.hivemind_optimizer.land(wait=True, apply=apply)
        super().finish_background_work(apply)

    def restore_epoch(self, epoch: int) -> None:
        """A checkpoint was loaded: its parameters become the anchor."""
        super().restore_epoch(epoch)
        self.diloco.reanchor(self.hivemind_optimizer)


PARTIAL_RESULTS = "collabopt_partial_results"  # what a DiLoCo round returns instead of its group's metadata when
# part of the average did not arrive (the averager runs in its own process: its round's result is the only channel)


def _raise_if_partial(gathered: Any) -> Any:
    from collabopt.diloco import PartialRound

    if isinstance(gathered, dict) and PARTIAL_RESULTS in gathered:
        raise PartialRound("part of the round's average did not arrive")
    return gathered


@functools.lru_cache(maxsize=1)
def _diloco_classes() -> dict[str, type]:
    """The hivemind subclasses of DiLoCo mode, built on first use (they import hivemind)."""
    import asyncio
    import logging

    from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
    from hivemind.averaging.partition import AllreduceException, BannedException
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.proto import averaging_pb2
    from hivemind.utils import get_dht_time
    from hivemind.utils.asyncio import amap_in_executor

    from collabopt import diloco as diloco_module

    logger = logging.getLogger(__name__)

    class PartialResults(AllreduceException):
        """The all-reduce ended with part (less than half) of the average missing here: most of this peer's
        pseudo-gradient demonstrably reached its reducers (see :class:`collabopt.diloco.PartialRound`)."""

    class ValueAllReduceRunner(AllReduceRunner):
        """hivemind's butterfly all-reduce, except that each reducer sends back the average itself, compressed
        once, instead of ``average - what that sender sent`` compressed per sender, and uses that same compressed
        value for its own part. hivemind's way leaves every peer a different compression error (with fp16, ~1e-3
        of the pseudo-gradient): here every peer of the group receives the same values. A result with parts missing
        (a reducer failed) raises instead of mixing in local values."""

        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self.tensor_part_container.return_deltas = False  # a failed reducer's part: the local one (then we raise)
            own = self.ordered_peer_ids.index(self.peer_id)
            self._own_part_infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[own]]

        async def run(self) -> Any:
            async for value in super().run():
                yield value
            failed, total = self.tensor_part_container.failed_size, self.tensor_part_container.total_size
            if failed and 2 * failed < total:
                # a reducer returns a part's average only once it holds every member's part: most of this peer's
                # pseudo-gradient reached the group (and where the rest went is unknown)
                raise PartialResults(f"{failed} of {total} values were not averaged")
            if failed:  # most of its pseudo-gradient may not have left (its link failed): a failed round
                raise AllreduceException(f"{failed} of {total} values were not averaged")

        async def _communicate_with_peer(self, peer_id: Any) -> None:
            if peer_id != self.peer_id:
                return await super()._communicate_with_peer(peer_id)
            peer_index = self.ordered_peer_ids.index(peer_id)
            sender_index = self.sender_peer_ids.index(peer_id)
            compression = self.tensor_part_container.compression
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                          weight=self.weight)
                as_sent = deserialize_torch_tensor(compression.compress(averaged, self._own_part_infos[part_index]))
                self.tensor_part_container.register_processed_part(peer_index, part_index, as_sent)

        async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
            # hivemind 1.1.12's method, replying with the average instead of the difference
            part_index = sent = 0
            try:
                loop = asyncio.get_event_loop()
                async for tensor_part, weight, part_compression in amap_in_executor(
                    lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                    stream,
                    max_prefetch=self.tensor_part_container.prefetch,
                ):
                    try:
                        averaged_part = await self.tensor_part_reducer.accumulate_part(
                            sender_index, part_index, tensor_part, weight=weight)
                        part_index += 1
                    except BannedException:
                        break  # the sender was banned: it no longer needs results
                    serialized = await loop.run_in_executor(
                        None, lambda part=averaged_part, kind=part_compression: serialize_torch_tensor(part, kind))
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                    sent += 1
            finally:
                if sent != self.tensor_part_reducer.num_parts:
                    logger.debug(f"{self}: results to sender {sender_index}: {sent} of "
                                 f"{self.tensor_part_reducer.num_parts} parts sent ({part_index} accumulated)",
                                 stack_info=True)
                if part_index != self.tensor_part_reducer.num_parts:
                    await self._ban_sender(self.sender_peer_ids[sender_index])

    class PseudoGradientAverager(GradientAverager):
        """hivemind's gradient averager as the carrier of pseudo-gradients: it only counts samples (the round writes
        the pseudo-gradients into its tensors) and averages with :class:`ValueAllReduceRunner`, applying a result
        only once all of it arrived. A round whose average came in part is not retried when most of it came (the
        others may have applied it with this peer's pseudo-gradient: :class:`collabopt.diloco.PartialRound`); a
        retried round resends the pseudo-gradients, not a partial result."""

        def __init__(self, parameters: Any, *, dht: Any, prefix: str, client_mode: bool | None = None,
                     **kwargs: Any):
            for ignored in ("reuse_grad_buffers", "accumulate_grads_on", "warn", "averaged_grads"):
                kwargs.pop(ignored, None)
            parameters = tuple(parameters)
            buffers = tuple(torch.zeros(p.shape, dtype=torch.float32).share_memory_() for p in parameters)
            kwargs.setdefault("allow_state_sharing", False)  # nothing to serve: the state averager serves the state
            self._partial_groups: set[bytes] = set()  # (averager process) all-reduces whose average came in part
            super().__init__(parameters, dht=dht, prefix=prefix, reuse_grad_buffers=True, client_mode=client_mode,
                             warn=False, averaged_grads=buffers, **kwargs)
            self.reuse_grad_buffers = False

        def _grads_from_parameters(self) -> Any:  # shapes only: never allocate .grad on the model's parameters
            return (p.detach() for p in self.parameters)

        def accumulate_grads_(self, batch_size: int) -> None:
            self.local_samples_accumulated += batch_size
            self.local_times_accumulated += 1

        def load_accumulators_into_averager_(self) -> None:
            pass  # the round has written the pseudo-gradients already

        def reset_accumulated_grads_(self) -> None:
            self.local_samples_accumulated = self.local_times_accumulated = 0
            self._accumulators_used_in_step = False

        async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, group_id: bytes | None = None,
                                          **kwargs: Any) -> None:
            # hivemind 1.1.12's method with ValueAllReduceRunner, writing the results once all arrived
            group_id = group_info.group_id if group_id is None else group_id
            runner = ValueAllReduceRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix,
                                          tensors=tensors, group_id=group_id, ordered_peer_ids=group_info.peer_ids,
                                          **kwargs)
            assert group_id in self._running_groups, f"Group id {group_id} was not registered"
            self._running_groups[group_id].set_result(runner)
            if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
                return
            try:
                results = [value async for value in runner]
            except PartialResults as e:
                # not an error hivemind may retry: this peer's pseudo-gradient may have reached the group, and a
                # retry would send it into another round (_aggregate_with_group tells the round instead)
                logger.warning(f"{self}: {e}; this peer's pseudo-gradient may have reached its group")
                self._partial_groups.add(group_id)
                return
            for tensor, value in zip(tensors, results, strict=True):
                tensor.copy_(value)
            self.last_updated = get_dht_time()
            self._state_updated.set()

        async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:
            gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
            if group_info.group_id in self._partial_groups:
                self._partial_groups.discard(group_info.group_id)
                return {PARTIAL_RESULTS: True}
            return gathered

    class ThrottledProgressTracker(_progress_tracker_class()):
        """A DiLoCo peer's tracker: it stores its progress record at most once per
        :func:`collabopt.diloco.report_period` (a tenth of the last round: rounds are hundreds of steps long; one
        store per ``min_refresh_period`` cost B6's peers 64 kB/s instead of 23, ~10% of their round's all-reduce)."""

        _epoch_began: float | None = None  # when this peer's current epoch (round) began, DHT time
        _last_round: float | None = None  # how long its last whole round took, seconds

        def report_period(self) -> float:
            return diloco_module.report_period(self._last_round, self.min_refresh_period, self.max_refresh_period)

        def report_local_progress(self, local_epoch: int, samples_accumulated: int,
                                  update_global_samples: bool = True) -> None:
            previous = self.local_progress
            if local_epoch != previous.epoch:
                now = get_dht_time()
                if self._epoch_began is not None and local_epoch == previous.epoch + 1:
                    self._last_round = now - self._epoch_began
                self._epoch_began = now
            super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)

    class DiLoCoOptimizer(optimizer_class()):
        """hivemind's optimizer with DiLoCo rounds: its (offloaded) optimizer is the outer one, whose parameters are
        the anchor; a round (:meth:`collabopt.diloco.DiLoCo.run_round`) replaces the global epoch. Also the
        :class:`collabopt.diloco.RoundSwarm` the round runs on."""

        def __init__(self, *, diloco: Any, **kwargs: Any):
            self.diloco = diloco
            self._in_flight: Any = None  # overlap: the StepControl of the round whose all-reduce is running
            self._sharing_paused = False  # overlap: state sharing is off while a round is in flight
            super().__init__(**kwargs)
            self.anchors = tuple(p for group in self.state_averager.optimizer.param_groups for p in group["params"])
            self.parameters = tuple(self.state_averager.main_parameters)

        def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> Any:
            return ThrottledProgressTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                            client_mode=self.client_mode, status_loglevel=self.status_loglevel,
                                            start=True, **kwargs)

        # ---- RoundSwarm

        @property
        def num_peers(self) -> int:
            return self.tracker.global_progress.num_peers

        def buffers(self) -> Any:
            return self.grad_averager.get_tensors()

        def average(self, weight: float) -> dict[Any, Any]:
            control, self.scheduled_grads = self.scheduled_grads, None
            if control is not None and (control.triggered or control.done()):
                control = None
            if control is None:
                control = self.grad_averager.step(weight=weight, reset_accumulators=False, wait=False,
                                                  timeout=self.averaging_timeout,
                                                  gather=self.diloco.round_metadata(self))
            else:
                self.grad_averager.step(control=control, weight=weight, reset_accumulators=False, wait=False)
            try:
                gathered = control.result(self.averaging_timeout)
            finally:
                if not control.done():
                    control.cancel()
            self.grad_averager.notify_used_averaged_gradients()
            return _raise_if_partial(gathered)

        def skip_averaging(self) -> None:
            control, self.scheduled_grads = self.scheduled_grads, None
            if control is not None and not control.done():
                control.cancel()

        def outer_step(self, increment_epoch: bool = True) -> None:
            # the outer optimizer steps on the anchor (its .grad are the averaged buffers, see hivemind's
            # _make_gradient_averager with offload_optimizer), then the anchor is copied into the model
            self.state_averager.step(increment_epoch=increment_epoch, optimizer_step=True)

        # ---- hivemind.Optimizer, DiLoCo's way

        def _should_load_state_from_peers(self) -> bool:
            # the anchor of a peer one epoch behind is stale: catch up at once (hivemind tolerates one epoch), unless
            # (overlap_rounds) the others started the round it trained toward: their epoch moved when they did
            return diloco_module.should_download(self.diloco, self.local_epoch, self.tracker.global_epoch)

        def _maybe_schedule_gradient_averaging(self) -> None:
            """As hivemind's, with this peer's round metadata (epoch, anchor fingerprint) for its group."""
            soon = self.tracker.estimated_next_update_time - get_dht_time() <= self.matchmaking_time
            if self.num_peers <= 1 or not soon or self._should_load_state_from_peers():
                return  # (a peer that must download first would bring a stale anchor to the others' round)
            self.land(wait=False)
            if self._in_flight is not None:
                return  # the anchor (whose fingerprint the group gathers) moves when it lands: schedule after
            if self.scheduled_grads is None or self.scheduled_grads.triggered or self.scheduled_grads.done():
                self.scheduled_grads = self.grad_averager.schedule_step(
                    timeout=self.averaging_timeout, gather=self.diloco.round_metadata(self))

        def _update_global_epoch(self, grad_scaler: Any) -> None:
            self.land(wait=True)  # one round in flight at most
            if self._should_load_state_from_peers():
                # its round could not be applied (its anchor is stale: the swarm is past its epoch, read after
                # this step began, or its group's anchor differed): the next step downloads, then rounds go on
                if not self.diloco.needs_sync:
                    logger.log(self.status_loglevel, f"collabopt: the swarm is at epoch {self.tracker.global_epoch}, "
                               f"this peer at {self.local_epoch}: no round; it downloads the swarm's state first")
                return
            if self.diloco.overlap and self.num_peers > 1:
                with self.tracker.pause_updates():
                    self._start_overlapped_round()
                    self._share_state()
                    self.grad_averager.reset_accumulated_grads_()
                return
            with self.tracker.pause_updates():
                outcome = self.diloco.run_round(self)
                if outcome.applied:
                    self.tracker.update_epoch(new_epoch=self.local_epoch)
                else:  # keep the pseudo-gradient: count samples toward the next round from zero
                    self.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
                    self.tracker.global_progress.samples_accumulated = 0
                    self.tracker.global_progress.eta_next_epoch = float("inf")
                self._share_state()
                self.grad_averager.reset_accumulated_grads_()
                logger.log(self.status_loglevel, f"DiLoCo round at epoch {self.local_epoch}: {outcome}")
            if not outcome.applied:
                self._fetch_progress_now()

        def _share_state(self) -> None:
            """Serve this peer's state with its epoch as priority; a peer whose anchor disagreed with its group's
            serves it with a lower priority (downloads prefer the group's)."""
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch - (0.5 if self.diloco.needs_sync
                                                                                 else 0.0)

        def load_state_from_peers(self, **kwargs: Any) -> None:
            """Download the swarm's anchor, outer optimizer state and epoch, keeping this peer's progress since its
            own anchor (parameters = downloaded anchor + progress)."""
            self.land(wait=True)
            control, self.scheduled_grads = self.scheduled_grads, None
            if control is not None and not control.done():
                with self.grad_averager.get_tensors() as buffers:
                    for buffer in buffers:
                        buffer.zero_()
                self._tag_along_with_zero_weight(control)
            self.state_averager.step(wait_for_delayed_updates=True)
            with self.tracker.pause_updates():
                progress, since = self.diloco.progress_to_keep(self)
                epoch, anchor = self.local_epoch, diloco_module.fingerprint(self.anchors)
                downloaded = True
                try:
                    self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
                except Exception as e:  # nobody could serve it now: the next step tries again
                    logger.warning("collabopt: downloading the swarm's state failed: %r", e)
                    downloaded = False
                moved = self.local_epoch != epoch or diloco_module.fingerprint(self.anchors) != anchor
                self.diloco.restore_after_download(self, progress, since, downloaded, moved)
                self.diloco.needs_sync = False
                if moved:
                    self.diloco.resyncs += 1
                self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
                self._share_state()
                self.grad_averager.reset_accumulated_grads_()

        @torch.no_grad()
        def reanchor(self, source: Any = None) -> None:
            with self.state_averager.lock_averaged_tensors:  # the anchor is the state this peer serves
                for anchor, value in zip(self.anchors, source or self.parameters, strict=True):
                    anchor.copy_(value.detach().to(device=anchor.device, dtype=anchor.dtype))

        # ---- overlap (overlap_rounds=True): the round's all-reduce runs while inner steps go on

        def step(self, *args: Any, **kwargs: Any) -> Any:
            self.land(wait=False)
            return super().step(*args, **kwargs)

        def land(self, wait: bool, apply: bool = True) -> None:
            """Apply the result of the round in flight if it arrived (or, with ``wait``, once it arrives); with
            ``apply=False`` wait for it and drop it."""
            control = self._in_flight
            if control is None or (not wait and not control.done()):
                return
            self._in_flight = None
            try:
                result = _raise_if_partial(control.result(self.averaging_timeout))
                self.grad_averager.notify_used_averaged_gradients()
            except Exception as e:
                result = e
                if not control.done():
                    control.cancel()
            if self._sharing_paused:  # this peer's epoch and anchor agree again: serve them
                self._sharing_paused = False
                self.state_averager.allow_state_sharing = True
            if not apply:
                self.diloco.pending = None
                return
            outcome = self.diloco.land_round(self, result)
            self._share_state()
            if not outcome.applied:
                self._fetch_progress_now()
            logger.log(self.status_loglevel, f"DiLoCo round landed at epoch {self.local_epoch}: {outcome}")

        def _start_overlapped_round(self) -> None:
            """Start the all-reduce of this round in the background and move to the next epoch at once."""
            weight = self.diloco.start_round(self)
            control, self.scheduled_grads = self.scheduled_grads, None
            if control is not None and not (control.triggered or control.done()):
                self.grad_averager.step(control=control, weight=weight, reset_accumulators=False, wait=False)
            else:
                control = self.grad_averager.step(weight=weight, reset_accumulators=False, wait=False,
                                                  timeout=self.averaging_timeout, gather=self.diloco.pending.metadata)
            self._in_flight = control
            self.state_averager.step(increment_epoch=True)
            self.tracker.update_epoch(new_epoch=self.local_epoch)
            if self.state_averager.allow_state_sharing:
                # until it lands, this peer's epoch is the next one but its anchor the last one: a peer that
                # downloaded them would hold an anchor the swarm no longer has at that epoch
                self._sharing_paused = True
                self.state_averager.allow_state_sharing = False

        def _fetch_progress_now(self) -> None:
            """Did the others apply the round this peer could not? (then it is behind and downloads; hivemind would
            look up to 10 s later)"""
            self.tracker.global_progress.next_fetch_time = get_dht_time()
            self.tracker.global_state_updated.set()

        def shutdown(self) -> None:
            self.land(wait=True)  # the others' round needs this peer's part
            super().shutdown()

    return dict(runner=ValueAllReduceRunner, averager=PseudoGradientAverager, optimizer=DiLoCoOptimizer,
                tracker=ThrottledProgressTracker)
