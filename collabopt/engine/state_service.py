"""collabopt's state service: it serves this peer's state to the peers that download it, answers their download
challenges, and fetches other peers' states, from a thread of the calling process with its own asyncio loop.

Rules, and why:

* It is composed of hivemind's transport, not derived from its averagers: the DHT's libp2p daemon (a connection of
  its own, :func:`~collabopt.engine.p2p.own_replica`), a ``ServicerBase`` handler (:class:`StateServicer`),
  hivemind's compression, serializer and
  streaming. What serving and downloading do is readable here and in :mod:`collabopt.engine.downloads`.
* The download RPC keeps hivemind's name (``<prefix>::TrainingStateAverager.rpc_download_state``) and messages,
  and the service advertises the state in hivemind's ``<prefix>.all_averagers`` record: plain hivemind peers and
  older collabopt peers download from it, and it from them.
* collabopt's downloaders ask for the same messages under collabopt's name
  (``<prefix>::collabopt.StateService.rpc_download_counted_state``), whose stream the downloader closes first: it
  reads the parts the first message counts (``tensor_count`` tensors, each of its first part's ``chunks``), closes,
  and the server's end stays open until then. A server that closed first could lose its last parts in the daemon
  (:mod:`collabopt.engine.streams`; the download failed, "the stream ended after 15 of the 16 tensors"). A peer
  without it (plain hivemind, older collabopt) is asked under hivemind's name.
* What is served is the state averager's (:meth:`~collabopt.engine.state.ConsistentStateAverager.served_state`: a
  copy whose epoch and tensors belong together, declined during a boundary), advertised with its epoch as priority,
  and nothing while its ``allow_state_sharing`` is off. With a swarm
  key only members get it (:func:`~collabopt.engine.member_checks.download_refusal`).
* A stream to a peer opens within the chunk timeout and each chunk comes within it: a download from a lost peer fails
  in seconds, and the next peer is tried (:mod:`collabopt.engine.downloads`).
* A download's bytes are decoded in the executor, never on the service's loop (which serves this peer's state and
  challenge answers meanwhile); one source may send at most :func:`received_limit` bytes, and a state of another form
  than a state's (:func:`state_problem`) is no state: both are that source's failure, not the download's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import typing
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, P2PDaemonError, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.engine.download_challenge import ChallengeAnswers, ask_projections, challenge_protocol
from collabopt.engine.member_checks import download_refusal, store_member_token
from collabopt.engine.p2p import own_replica
from collabopt.engine.replicas import RIDE_ALONG, ReplicaRecords
from collabopt.engine.service_thread import STOP_TIMEOUT, ServiceThread
from collabopt.engine.streams import open_in_time, serve_until_the_caller_closes
from collabopt.membership import swarm_key_of

logger = logging.getLogger(__name__)

HIVEMIND_STATE_SERVICER = "TrainingStateAverager"  # the class name hivemind's state averagers serve downloads under
COLLABOPT_STATE_SERVICER = "collabopt.StateService"  # the name collabopt's counted download is served under
# How long a served state's stream stays open after its last part for the downloader to close first (it closes as
# soon as it has every part; a downloader gone meanwhile holds only this coroutine)
STATE_LINGER = 10.0


DECLARE_PERIOD = 30.0  # seconds between two advertisements of this peer's state (hivemind's declare_state_period)
RECEIVED_SHARE = 1.5  # of this peer's own state's bytes, the most one source may send (and RECEIVED_MARGIN more)
RECEIVED_MARGIN = 1 << 20  # bytes: metadata and message framing


def received_limit(averager: Any) -> int:
    """The most bytes one download may receive: :data:`RECEIVED_SHARE` times this peer's own state (parameters,
    extra tensors, optimizer statistics) plus :data:`RECEIVED_MARGIN`. A source sending more is that source's
    failure, before it fills this peer's memory."""
    optimizer = averager.optimizer
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += list(getattr(averager, "extra_tensors", ()))
    tensors += [value for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)]
    return int(RECEIVED_SHARE * sum(t.numel() * t.element_size() for t in tensors)) + RECEIVED_MARGIN


