"""What a download installs (collabopt/engine/downloads.py, state.py, state_service.py): a state ``install_state``
refuses, or whose checks or install raise, is its source's failure and the next source is tried; malformed metadata is
no state; the state service decodes a download off its loop and caps the bytes one source sends; an install runs
closed for downloads, under the optimizer's lock. Swarm tests: tests/swarm/test_state_serving.py."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.optim.state_averager import dump_optimizer_state
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from collabopt import Terminated
from collabopt.engine import state_service
from collabopt.engine.downloads import StateDownloads
from collabopt.engine.state import ConsistentStateAverager
from collabopt.engine.state_service import StateService, received_limit, state_problem
from collabopt.errors import ModelMismatchError

SWARM = [torch.full((4, 3), 2.0), torch.full((3,), 2.0)]


def downloads_of(served: dict, priorities: dict, local_epoch: int = 0):
    """A download into a state averager at ``local_epoch`` whose sources send what ``served`` maps them to (a
    callable: called with the optimizer's metadata and tensors); ``asked``: the sources asked, in order."""
    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    avg = ConsistentStateAverager.__new__(ConsistentStateAverager)
    vars(avg).update(_parent_pid=-1, optimizer=optimizer, extra_tensors=(), lock_averaged_tensors=threading.Lock(),
                     lock_optimizer=threading.Lock(), _open_for_downloads=threading.Event(),
                     _closing_lock=threading.Lock(), _closings=0, _label_lock=threading.Lock(), _epoch=local_epoch,
                     _steps_owed=0, _step_with_increment=False, offload_optimizer=False, reuse_tensors=True,
                     scheduler=None, model_names=None, votes=None)
    avg._open_for_downloads.set()
    asked: list[str] = []

    def fetch(peer, timeout):
        asked.append(peer)
        return served[peer](*dump_optimizer_state(optimizer))

    service = SimpleNamespace(dht=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")), fetch=fetch,
                              announce_download=lambda: None, serving_peers=lambda: priorities)
    return SimpleNamespace(avg=avg, downloads=StateDownloads(service, avg), params=params, asked=asked)


def state(epoch, tensors=SWARM):
    return lambda metadata, stats: (dict(epoch=epoch, optimizer_metadata=metadata), [*tensors, *stats])


def untouched(params) -> bool:
    return all(torch.equal(p, torch.zeros_like(p)) for p in params)


def test_a_source_of_an_older_epoch_is_not_installed_and_the_next_source_is():
    peer = downloads_of({"old": state(2), "new": state(5)}, {"old": 9.0, "new": 5.0}, local_epoch=3)
    assert peer.downloads.download(timeout=1.0) is True and peer.asked == ["old", "new"]
    assert peer.avg.local_epoch == 5 and all(torch.equal(p, s) for p, s in zip(peer.params, SWARM, strict=True))
    peer = downloads_of({"old": state(2), "older": state(1)}, {"old": 9.0, "older": 5.0}, local_epoch=3)
    assert peer.downloads.download(timeout=1.0) is False  # nothing installed: the download did not succeed
    assert not peer.downloads.handed_on and not peer.downloads.installed_once
    assert peer.asked == ["old", "older"] and peer.avg.local_epoch == 3 and untouched(peer.params)


@pytest.mark.parametrize("malformed", [
    lambda metadata, stats: ([1, 2], [*SWARM, *stats]),  # metadata a list
    lambda metadata, stats: (7, [*SWARM, *stats]),  # an int
    lambda metadata, stats: (dict(epoch="9", optimizer_metadata=metadata), [*SWARM, *stats]),  # no int epoch
    lambda metadata, stats: (dict(epoch=9), [*SWARM, *stats]),  # no optimizer metadata
    lambda metadata, stats: (dict(epoch=9, optimizer_metadata=[dict(type="tensor", index=99)] * 4),
                             [*SWARM, *stats]),  # statistics that point past the tensors sent (install raises)
])
def test_a_malformed_state_is_its_sources_failure_and_the_next_source_is_installed(malformed, caplog):
    peer = downloads_of({"bad": malformed, "good": state(5)}, {"bad": 9.0, "good": 5.0})
    for _ in range(2):  # (the malformed source is tried first each time: it never blocks the download)
        peer.avg.local_epoch = 0
        assert peer.downloads.download(timeout=1.0) is True and peer.avg.local_epoch == 5
    assert peer.asked == ["bad", "good"] * 2 and "bad sent" in caplog.text
    assert all(torch.equal(p, s) for p, s in zip(peer.params, SWARM, strict=True))


@pytest.mark.parametrize("raised", [ModelMismatchError(0, None, "(3,)", "(4,)"), Terminated(), KeyboardInterrupt()])
def test_a_model_mismatch_and_interrupts_in_an_install_still_propagate(raised, monkeypatch):
    peer = downloads_of({"a": state(5), "b": state(5)}, {"a": 9.0, "b": 5.0})

    def install(metadata, tensors):
        raise raised

    monkeypatch.setattr(peer.avg, "install_state", install)
    with pytest.raises(type(raised)):
        peer.downloads.download(timeout=1.0)
    assert peer.asked == ["a"] and not peer.downloads.holding_state


def test_state_problem_names_what_is_wrong():
    assert state_problem(dict(epoch=3, optimizer_metadata=[dict(type="value", value=1)]), [torch.zeros(1)]) is None
    assert "a list, not a dict" in state_problem([], [])
    assert "epoch is True" in state_problem(dict(epoch=True, optimizer_metadata=[]), [])
    assert "epoch is -1" in state_problem(dict(epoch=-1, optimizer_metadata=[]), [])
    assert "optimizer metadata" in state_problem(dict(epoch=1, optimizer_metadata=[3]), [])
    assert "tensors" in state_problem(dict(epoch=1, optimizer_metadata=[]), [b"x"])


def messages(metadata, tensors):
    """The messages of a download as the state service (and hivemind) send them."""
    serialized = MSGPackSerializer.dumps(metadata)
    for tensor in tensors:
        for part in split_for_streaming(serialize_torch_tensor(tensor)):
            yield averaging_pb2.DownloadData(tensor_part=part, metadata=serialized or b"")
            serialized = None


def fetch_on_a_loop(monkeypatch, sent, limit):
    """StateService._fetch on a loop of its own, from a stand-in stub sending ``sent``; returns what it returned (or
    raised) and the threads that deserialized a tensor."""
    deserialized_in: list[threading.Thread] = []
    decode = state_service.deserialize_torch_tensor

    def recorded(serialized):
        deserialized_in.append(threading.current_thread())
        return decode(serialized)

    async def stream():
        for message in sent:
            yield message

    async def opening():
        return stream()

    monkeypatch.setattr(state_service, "deserialize_torch_tensor", recorded)
    monkeypatch.setattr(state_service.StateServicer, "get_stub", classmethod(lambda cls, p2p, peer, namespace: (
        SimpleNamespace(rpc_download_counted_state=lambda request: opening()))))
    service = StateService.__new__(StateService)
    vars(service).update(p2p=None, prefix="run", chunk_timeout=5.0)
    loop, threads = asyncio.new_event_loop(), []
    try:
        loop.call_soon(lambda: threads.append(threading.current_thread()))
        result = loop.run_until_complete(service._fetch("peer", limit))
    except Exception as e:
        result = e
    finally:
        loop.close()
    return result, deserialized_in, threads[0]


def test_a_download_is_decoded_off_the_services_loop(monkeypatch):
    metadata, tensors = dict(epoch=4, optimizer_metadata=[]), [torch.arange(6.0), torch.ones(2, 2)]
    result, deserialized_in, loop_thread = fetch_on_a_loop(monkeypatch, list(messages(metadata, tensors)), 1 << 20)
    assert result[0] == metadata and all(torch.equal(a, b) for a, b in zip(result[1], tensors, strict=True))
    assert len(deserialized_in) == 2 and loop_thread not in deserialized_in


def test_a_source_sending_more_than_the_limit_fails_and_malformed_metadata_is_no_state(monkeypatch, caplog):
    sent = list(messages(dict(epoch=4, optimizer_metadata=[]), [torch.zeros(10_000)]))
    result, deserialized_in, _ = fetch_on_a_loop(monkeypatch, sent, 20_000)
    assert isinstance(result, ValueError) and "over 20000 bytes" in str(result) and deserialized_in == []
    result, _, _ = fetch_on_a_loop(monkeypatch, list(messages([4], [torch.zeros(3)])), 1 << 20)
    assert result is None and "a list, not a dict" in caplog.text
    peer = downloads_of({}, {})
    own = sum(t.numel() * 4 for t in (*peer.params, *peer.params))  # parameters and their momentum
    assert received_limit(peer.avg) == int(state_service.RECEIVED_SHARE * own) + state_service.RECEIVED_MARGIN


def test_an_install_runs_closed_for_downloads_under_the_optimizers_lock_its_epoch_included(monkeypatch):
    peer = downloads_of({"a": state(5)}, {"a": 1.0})
    seen = []
    setter = ConsistentStateAverager.local_epoch.fset

    def set_epoch(self, value):
        seen.append((value, self._open_for_downloads.is_set(), self.lock_optimizer.locked()))
        setter(self, value)

    monkeypatch.setattr(ConsistentStateAverager, "local_epoch", ConsistentStateAverager.local_epoch.setter(set_epoch))
    with peer.avg.closed_for_downloads():  # (an install during an epoch's end: it stays closed after the install)
        assert peer.downloads.download(timeout=1.0) is True
        assert not peer.avg._open_for_downloads.is_set()
    assert peer.avg._open_for_downloads.is_set() and not peer.avg.lock_optimizer.locked()
    assert seen == [(5, False, True)]
