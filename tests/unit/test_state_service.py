"""collabopt's state service (collabopt/engine/state_service.py) without a swarm: a wait for the service's loop ends
on SIGTERM (collabopt.Terminated) or Ctrl+C and cancels what it waited for. Serving and downloading between two
peers: tests/swarm/test_state_serving.py."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from collabopt import Terminated
from collabopt.engine.state_service import StateService


@pytest.mark.parametrize("interrupt", [Terminated, KeyboardInterrupt])
def test_an_interrupt_ends_a_wait_on_the_service_and_cancels_it(interrupt):
    service = StateService.__new__(StateService)
    service._event_loop = asyncio.new_event_loop()
    service._thread = threading.Thread(target=service._event_loop.run_forever, daemon=True)
    service._thread.start()
    cancelled = threading.Event()

    async def a_long_download():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def on_alarm(signum, frame):
        raise interrupt()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(interrupt):
            service._call(a_long_download(), 60)
        assert cancelled.wait(5.0), "the coroutine the wait was for goes on"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        service._stop_loop()


def _state_messages(tensors, sent, part_bytes=64):
    """A served state's messages: its metadata (saying ``len(tensors)`` follow) and the parts of the first ``sent``,
    ``part_bytes`` each."""
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import averaging_pb2
    from hivemind.utils.serializer import MSGPackSerializer
    from hivemind.utils.streaming import split_for_streaming

    metadata = MSGPackSerializer.dumps(dict(epoch=3, group_bits="", optimizer_metadata=[],
                                            tensor_count=len(tensors)))
    return [averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
            for tensor in tensors[:sent] for part in split_for_streaming(serialize_torch_tensor(tensor), part_bytes)]


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "hivemind's"])
@pytest.mark.parametrize("sent, error", [(3, None), (2, ConnectionError)])
def test_a_download_reads_the_parts_counted_closes_first_and_fails_as_the_stream_where_it_ends_early(
        monkeypatch, counted, sent, error):
    """A server says how many tensors follow (each tensor's first part how many parts it has): the downloader closes
    its end once they all came, while the server's (collabopt's counted download) waits for it. A stream that ends
    before the last one (hivemind's daemon can drop what its other end closed over) is a failed download, tried
    again elsewhere, not a state to refuse. A peer without the counted download (plain hivemind: its daemon knows no
    such protocol) is asked under hivemind's name."""
    import torch
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    from collabopt.engine import state_service

    tensors = [torch.arange(40.0), torch.ones(2, 3), torch.zeros(0)]
    messages, closed, asked = _state_messages(tensors, sent), [], []

    async def stream(lingers):
        try:
            for message in messages:
                yield message
            if lingers:
                await asyncio.sleep(3600)  # (until the downloader closes)
        finally:
            closed.append(True)

    class Stub:
        async def rpc_download_counted_state(self, request):
            asked.append("counted")
            if not counted:
                raise ControlFailure("Connect failed. msg=failed to negotiate protocol: protocols not supported: "
                                     "[run::collabopt.StateService.rpc_download_counted_state]")
            return stream(lingers=sent == len(tensors))

        async def rpc_download_state(self, request):
            asked.append("hivemind's")
            return stream(lingers=False)

    monkeypatch.setattr(state_service.StateServicer, "get_stub", classmethod(lambda cls, *a, **k: Stub()))
    service = object.__new__(StateService)
    service.p2p, service.prefix, service.chunk_timeout = None, "run", 5.0
    if error is None:
        loaded_metadata, loaded = asyncio.run(asyncio.wait_for(service._fetch("peer", 10**6), 2.0))
        assert loaded_metadata["epoch"] == 3 and all(torch.equal(a, b) for a, b in zip(loaded, tensors, strict=True))
    else:
        with pytest.raises(error, match="ended after 2 of the 3 tensors"):
            asyncio.run(service._fetch("peer", 10**6))
    assert closed == [True] and asked == (["counted"] if counted else ["counted", "hivemind's"])


def test_a_counted_download_between_two_daemons_gets_every_part_and_ends_the_servers_wait():
    """Two libp2p daemons: collabopt's counted download, 200 times in a row, receives every part, and the server's
    end, which would stay open STATE_LINGER (10 s) after its last part, is closed as the downloader closes (its
    handler is cancelled; open_downloads is back to 0): a downloader that waited for the end of the stream would
    time out here. (Served under hivemind's name, a stream's last parts were lost now and then, the server closing
    first: about 2 of 1000 such downloads on this machine, so these 200 catch that only by chance.) From a peer
    serving under hivemind's name only, the download is asked there."""
    import torch
    from hivemind.p2p import P2P
    from hivemind.proto import averaging_pb2

    from collabopt.engine.state_service import StateServicer
    from collabopt.engine.streams import serve_until_the_caller_closes

    tensors = [torch.randn(100_000) for _ in range(4)]
    messages = _state_messages(tensors, len(tensors), part_bytes=1 << 16)  # (hivemind's parts)
    serving = StateService.__new__(StateService)
    serving.open_downloads = 0

    async def served(caller):
        for message in messages:
            yield message

    serving._messages = served

    async def go():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[str(m) for m in await server.get_visible_maddrs()])
        try:
            await StateServicer(serving._serve).add_p2p_handlers(server, namespace="run")
            downloading = object.__new__(StateService)
            downloading.p2p, downloading.prefix, downloading.chunk_timeout = client, "run", 5.0
            for _ in range(200):
                _, loaded = await asyncio.wait_for(downloading._fetch(server.peer_id, 10**7), 5.0)
                assert all(torch.equal(a, b) for a, b in zip(loaded, tensors, strict=True))
            for _ in range(50):  # (the last handler's cancel may still be on its way)
                if not serving.open_downloads:
                    break
                await asyncio.sleep(0.1)
            assert serving.open_downloads == 0, "the server's end still waits after the downloader closed"

            # a peer serving under hivemind's name only: asked there (its end stays open until the downloader
            # closed: plain hivemind's closes first, and a download from it can fail as the stream breaks). Asked by
            # a peer that never learned collabopt's name from it, as from a plain hivemind peer: libp2p opens a
            # stream under a name the peer's identify listed without asking the peer, and `client`'s list kept the
            # removed name until identify's push came (2 of 65 such downloads broke as the stream was refused)
            await StateServicer(serving._serve).remove_p2p_handlers(server, namespace="run")
            await server.add_protobuf_handler(
                "run::TrainingStateAverager.rpc_download_state",
                lambda request, context: serve_until_the_caller_closes(served(context.remote_id), 10.0),
                averaging_pb2.DownloadRequest, stream_output=True)
            downloading.p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                               initial_peers=[str(m) for m in await server.get_visible_maddrs()])
            try:
                _, loaded = await asyncio.wait_for(downloading._fetch(server.peer_id, 10**7), 5.0)
                assert all(torch.equal(a, b) for a, b in zip(loaded, tensors, strict=True))
            finally:
                await downloading.p2p.shutdown()
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(go())