def state_problem(metadata: Any, tensors: Any) -> str | None:
    """Why a downloaded (metadata, tensors) is not of a state's form, or None: the metadata is a dict with an ``int``
    epoch (not below 0) and optimizer metadata as a list of dicts, the tensors a list of tensors (hivemind's form).
    A malformed state (a faulty or hostile peer) is its source's failure: the next one is tried."""
    if not isinstance(metadata, dict):
        return f"its metadata is a {type(metadata).__name__}, not a dict"
    epoch = metadata.get("epoch")
    if type(epoch) is not int or epoch < 0:
        return f"its epoch is {epoch!r}, not an int of at least 0"
    optimizer_metadata = metadata.get("optimizer_metadata")
    if not isinstance(optimizer_metadata, list) or not all(isinstance(item, dict) for item in optimizer_metadata):
        return "its optimizer metadata is not a list of dicts"
    if not isinstance(tensors, list) or not all(isinstance(t, torch.Tensor) for t in tensors):
        return "its tensors are not a list of tensors"
    return None


def _tensor_count(metadata: bytes) -> int | None:
    """(the executor) How many tensors a download's first message says follow, or None (a plain hivemind peer)."""
    loaded = MSGPackSerializer.loads(metadata)
    count = loaded.get("tensor_count") if isinstance(loaded, dict) else None
    return count if type(count) is int else None


def _all_parts(groups: list[list[Any]], count: int | None) -> bool:
    """Whether ``groups`` (each tensor's parts so far) hold all ``count`` tensors, each with the parts its first part
    counts (hivemind's ``chunks``; an empty tensor comes as one part counting none)."""
    return bool(groups) and len(groups) == count and len(groups[-1]) >= max(groups[-1][0].chunks, 1)


def _decode(metadata: bytes, groups: list[list[Any]]) -> tuple[Any, list[torch.Tensor]]:
    """(the executor) The metadata and tensors of a download's messages (``groups``: each tensor's parts)."""
    return MSGPackSerializer.loads(metadata), [deserialize_torch_tensor(combine_from_streaming(parts))
                                               for parts in groups]


class StateServicer(ServicerBase):
    """The download RPCs (see the module); ``serve(caller)`` yields a download's messages: under hivemind's name the
    stream ends after the last one (hivemind's downloaders read to its end); under collabopt's it stays open until
    the downloader, which knows the last one, closed it."""

    def __init__(self, serve: Callable[[PeerID, float], typing.AsyncIterator[averaging_pb2.DownloadData]]):
        self._serve = serve  # (the caller, and how long the stream stays open after the last message for it)

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        async for message in self._serve(context.remote_id, 0.0):
            yield message

    async def rpc_download_counted_state(self, request: averaging_pb2.DownloadRequest,
                                         context: P2PContext) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        async for message in self._serve(context.remote_id, STATE_LINGER):
            yield message

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        owner = HIVEMIND_STATE_SERVICER if method_name == "rpc_download_state" else COLLABOPT_STATE_SERVICER
        name = f"{owner}.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"


