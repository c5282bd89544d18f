"""The streams between the members of a round (collabopt.engine.streams): opened in time, closed by the side that
reads last. The daemon's race itself needs tens of thousands of streams to show (docs/decisions.md, "Results lost
with no fault"); here, the protocol on each side."""

from __future__ import annotations

import asyncio
import gc

import pytest
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine import streams

ME = b"sender-peer-id"


class Stream:
    """hivemind's stream of a reducer's results: one per part received, at most ``results``; then, with ``ends``, the
    end, else nothing more (a reducer that keeps its end open)."""

    def __init__(self, results: int, ends: bool = True):
        self.results, self.ends, self.closed = results, ends, False
        self.received: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        for _ in range(self.results):
            await self.received.get()
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)
        if not self.ends:
            await asyncio.sleep(3600)

    async def aclose(self):
        self.closed = True


class Stub:
    """A member's stub as hivemind's servicer builds it; its all-reduce stream opens after ``opens_after`` loop
    iterations (never, with None) and consumes the parts sent, as the p2p daemon's writing task does."""

    _peer = "member"

    def __init__(self, opens_after=0, stream=None):
        self.opens_after, self.stream, self.cancelled, self.sent = opens_after, stream, [], []

    async def rpc_aggregate_part(self, requests):
        try:
            if self.opens_after is None:
                await asyncio.sleep(3600)  # a member whose link was cut: the stream never opens
            for _ in range(self.opens_after):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.append(True)
            raise

        async def write():
            async for message in requests:
                self.sent.append(message)
                self.stream.received.put_nowait(message)

        if isinstance(self.stream, Stream):
            self.writing = asyncio.get_running_loop().create_task(write())
        return self.stream

    rpc_join_group = rpc_aggregate_part

    async def rpc_download_state(self, request):
        return "state"


async def parts(n: int):
    for _ in range(n):
        await asyncio.sleep(0)
        yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING)


def test_a_stream_that_does_not_open_fails_within_its_timeout():
    """A member whose link was cut: opening a stream to it waited for libp2p to give up (hivemind 1.1.12 bounds only
    the wait for each message), and matchmaking or the round until its deadline."""
    stub = Stub(opens_after=None)
    member = streams.MemberStub(stub, {"rpc_join_group": 0.2, "rpc_aggregate_part": 0.3}, ME)

    async def open_stream(method):
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await getattr(member, method)(parts(1))
        await asyncio.sleep(0)  # (the opening task takes its cancel)
        return loop.time() - start

    assert 0.15 < asyncio.run(open_stream("rpc_join_group")) < 1.0
    assert 0.25 < asyncio.run(open_stream("rpc_aggregate_part")) < 1.0
    assert stub.cancelled == [True, True]  # the opening is given up, not left running
    assert asyncio.run(member.rpc_download_state(None)) == "state"  # an RPC without a timeout is hivemind's own
    assert member.rpc_download_state == stub.rpc_download_state


@pytest.mark.parametrize("opens_after", range(5))
def test_a_caller_cancelled_as_its_stream_opens_is_cancelled(opens_after):
    """The caller's cancel (the round's, or matchmaking's) is not lost when the stream opens in the same loop
    iteration: Python 3.11's wait_for returned the stream instead (docs/decisions.md, "A search that never ended")."""
    member = streams.MemberStub(Stub(opens_after, "stream"), {"rpc_join_group": 5.0}, ME)

    async def cancel_as_it_opens():
        task = asyncio.create_task(member.rpc_join_group(None))
        for _ in range(opens_after + 1):
            await asyncio.sleep(0)
        if not task.cancel():
            return "opened before the cancel"
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(cancel_as_it_opens()) == "cancelled"
    assert asyncio.run(member.rpc_join_group(None)) == "stream"  # in time: hivemind's stream


@pytest.mark.parametrize("timeouts", [{}, {"rpc_aggregate_part": 5.0}])
def test_the_sender_names_itself_and_closes_its_stream_once_every_result_came(timeouts):
    """The reducer keeps its end open for a sender that names itself: the sender closes once the last result came,
    without waiting for the reducer's end of stream."""
    async def all_reduce():
        stub.stream = Stream(results=3, ends=False)
        stream = await member.rpc_aggregate_part(parts(3))
        return [message async for message in stream]

    stub = Stub()
    member = streams.MemberStub(stub, timeouts, ME)
    results = asyncio.run(asyncio.wait_for(all_reduce(), 5))
    assert len(results) == 3 and stub.stream.closed
    assert [message.peer_id for message in stub.sent] == [ME, b"", b""]  # the first part names the sender


