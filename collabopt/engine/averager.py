"""collabopt's averaging service: ``average(tensors, weight, timeout)`` with the peers of a swarm, and the evidence
of what happened, from a background thread with its own asyncio loop.

Rules, and why:

* It is composed of hivemind's transport, not derived from its averagers: the DHT's libp2p daemon (``await
  dht.replicate_p2p()``), ``ServicerBase`` handlers (:class:`~collabopt.engine.allreduce.AllReduceService`),
  hivemind's ``Matchmaking`` to assemble a group, and collabopt's own runner and part reducers
  (:mod:`collabopt.engine.allreduce`). What a round does is thus readable here and there, not in overrides.
* It runs in a thread of the calling process (no averager process, no shared-memory buffers): the tensors it is handed
  are copied into the round, and the result comes back as new tensors.
* A round's outcome is a value (:class:`AveragingResult`): the group, what each member gathered, the averaged tensors
  and the round's evidence (:class:`~collabopt.engine.allreduce.RoundEvidence`); no group, a timeout or a lost member
  are reported there, never raised. :mod:`collabopt.engine.protocol` judges it.
* Members must all use the same ``prefix``, ``aggregation``, compression and part size, and tensors of the same
  shapes and dtypes (matchmaking refuses others by their schema hash).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging.averager import compute_schema_hash
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.compression import CompressionBase, NoCompression
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine.allreduce import AllReduceRound, AllReduceService, RoundEvidence
from collabopt.engine.clipping import MIN_CLIPPED_GROUP
from collabopt.engine.part_reducer import AGGREGATES
from collabopt.engine.streams import MemberStub


@dataclasses.dataclass(frozen=True)
class AveragingResult:
    """One call of :meth:`AveragingService.average`: ``tensors`` (None where no group was assembled), the ``group``
    (members in the round's order, empty without one), what each member ``gathered`` (its ``gather`` argument), the
    round's ``evidence`` (None without a group) and ``error`` (why no round ran, or None)."""

    tensors: list[torch.Tensor] | None
    group: tuple[PeerID, ...]
    gathered: dict[PeerID, Any]
    evidence: RoundEvidence | None
    error: str | None = None


@dataclasses.dataclass
class _Search:
    """What hivemind's ``Matchmaking.look_for_group`` reads of its ``StepControl``: when to begin, when to give up,
    and the bytes to gather."""

    scheduled_time: float
    deadline: float
    data_for_gather: bytes

    def get_timeout(self) -> float:
        return max(0.0, self.deadline - get_dht_time())


class AveragingService:
    """Averages tensors with the peers of ``dht`` that run a service of the same ``prefix``.

    ``target_group_size`` / ``min_group_size``: the group matchmaking assembles (``aggregation="centered_clip"``
    needs at least 3: CenteredClip bounds a hostile member only where honest members outnumber it).
    ``matchmaking_time``: how long a peer gathers a group; ``request_timeout``: how long it waits for a leader's
    answer. ``sender_timeout`` / ``reducer_timeout``: how long a reducer waits for a sender's next part and a sender
    for a reducer's next result, before leaving it out. ``client_mode``: reduce nothing (peers that others cannot
    reach). ``on_group``: called in the service's thread with each assembled group (for logs and tests)."""

    def __init__(self, dht: Any, *, prefix: str, target_group_size: int | None = None, min_group_size: int = 2,
                 matchmaking_time: float = 5.0, request_timeout: float = 3.0, sender_timeout: float = 5.0,
                 reducer_timeout: float = 10.0, aggregation: str = "mean",
                 compression: CompressionBase = NoCompression(), part_size_bytes: int = 2**19,
                 client_mode: bool = False, on_group: Callable[[tuple[PeerID, ...]], None] | None = None,
                 start_timeout: float = 60.0):
        if not prefix or "." in prefix:
            raise ValueError(f"prefix must be a non-empty string without '.', got {prefix!r} (use the run id)")
        if aggregation not in AGGREGATES:
            raise ValueError(f"aggregation must be one of {tuple(AGGREGATES)}, got {aggregation!r}")
        if aggregation == "centered_clip" and min_group_size < MIN_CLIPPED_GROUP:
            raise ValueError(f"min_group_size must be at least {MIN_CLIPPED_GROUP} with aggregation='centered_clip' "
                             f"(got {min_group_size}): in a smaller group a hostile member pulls as hard as the rest")
        if min_group_size < 2 or (target_group_size is not None and target_group_size < min_group_size):
            raise ValueError(f"min_group_size must be >= 2 and target_group_size >= min_group_size, got "
                             f"{min_group_size} and {target_group_size}")
        if not reducer_timeout > sender_timeout:
            raise ValueError(f"reducer_timeout ({reducer_timeout}) must exceed sender_timeout ({sender_timeout})")
        self.dht, self.prefix, self.aggregation = dht, prefix, aggregation
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.matchmaking_time, self.request_timeout = matchmaking_time, request_timeout
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self.compression, self.part_size_bytes, self.client_mode = compression, part_size_bytes, client_mode
        self.on_group = on_group
        self.p2p: Any = None
        self.servicer = AllReduceService(self._matchmaking_for)
        self._matchmakings: dict[bytes, Matchmaking] = {}
        self._busy: asyncio.Lock | None = None
        self._event_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._event_loop.run_forever, name=f"collabopt-averaging-{prefix}",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._call(self._start(), start_timeout)
        except BaseException:
            self._stop_loop()
            raise

    # ---------------------------------------------------------------- the thread
    def _call(self, coroutine: Any, timeout: float | None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._event_loop).result(timeout)

    async def _start(self) -> None:
        self._busy = asyncio.Lock()
        self.p2p = await self.dht.replicate_p2p()
        await self.servicer.add_p2p_handlers(self.p2p, namespace=self.prefix)

    def _stop_loop(self) -> None:
        self._event_loop.call_soon_threadsafe(self._event_loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._event_loop.close()

    async def _stop(self) -> None:
        """Remove the handlers, close this thread's connection to the daemon (the DHT's replica: a DHT serves one
        service's loop), and end the loop's other tasks."""
        with contextlib.suppress(Exception):  # (the DHT may be gone already: nothing left to remove)
            await self.servicer.remove_p2p_handlers(self.p2p, namespace=self.prefix)
        with contextlib.suppress(Exception):
            await self.p2p.shutdown()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop serving this peer's rounds and end the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._call(self._stop(), 10)
        self._stop_loop()

    def __enter__(self) -> AveragingService:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- rounds
    def average(self, tensors: Sequence[torch.Tensor], weight: float = 1.0, timeout: float = 30.0,
                gather: Any = None) -> AveragingResult:
        """Average ``tensors`` (by ``weight``, e.g. this peer's sample count) with a group of peers, within
        ``timeout`` seconds for matchmaking and the round together (the round gets at least ``reducer_timeout``).
        ``gather``: any msgpack-able value every member of the group receives (``AveragingResult.gathered``)."""
        if self._closed:
            raise RuntimeError("this AveragingService is closed")
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("tensors must be a non-empty sequence of torch.Tensor")
        if not (isinstance(weight, (int, float)) and weight >= 0 and weight == weight and weight != float("inf")):
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        copies = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
        return self._call(self._average(copies, float(weight), float(timeout), gather),
                          timeout + self.reducer_timeout + 30)

    def _matchmaking_for(self, schema_hash: bytes) -> Matchmaking | None:
        return self._matchmakings.get(schema_hash)

    def _matchmaker(self, schema_hash: bytes) -> Matchmaking:
        if schema_hash not in self._matchmakings:
            self._matchmakings[schema_hash] = Matchmaking(
                self.p2p, schema_hash, self.dht, servicer_type=AllReduceService, prefix=self.prefix,
                target_group_size=self.target_group_size, min_group_size=self.min_group_size,
                min_matchmaking_time=self.matchmaking_time, request_timeout=self.request_timeout,
                client_mode=self.client_mode)
        return self._matchmakings[schema_hash]

    def _stub_for(self, peer: PeerID) -> Any:
        stub = AllReduceService.get_stub(self.p2p, peer, namespace=self.prefix)
        return MemberStub(stub, {"rpc_aggregate_part": self.reducer_timeout}, self.p2p.peer_id.to_bytes())

    async def _average(self, tensors: list[torch.Tensor], weight: float, timeout: float,
                       gather: Any) -> AveragingResult:
        assert self._busy is not None
        async with self._busy:  # (one round at a time: matchmaking looks for one group at a time)
            start, now = time.monotonic(), get_dht_time()
            search = _Search(scheduled_time=now + self.matchmaking_time, deadline=now + timeout,
                             data_for_gather=MSGPackSerializer.dumps([not self.client_mode, gather]))
            try:
                group = await self._matchmaker(compute_schema_hash(tensors)).look_for_group(search)
            except Exception as e:
                return AveragingResult(None, (), {}, None, f"matchmaking failed: {e!r}")
            if group is None:
                return AveragingResult(None, (), {}, None, f"no group assembled within {timeout:.1f} s")
            if self.on_group is not None:
                self.on_group(tuple(group.peer_ids))
            try:
                entries = [MSGPackSerializer.loads(data) for data in group.gathered]
                fractions = [1.0 if entry[0] else 0.0 for entry in entries]
                gathered = {peer: entry[1] for peer, entry in zip(group.peer_ids, entries, strict=True)}
            except Exception as e:  # (a member of another version, or a hostile one: no round with it)
                return AveragingResult(None, tuple(group.peer_ids), {}, None, f"unreadable gathered data: {e!r}")
            if not any(fractions):
                return AveragingResult(None, tuple(group.peer_ids), gathered, None, "every member is a client")
            round_ = AllReduceRound(
                group_id=group.group_id, members=group.peer_ids, me=group.peer_ids.index(self.p2p.peer_id),
                tensors=tensors, weight=weight, stub_for=self._stub_for, fractions=fractions,
                aggregate=AGGREGATES[self.aggregation], compression=self.compression,
                part_size_bytes=self.part_size_bytes, sender_timeout=self.sender_timeout,
                reducer_timeout=self.reducer_timeout)
            with self.servicer.registered(round_):
                deadline = max(start + timeout, time.monotonic() + self.reducer_timeout)
                outputs, evidence = await round_.run(deadline)
            return AveragingResult(outputs, tuple(group.peer_ids), gathered, evidence)