class StateService(ServiceThread):
    """Serves the state of ``averager`` (a :class:`~collabopt.engine.state.ConsistentStateAverager`) on ``dht``'s
    daemon, answers download challenges where ``averager.verify_downloads`` is set, and fetches others' states
    (:meth:`fetch`). ``declines``: while it returns True nothing is served (a peer downloading its first state)."""

    def __init__(self, dht: Any, averager: Any, *, start_timeout: float = 60.0):
        self.dht, self.averager, self.prefix = dht, averager, averager.prefix
        self.records = ReplicaRecords(dht)  # (the declarations: on their key's replicas, no crawl at every store)
        self.chunk_timeout = float(averager.chunk_timeout)
        self.declines: Callable[[], bool] = lambda: False
        self.serves = not averager.client_mode  # (a client-mode peer cannot be reached: it registers no handler)
        self.open_downloads = 0  # streams of this peer's state open now (only the service's loop changes it)
        self.p2p: Any = None
        self.servicer = StateServicer(self._serve)
        self.challenges = ChallengeAnswers(averager.challenge_state, lambda: averager.allow_state_sharing,
                                           self._refusal) if averager.verify_downloads else None
        self._start_thread(f"collabopt-state-{self.prefix}", start_timeout)

    # ---------------------------------------------------------------- the thread
    def _call(self, coroutine: Any, timeout: float | None) -> Any:
        """Run ``coroutine`` on the service's loop and wait for it; SIGTERM (``collabopt.Terminated``) or Ctrl+C
        in the wait cancels it and goes on at once."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._event_loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    async def _start(self) -> None:
        self.p2p = await own_replica(self.dht)
        if self.serves:
            await self.servicer.add_p2p_handlers(self.p2p, namespace=self.prefix)
            if self.challenges is not None:
                await self.p2p.add_binary_stream_handler(challenge_protocol(self.prefix), self.challenges.serve)
            self._sharing_changed = asyncio.Event()
            self.averager.sharing_changed = self._declare_soon
            self._declaring = asyncio.create_task(self._declare_periodically())

    def _declare_soon(self) -> None:
        """(any thread) Advertise this peer's state anew at once: its sharing or priority changed."""
        if not self._closed:
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile: nothing left to advertise)
                self._event_loop.call_soon_threadsafe(self._sharing_changed.set)

    async def _declare_periodically(self) -> None:
        """Advertise this peer's state in hivemind's ``<prefix>.all_averagers`` record (its priority; None once it
        stops sharing), every :data:`DECLARE_PERIOD` seconds and at once when either changes: downloaders, plain
        hivemind peers included, find the peers to ask there. A renewal of the same declaration may wait
        :data:`~collabopt.engine.replicas.RIDE_ALONG` seconds to leave with another store of this peer; each lives
        that much longer than its period."""
        key, me, shared, last = f"{self.prefix}.all_averagers", self.p2p.peer_id.to_bytes(), False, None
        while True:
            expiration = get_dht_time() + DECLARE_PERIOD + RIDE_ALONG
            sharing = self.averager.allow_state_sharing
            if sharing or shared:
                value = self.averager.state_sharing_priority if sharing else None
                store = self.records.store(key, subkey=me, value=value, expiration_time=expiration,
                                           return_future=True, may_wait=RIDE_ALONG if (value,) == last else 0.0)
                asyncio.ensure_future(asyncio.wait_for(store, DECLARE_PERIOD))
                shared, last = sharing, (value,)
            self._sharing_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._sharing_changed.wait(), DECLARE_PERIOD)

    async def _stop(self) -> None:
        if self.serves:
            with contextlib.suppress(Exception):  # (the DHT may be gone already: nothing left to remove)
                await self.servicer.remove_p2p_handlers(self.p2p, namespace=self.prefix)
        if self.serves and self.challenges is not None:
            with contextlib.suppress(Exception):
                await self.p2p.remove_binary_stream_handler(challenge_protocol(self.prefix))
        await self._leave(self.p2p)

    # ---------------------------------------------------------------- serving
    async def _refusal(self, caller: bytes) -> str | None:
        """With a swarm key, why ``caller`` gets neither this peer's state nor a challenge's answer."""
        key = swarm_key_of(self.dht)
        return None if key is None else await download_refusal(self.dht, self.prefix, key, caller)

    async def _serve(self, caller: PeerID, linger: float = 0.0) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """The messages of one download, counted in :attr:`open_downloads` while its stream is open (a finished peer
        serving its final state stays while one is, :mod:`~collabopt.engine.final_state`); with ``linger``, it stays
        open after the last one until the downloader closed it, at most ``linger`` seconds."""
        self.open_downloads += 1
        try:
            messages = self._messages(caller)
            async for message in serve_until_the_caller_closes(messages, linger) if linger else messages:
                yield message
        finally:
            self.open_downloads -= 1

    async def _messages(self, caller: PeerID) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """The messages of one download: nothing (the downloader tries its next peer) where this peer shares no
        state, refuses the caller, declines now, or its boundary outlasts the wait
        (:meth:`~collabopt.engine.state.ConsistentStateAverager.served_state`)."""
        if not self.averager.allow_state_sharing:
            return
        refusal = await self._refusal(caller.to_bytes())
        if refusal is not None:
            logger.warning(f"collabopt: refused to send this peer's state to {caller}: {refusal}")
            return
        if self.declines():
            logger.debug("collabopt: a download came while this peer downloads its first state: declined")
            return
        loop = asyncio.get_running_loop()
        metadata, tensors, infos = await loop.run_in_executor(None, self.averager.served_state)
        if not tensors:
            return
        if infos is None:
            infos = [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
        if not isinstance(metadata, dict):  # (served_state's is one: say how many tensors follow, below)
            logger.warning(f"collabopt: this peer's state metadata is a {type(metadata).__name__}: not served")
            return
        # how many tensors follow: a stream that ends early is told from a refusal, and the downloader closes first
        metadata = dict(metadata, tensor_count=len(tensors))
        serialized: bytes | None = MSGPackSerializer.dumps(metadata)
        compression = self.averager.state_compression
        for tensor, info in zip(tensors, infos, strict=True):
            compressed = await loop.run_in_executor(None, lambda t=tensor, i=info: compression.compress(
                t, i, allow_inplace=False))
            for part in split_for_streaming(compressed):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=serialized or b"")
                serialized = None

    # ---------------------------------------------------------------- downloading
    def serving_peers(self) -> dict[str, float]:
        """The peers that serve their state, with the priority they advertise (base58 ids)."""
        found = self.records.get(f"{self.prefix}.all_averagers", latest=True)
        peers: dict[str, float] = {}
        for subkey, info in (found.value.items() if found is not None and isinstance(found.value, dict) else ()):
            try:
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int)):
                    peers[PeerID(subkey).to_base58()] = float(info.value)
            except Exception:  # (a malformed subkey: hivemind skips it too)
                continue
        return peers

    def announce_download(self) -> None:
        """Before downloading: with a swarm key, store this peer's member token for the members it asks."""
        store_member_token(self.dht, self.prefix)

    def fetch(self, peer: str, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """The state ``peer`` (base58) sends: its metadata and tensors; None where it sent none (it declined) or
        one of another form than a state's (:func:`state_problem`, logged). Raises where the stream failed, sent
        more than :func:`received_limit` bytes, or ``timeout`` seconds passed."""
        if self._closed:
            raise RuntimeError("this StateService is closed")
        limit = received_limit(self.averager)
        return self._call(asyncio.wait_for(self._fetch(PeerID.from_base58(peer), limit), timeout),
                          timeout + STOP_TIMEOUT)

    async def _fetch(self, peer: PeerID, limit: int) -> tuple[dict, list[torch.Tensor]] | None:
        """(the service's loop, which also serves this peer's state and challenge answers) Receives the stream's
        bytes only, and closes it once every part it counts came: decoding them runs in the executor."""
        stream = await self._open_download(peer)
        metadata, groups, received, count = b"", [], 0, None
        try:
            async for message in aiter_with_timeout(stream, timeout=self.chunk_timeout):
                received += len(message.tensor_part.buffer) + len(message.metadata)
                if received > limit:
                    raise ValueError(f"{peer} sent over {limit} bytes, more than a state of this peer's model takes")
                if message.metadata and not metadata:
                    metadata = message.metadata
                    count = await asyncio.get_running_loop().run_in_executor(None, _tensor_count, metadata)
                if message.tensor_part.dtype or not groups:  # (a dtype starts the next tensor)
                    groups.append([])
                groups[-1].append(message.tensor_part)
                if _all_parts(groups, count):
                    break
        finally:
            await stream.aclose()  # (this end first, once every part came: the server's end waits for it)
        if not metadata:
            return None
        loaded = await asyncio.get_running_loop().run_in_executor(None, _decode, metadata, groups)
        if count is not None and len(loaded[1]) < count:  # (the daemon's close race: the peer is not at fault)
            raise ConnectionError(f"the stream ended after {len(loaded[1])} of the {count} tensors {peer} sent")
        problem = state_problem(*loaded)
        if problem is not None:
            logger.warning(f"collabopt: the state {peer} sent is not one ({problem}): trying the next peer")
            return None
        return loaded

    async def _open_download(self, peer: PeerID) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """The stream of ``peer``'s state: collabopt's counted download, or hivemind's where ``peer`` serves none (a
        plain hivemind peer or an older collabopt one: its daemon knows no such protocol)."""
        stub, what = StateServicer.get_stub(self.p2p, peer, namespace=self.prefix), f"downloading the state of {peer}"
        try:
            return await open_in_time(stub.rpc_download_counted_state(averaging_pb2.DownloadRequest()),
                                      self.chunk_timeout, what)
        except P2PDaemonError as error:
            if "not supported" not in str(error):  # (go-multistream: "protocol(s) not supported")
                raise
        return await open_in_time(stub.rpc_download_state(averaging_pb2.DownloadRequest()), self.chunk_timeout, what)

    def ask_projections(self, peers: list[str], seed: int, epoch: int, timeout: float) -> Future:
        """A future of the download challenge's answers of ``peers``
        (:func:`~collabopt.engine.download_challenge.ask_projections`), asked at once."""
        return asyncio.run_coroutine_threadsafe(
            ask_projections(self.p2p, challenge_protocol(self.prefix), peers, seed, epoch, timeout), self._event_loop)


__all__ = ["HIVEMIND_STATE_SERVICER", "StateService", "StateServicer", "received_limit", "state_problem"]