def test_a_sender_whose_reducer_ends_early_reads_to_the_end():
    """A reducer that rejects the sender (one answer) or fails: the stream ends as hivemind's does."""
    stub = Stub()

    async def all_reduce():
        stub.stream = Stream(results=1, ends=True)
        stream = await streams.MemberStub(stub, {}, ME).rpc_aggregate_part(parts(3))
        return [message async for message in stream]

    assert len(asyncio.run(all_reduce())) == 1 and stub.stream.closed


def requests(n: int, sender: bytes = b""):
    async def messages():
        for index in range(n):
            await asyncio.sleep(0)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, peer_id=sender if index == 0
                                              else b"")
    return messages()


async def reducer(stream, answers=None):
    """hivemind's handler: one answer per part (or ``answers``, then it stops reading)."""
    answered = 0
    async for _ in stream:
        yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)
        answered += 1
        if answers is not None and answered == answers:
            return


@pytest.mark.parametrize("sender, answers, lingers", [
    (ME, None, True),  # a collabopt sender: the reducer waits for it to close
    (b"", None, False),  # hivemind's sender (or an older collabopt) reads to the end: answered as hivemind does
    (b"another-peer", None, False),  # a sender naming someone else is not taken at its word
    (ME, 1, False),  # the reducer stopped early (a rejection): nothing to wait for
])
def test_a_reducer_keeps_its_end_open_only_for_a_sender_that_closes_its_own(sender, answers, lingers):
    async def serve():
        loop = asyncio.get_running_loop()
        start = loop.time()
        answered = [answer async for answer in streams.serve_until_the_sender_closes(
            lambda stream: reducer(stream, answers), requests(3, sender), ME, linger=0.3)]
        return len(answered), loop.time() - start

    answered, took = asyncio.run(serve())
    assert answered == (answers or 3)
    assert (took > 0.25) == lingers, took


def test_a_reducer_stops_lingering_when_the_sender_closes():
    """hivemind cancels the handler when the sender's end closes: the reducer's end closes then, not after linger."""
    async def serve():
        answers = streams.serve_until_the_sender_closes(reducer, requests(2, ME), ME, linger=3600)
        got = [await answers.__anext__(), await answers.__anext__()]
        lingering = asyncio.ensure_future(answers.__anext__())
        await asyncio.sleep(0.05)
        assert not lingering.done()  # keeping its end open
        lingering.cancel()  # the sender closed
        with pytest.raises(asyncio.CancelledError):
            await lingering
        return got

    assert len(asyncio.run(asyncio.wait_for(serve(), 5))) == 2


def test_collabopts_all_reduce_handler_is_a_streaming_handler():
    """hivemind tells a streaming handler by its annotations (typing's AsyncIterator): with collections.abc's, the
    handler would be registered as unary and no round would run."""
    from hivemind.optim.grad_averager import GradientAverager

    from collabopt.engine.allreduce import AllReduceService

    def handler(cls):
        cls._collect_rpc_handlers()
        found = next(h for h in cls._rpc_handlers if h.method_name == "rpc_aggregate_part")
        return found.stream_input, found.stream_output

    assert handler(AllReduceService) == handler(GradientAverager) == (True, True)


def test_a_leader_keeps_its_join_stream_open_until_the_follower_closed():
    """A leader's verdict is the last message of its join stream; its end stays open until the follower read it and
    closed (linger, else the daemon's close race can lose the verdict), and no longer."""
    async def serve():
        answers = streams.serve_until_the_caller_closes(verdicts(), linger=3600)
        got = [await answers.__anext__(), await answers.__anext__()]
        lingering = asyncio.ensure_future(answers.__anext__())
        await asyncio.sleep(0.05)
        assert not lingering.done()
        lingering.cancel()  # the follower closed its end: hivemind cancels the handler
        with pytest.raises(asyncio.CancelledError):
            await lingering
        return got

    assert [m.code for m in asyncio.run(asyncio.wait_for(serve(), 5))] == [averaging_pb2.ACCEPTED,
                                                                          averaging_pb2.BEGIN_ALLREDUCE]
    quick = asyncio.run(_list(streams.serve_until_the_caller_closes(verdicts(), linger=0.01)))
    assert len(quick) == 2  # a follower that never closes: the leader's end closes after linger


