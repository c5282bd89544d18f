"""The streams between the members of a round: each opens in time, and the side that reads last closes it first.

hivemind's p2p daemon (p2pd, go-libp2p 0.32) closes a libp2p stream in both directions when one side's unix socket
closes; the copy loop still reading the other direction then fails and resets the stream, racing the close. When the
reset wins, the other side's daemon drops what it had received and not yet handed over: an all-reduce stream whose
reducer closed first ended with its last results missing ("one part short", "sent 0 parts"), read by hivemind as a
normal end of stream. The side that has every byte it needs must close first. See docs/decisions.md, "Results lost
with no fault".

* :class:`MemberStub`: streams to another member open within their timeouts, and an all-reduce stream is closed by
  this peer, the sender, as soon as every result came; its first message says so (``peer_id``, which hivemind
  leaves empty).
* :func:`serve_until_the_sender_closes`: a reducer whose sender said so keeps its end open until the sender closes
  it (hivemind's senders and older collabopt's are answered as hivemind does).
* :func:`read_to_the_end`: a reducer that answers a sender before it read every part reads the rest, so that
  hivemind's handler sees the stream end; :class:`ShieldedReads` keeps a cancelled read from closing the stream
  before that.
* :func:`serve_until_the_caller_closes`: a leader's answers to a join request, whose caller reads a known number of
  messages and then closes: the leader's end stays open after its verdict until the caller closed. A verdict written
  just before the leader's end closed was lost in that race: the follower read the end of the stream instead of the
  group it was in, and the group's round waited for a member that never came. A served state's stream to a
  collabopt downloader, which reads the parts its first message counts, is served so too
  (:mod:`collabopt.engine.state_service`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

# How long a leader's end of a join request's stream stays open after its verdict, for the follower to close first
# (it closes as soon as it read the verdict; a follower gone meanwhile holds only this coroutine)
VERDICT_LINGER = 10.0


async def open_in_time(opening: Awaitable[Any], timeout: float, what: str) -> Any:
    """Await ``opening`` (a stream's opening) for at most ``timeout`` seconds, else raise ``asyncio.TimeoutError``.

    ``asyncio.wait``, not ``wait_for``: Python 3.11's ``wait_for`` returns the inner result when its caller is
    cancelled in the loop iteration the result lands in, and a round's cancel would be lost (docs/decisions.md,
    "A search that never ended")."""
    task = asyncio.ensure_future(opening)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        task.cancel()  # (no-op once done: a task takes any cancel that comes before it is done)
    if not done:
        raise asyncio.TimeoutError(f"{what}: the stream did not open within {timeout:.1f} s")
    return task.result()


class MemberStub:
    """A member's stub (hivemind's), whose streams open within ``timeouts`` (by RPC name), and whose all-reduce
    streams this peer closes as soon as every result came.

    hivemind 1.1.12 bounds the wait for a join request's answer and for each result chunk, not the opening of their
    streams: to a member whose link was cut, opening one waited for libp2p to give up, and matchmaking or the round
    until its deadline (docs/decisions.md, "A stream to a lost member that never opens")."""

    def __init__(self, stub: Any, timeouts: dict[str, float], sender_id: bytes, peer: Any = "a member"):
        self._member, self._timeouts, self._sender_id, self._peer_name = stub, timeouts, sender_id, peer

    def __getattr__(self, name: str) -> Any:
        if name == "rpc_aggregate_part":
            return self._aggregate_part
        method = getattr(self._member, name)
        if name not in self._timeouts:
            return method

        async def opened_in_time(*args: Any, **kwargs: Any) -> Any:
            return await self._opened(name, method(*args, **kwargs))

        return opened_in_time

    async def _opened(self, name: str, opening: Awaitable[Any]) -> Any:
        timeout = self._timeouts.get(name)
        return await (opening if timeout is None else open_in_time(opening, timeout, f"{name} to {self._peer_name}"))

    async def _aggregate_part(self, requests: AsyncIterator[Any], *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        sent = _CountedRequests(requests, self._sender_id)
        stream = await self._opened("rpc_aggregate_part", self._member.rpc_aggregate_part(sent, *args, **kwargs))
        return _results_until_complete(stream, sent)


class _CountedRequests:
    """A sender's parts on their way to a reducer: counted, the first one naming the sender (``peer_id``)."""

    def __init__(self, requests: AsyncIterator[Any], sender_id: bytes):
        self._requests, self._sender_id = requests, sender_id
        self.sent, self.exhausted = 0, False
        self._moved = asyncio.Event()  # set as a part is taken, or there are no more

    def __aiter__(self) -> _CountedRequests:
        return self

    async def __anext__(self) -> Any:
        try:
            message = await self._requests.__anext__()
        except StopAsyncIteration:
            self.exhausted = True
            raise
        finally:
            self._moved.set()
        if self.sent == 0:
            message.peer_id = self._sender_id
        self.sent += 1
        return message

    async def all_answered(self, answers: int) -> bool:
        """Whether ``answers`` answers are all there will be: waits while the part after them is not yet taken (the
        writing task takes the next part, or learns there is none, as it finishes sending one)."""
        while not self.exhausted and self.sent <= answers:
            self._moved.clear()
            await self._moved.wait()
        return self.exhausted and self.sent == answers