def test_a_download_stream_is_counted_while_it_is_open_also_where_the_downloader_leaves_early():
    """A finished peer serving its final state stays while a download of its state is open
    (collabopt.engine.final_state), also while its end waits for the downloader to close."""
    service = StateService.__new__(StateService)
    service.open_downloads = 0
    seen = []

    async def messages(caller):
        for part in ("a", "b"):
            seen.append(service.open_downloads)
            yield part

    service._messages = messages

    async def download(parts):
        stream = service._serve("caller")
        received = [message async for message in stream] if parts is None else [await stream.__anext__()]
        await stream.aclose()  # (the downloader closed its stream)
        return received

    assert asyncio.run(download(None)) == ["a", "b"] and seen == [1, 1] and service.open_downloads == 0
    assert asyncio.run(download(1)) == ["a"] and service.open_downloads == 0

    async def lingering():  # (collabopt's counted download: open after its last message until the downloader closes)
        stream = service._serve("caller", 3600)
        received = [await stream.__anext__(), await stream.__anext__()]
        waits = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        counted = service.open_downloads
        waits.cancel()  # (the downloader closed: hivemind cancels the handler)
        with pytest.raises(asyncio.CancelledError):
            await waits
        return received, counted

    assert asyncio.run(lingering()) == (["a", "b"], 1) and service.open_downloads == 0


def test_a_renewal_of_the_same_state_declaration_may_wait_for_a_ride_and_a_change_leaves_at_once(monkeypatch):
    """Each declaration lives its period plus the wait; a renewal of the same value may wait RIDE_ALONG seconds to
    leave with another store of this peer (collabopt.engine.replicas), a new priority goes out at once."""
    from types import SimpleNamespace

    from collabopt.engine import state_service
    from collabopt.engine.replicas import RIDE_ALONG

    monkeypatch.setattr(state_service, "DECLARE_PERIOD", 0.02)
    stores = []
    averager = SimpleNamespace(allow_state_sharing=True, state_sharing_priority=1.0)

    def store(key, subkey, value, expiration_time, return_future, may_wait):
        stores.append((value, may_wait))
        future = asyncio.get_running_loop().create_future()
        future.set_result(True)
        return future

    async def go():
        service = SimpleNamespace(prefix="run_state_averager", p2p=SimpleNamespace(peer_id=SimpleNamespace(
            to_bytes=lambda: b"me")), averager=averager, records=SimpleNamespace(store=store),
            _sharing_changed=asyncio.Event())
        task = asyncio.ensure_future(state_service.StateService._declare_periodically(service))
        await asyncio.sleep(0.07)
        averager.state_sharing_priority = 2.0
        await asyncio.sleep(0.07)
        task.cancel()

    asyncio.run(go())
    ones = [wait for value, wait in stores if value == 1.0]
    twos = [wait for value, wait in stores if value == 2.0]
    assert ones[0] == 0.0 and set(ones[1:]) == {RIDE_ALONG} and len(ones) >= 2
    assert twos[0] == 0.0 and set(twos[1:]) <= {RIDE_ALONG}