def test_a_handler_that_sent_nothing_does_not_linger():
    """A declined download sends nothing: its caller reads the end of the stream, which must come at once."""
    async def nothing():
        return
        yield

    assert asyncio.run(asyncio.wait_for(_list(streams.serve_until_the_caller_closes(nothing(), linger=3600)), 2)) == []


def test_a_leader_cancelled_before_its_verdict_does_not_linger():
    """hivemind's leader handler returns quietly when cancelled (a closing service cancels it): the wrapper must not
    then keep the task alive for the linger."""
    async def swallowing():
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
        try:
            await asyncio.sleep(3600)  # waiting for the group
        except asyncio.CancelledError:
            return  # as hivemind's rpc_join_group does

    async def serve():
        async def handler():
            async for _ in streams.serve_until_the_caller_closes(swallowing(), linger=3600):
                pass

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0.05)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        return task in done and task.cancelled()

    assert asyncio.run(serve())


async def verdicts():
    yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
    yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE, group_id=b"group")


async def _list(iterable):
    return [message async for message in iterable]


@pytest.mark.parametrize("service", ["allreduce", "gather"])
def test_both_services_end_a_join_stream_when_the_follower_closes_it_over_real_daemons(service):
    """Over two p2p daemons: the follower reads the leader's answer and verdict, and the leader's handler is still
    open until the follower closes its end; then it ends at once (hivemind cancels it)."""
    from hivemind.p2p import P2P

    from collabopt.engine.allreduce import AllReduceService
    from collabopt.engine.gather_round import ExchangeServicer

    class Matchmaking:
        async def rpc_join_group(self, request, context):
            async for message in verdicts():
                yield message

    servicer = (AllReduceService if service == "allreduce" else ExchangeServicer)(lambda schema_hash: Matchmaking())
    handler, ended = servicer.rpc_join_group, []

    async def observed(request, context):  # (the handler that hivemind registers, watched)
        try:
            async for message in handler(request, context):
                yield message
            ended.append("returned")
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    servicer.rpc_join_group = observed

    async def run():
        leader = await P2P.create()
        follower = await P2P.create(initial_peers=await leader.get_visible_maddrs())
        try:
            await servicer.add_p2p_handlers(leader, namespace="t")
            stub = type(servicer).get_stub(follower, leader.peer_id, namespace="t")
            stream = await stub.rpc_join_group(averaging_pb2.JoinRequest(schema_hash=b"schema"))
            codes = [(await stream.__anext__()).code, (await stream.__anext__()).code]
            await asyncio.sleep(0.3)
            still_open = list(ended)
            await stream.aclose()
            for _ in range(100):
                if ended:
                    break
                await asyncio.sleep(0.02)
            return codes, still_open, list(ended)
        finally:
            await follower.shutdown()
            await leader.shutdown()

    codes, still_open, after_close = asyncio.run(asyncio.wait_for(run(), 30))
    assert codes == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE]
    assert still_open == []  # the leader's end did not close after its verdict
    assert after_close == ["cancelled"]  # it closed as the follower closed


def _hivemind_handlers_left() -> list:
    """hivemind's stream handler tasks still running on this event loop."""
    return [task for task in asyncio.all_tasks()
            if getattr(task.get_coro(), "__qualname__", "") == "ControlClient._handler"]


async def _first_answer_then_close(answers) -> tuple[int, int]:
    """Read a reducer's first answer and close the stream; then wait up to 10 s for hivemind's handler tasks to end.
    Returns the answer's code and the number of handler tasks left."""
    code = MSGPackSerializer.loads((await answers.__anext__()).metadata)[0]
    await answers.aclose()
    for _ in range(500):
        if not _hivemind_handlers_left():
            break
        await asyncio.sleep(0.02)
    return code, len(_hivemind_handlers_left())


def _run_counting_handlers(coroutine):
    """``asyncio.run`` with the garbage collector off: a handler task left waiting must not be collected before it is
    counted."""
    gc.disable()
    try:
        return asyncio.run(asyncio.wait_for(coroutine, 30))
    finally:
        gc.enable()