async def _results_until_complete(stream: Any, sent: _CountedRequests) -> AsyncIterator[Any]:
    """The reducer's results, one per part sent: once the last one came, this end closes (first)."""
    received = 0
    try:
        async for message in stream:
            yield message
            received += 1
            if received == sent.sent and await sent.all_answered(received):
                return
    finally:
        await stream.aclose()  # (closes this end of the stream: the unix socket to the daemon)


async def serve_until_the_caller_closes(messages: AsyncIterator[Any], linger: float) -> AsyncIterator[Any]:
    """A handler's ``messages`` to a caller that closes its end once it read the last one it expects (hivemind's
    follower reads its leader's answer and verdict, then closes); after them, keep this end open until the caller
    closed it (hivemind cancels the handler then), at most ``linger`` seconds. A handler cancelled meanwhile ends at
    once (hivemind's ``rpc_join_group`` swallows a cancel and returns: the linger would hold a closing service), and
    so does one that sent nothing (nothing can be lost, and its caller waits for the end of the stream)."""
    sent = 0
    async for message in messages:
        yield message
        sent += 1
    if not sent:
        return
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    await asyncio.sleep(linger)


async def serve_until_the_sender_closes(serve: Callable[[AsyncIterator[Any]], AsyncIterator[Any]],
                                        stream: AsyncIterator[Any], sender_id: bytes,
                                        linger: float) -> AsyncIterator[Any]:
    """A reducer's answers to one sender (``serve(stream)``, hivemind's handler); then, where the sender named itself
    in its first part and every part got its answer, keep this end open until the sender closes it (hivemind cancels
    the handler then), at most ``linger`` seconds."""
    parts, named, ended = 0, False, False

    async def watched() -> AsyncIterator[Any]:
        nonlocal parts, named, ended
        async for message in stream:
            named = named or (parts == 0 and message.peer_id == sender_id)
            parts += 1
            yield message
        ended = True

    answered = 0
    async for answer in serve(watched()):
        yield answer
        answered += 1
    if named and ended and answered == parts:
        await asyncio.sleep(linger)


class ShieldedReads:
    """A caller's ``stream`` (hivemind's), read one message at a time by whoever reads it now: a reader cancelled
    while it waits for the next message (a timeout, a slice that ended) leaves that read pending for the next reader,
    where the cancel would have closed hivemind's generator and no later reader could empty its queue
    (:func:`read_to_the_end`). One reader at a time: two at once would both get the same message."""

    def __init__(self, stream: AsyncIterator[Any]):
        self._stream, self._pending = stream, None

    def __aiter__(self) -> ShieldedReads:
        return self

    async def __anext__(self) -> Any:
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._next())
        pending = self._pending
        try:
            message = await asyncio.shield(pending)
        except asyncio.CancelledError:
            if pending.cancelled():  # (the read itself: else it stays, done or not, for the next reader)
                self._pending = None
            raise
        except BaseException:
            self._pending = None
            raise
        self._pending = None
        return message

    async def _next(self) -> Any:
        return await self._stream.__anext__()

    def cancel(self) -> None:
        """Cancel the pending read, if any (the handler's end)."""
        if self._pending is not None:
            self._pending.cancel()


async def read_to_the_end(stream: AsyncIterator[Any], within: float) -> None:
    """Read and drop what is left of a caller's ``stream`` until it ends or the caller closes it, at most ``within``
    seconds (a sender still sending after that holds hivemind's handler as before; one that closes ends it at once).

    A reducer that answers a sender before it read every part calls this (a group it never registered, a sender left
    out of the round or not in its group, a protocol violation): hivemind's stream handler stops reading its caller's
    messages while 5 wait unread, blocked putting the next in its queue, and so never saw the handler end. Its task
    and the stream stayed until garbage collection ("Task was destroyed but it is pending!", then "cannot reuse
    already awaited coroutine"), on a member its group's leader counted while it had left matchmaking."""
    async def drain() -> None:
        async for _ in stream:
            pass

    task = asyncio.ensure_future(drain())
    try:
        await asyncio.wait({task}, timeout=within)
    finally:
        task.cancel()