def test_a_reducer_that_answers_bad_group_id_reads_the_senders_parts_to_the_end_over_real_daemons(monkeypatch):
    """Over two p2p daemons: parts for a group the reducer never registered are answered BAD_GROUP_ID, and once the
    sender closes its stream no handler task of hivemind's is left. hivemind's handler stops reading a caller's
    messages while 5 wait unread; one whose handler ended unread waited forever (then "Task was destroyed but it is
    pending!" at garbage collection)."""

    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.p2p import P2P

    from collabopt.engine import allreduce

    monkeypatch.setattr(allreduce, "REGISTRATION_WAIT", 0.3)

    async def parts(end: bool):
        for _ in range(20):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"no such group",
                                              tensor_part=serialize_torch_tensor(torch.zeros(1000)), weight=1.0)
        if not end:  # (the sender closes its stream mid-way, once it read its answer)
            await asyncio.sleep(3600)

    async def run(end: bool):
        reducer = await P2P.create()
        sender = await P2P.create(initial_peers=await reducer.get_visible_maddrs())
        try:
            await allreduce.AllReduceService(lambda schema_hash: None).add_p2p_handlers(reducer, namespace="t")
            stub = allreduce.AllReduceService.get_stub(sender, reducer.peer_id, namespace="t")
            return await _first_answer_then_close(await stub.rpc_aggregate_part(parts(end)))
        finally:
            await sender.shutdown()
            await reducer.shutdown()

    for end in (True, False):
        code, left = _run_counting_handlers(run(end))
        assert code == averaging_pb2.BAD_GROUP_ID
        assert left == 0, f"{left} of hivemind's handler tasks left (the stream {'ended' if end else 'was closed'})"


@pytest.mark.parametrize("shielded", [True, False])
def test_a_read_cancelled_while_it_waits_leaves_the_stream_to_the_next_reader_when_shielded(shielded):
    """A reader cancelled while it waits (a sender's timeout, a slice that ended) neither loses the next message nor
    closes the caller's stream: the next reader reads it to its end, so hivemind's handler, whose queue would
    otherwise stay full, sees the end. Unshielded (the control), the cancel closes hivemind's generator: nothing more
    is read and its queue stays full."""
    async def run():
        queue: asyncio.Queue = asyncio.Queue()

        async def hivemind_stream():  # (hivemind's _read_stream: its handler's queue, None at the end)
            while (message := await queue.get()) is not None:
                yield message

        source = streams.ShieldedReads(hivemind_stream()) if shielded else hivemind_stream()
        reader = asyncio.ensure_future(source.__anext__())
        await asyncio.sleep(0.01)
        reader.cancel()
        await asyncio.sleep(0.01)
        for message in ("a", "b", None):
            queue.put_nowait(message)
        return reader.cancelled(), [message async for message in source], queue.qsize()

    cancelled, rest, unread = asyncio.run(run())
    assert cancelled
    assert (rest, unread) == ((["a", "b"], 0) if shielded else ([], 3))


def test_a_reducer_that_answers_a_sender_not_in_its_group_reads_the_senders_parts_to_the_end_over_real_daemons(
        monkeypatch):
    """Over two p2p daemons: a sender that is not a member of the registered group is answered PROTOCOL_VIOLATION
    before its parts are read; they had filled hivemind's queue while the group registered, and once the sender
    closes its stream no handler task of hivemind's is left (before, one waited forever)."""

    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.p2p import P2P, PeerID

    from collabopt.engine import allreduce

    monkeypatch.setattr(allreduce, "REGISTRATION_WAIT", 5.0)

    async def parts():
        for _ in range(20):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"group",
                                              tensor_part=serialize_torch_tensor(torch.zeros(1000)), weight=1.0)

    async def run():
        reducer = await P2P.create()
        sender = await P2P.create(initial_peers=await reducer.get_visible_maddrs())
        try:
            service = allreduce.AllReduceService(lambda schema_hash: None)
            await service.add_p2p_handlers(reducer, namespace="t")
            stub = allreduce.AllReduceService.get_stub(sender, reducer.peer_id, namespace="t")
            answers = await stub.rpc_aggregate_part(parts())
            await asyncio.sleep(0.5)  # (every part sent; hivemind's handler holds 5 and waits to queue the next)
            other = PeerID(b"another member")
            round_ = allreduce.AllReduceRound(group_id=b"group", members=[reducer.peer_id, other], me=0,
                                              tensors=[torch.zeros(20_000)], weight=1.0, stub_for=lambda peer: None,
                                              fractions=[1.0, 0.0], part_size_bytes=4000)
            with service.registered(round_):
                return await _first_answer_then_close(answers)
        finally:
            await sender.shutdown()
            await reducer.shutdown()

    code, left = _run_counting_handlers(run())
    assert code == averaging_pb2.PROTOCOL_VIOLATION
    assert left == 0, f"{left} of hivemind's handler tasks left"
