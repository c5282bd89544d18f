"""The check of a downloaded state against this peer's model (collabopt.model_check), and its place in the
download: nothing of a state of other shapes is installed, and the error reaches the caller."""

from __future__ import annotations

import threading

import pytest
import torch
from hivemind.optim.state_averager import dump_optimizer_state

from collabopt.errors import CollaborativeError, ModelMismatchError
from collabopt.model_check import first_mismatch, parameter_names


def tensors(*specs):
    return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]


F32, F16 = torch.float32, torch.float16


def test_equal_shapes_and_dtypes_match_and_later_tensors_are_not_compared():
    local = tensors(((48, 32), F32), ((48,), F32))
    assert first_mismatch(local, [*tensors(((48, 32), F32), ((48,), F32)), torch.zeros(7)]) is None


def test_the_first_differing_shape_is_named_with_both_shapes_and_the_fix():
    local = tensors(((4,), F32), ((48, 32), F32), ((48,), F32))
    received = tensors(((4,), F32), ((64, 32), F32), ((64,), F32))
    error = first_mismatch(local, received, ["embed.bias", "fc.weight", "fc.bias"])
    assert isinstance(error, ModelMismatchError) and isinstance(error, CollaborativeError)
    assert (error.index, error.name) == (1, "fc.weight")
    assert (error.local, error.swarm) == ("(48, 32) torch.float32", "(64, 32) torch.float32")
    message = str(error)
    assert "parameter 1 (fc.weight) is (48, 32) torch.float32 here and (64, 32) torch.float32" in message
    assert "same model definition" in message and "another run_id" in message


def test_a_differing_dtype_is_a_mismatch():
    error = first_mismatch(tensors(((3, 3), F16)), tensors(((3, 3), F32)))
    assert error is not None and (error.index, error.name) == (0, None)
    assert (error.local, error.swarm) == ("(3, 3) torch.float16", "(3, 3) torch.float32")
    assert "parameter 0 is (3, 3) torch.float16 here" in str(error)


def test_a_state_with_fewer_tensors_differs_at_its_end():
    error = first_mismatch(tensors(((2,), F32), ((2,), F32)), tensors(((2,), F32)), ["a", "b"])
    assert error is not None and (error.index, error.name, error.swarm) == (1, "b", "none")


def test_names_come_from_the_model_by_identity():
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
    params = list(model.parameters())
    assert parameter_names(params, model) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert parameter_names([torch.zeros(1)], model) == [""]
    assert parameter_names(params, None) is None


def averager_of(model, served, names=None, seen=None):
    """A download (StateDownloads) into a state averager over ``model``'s parameters, whose source "a" sends
    ``served`` (and SGD's empty statistics) at epoch 3; ``seen`` collects, at each download, whether the peer held
    its state back meanwhile (what the state service asks before it serves)."""
    from types import SimpleNamespace

    from collabopt.engine.downloads import StateDownloads
    from collabopt.engine.state import ConsistentStateAverager

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_metadata, opt_tensors = dump_optimizer_state(optimizer)
    avg = ConsistentStateAverager.__new__(ConsistentStateAverager)
    vars(avg).update(_parent_pid=-1, optimizer=optimizer, extra_tensors=(), lock_averaged_tensors=threading.Lock(),
                     lock_optimizer=threading.Lock(), _open_for_downloads=threading.Event(),
                     _closing_lock=threading.Lock(), _closings=0,
                     _label_lock=threading.Lock(), _epoch=0, _steps_owed=0, _step_with_increment=False,
                     offload_optimizer=False, reuse_tensors=True, scheduler=None, model_names=names, votes=None)

    def fetch(peer, timeout):
        if seen is not None:
            seen.append(service.declines())
        return dict(epoch=3, optimizer_metadata=opt_metadata), [t.clone() for t in served] + opt_tensors

    service = SimpleNamespace(dht=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")), fetch=fetch,
                              announce_download=lambda: None, serving_peers=lambda: {"a": 3.0, "b": 3.0})
    return avg, StateDownloads(service, avg)


def test_a_download_of_other_shapes_raises_before_anything_is_installed():
    mine, swarm = torch.nn.Linear(32, 48), torch.nn.Linear(32, 64)
    before = [p.detach().clone() for p in mine.parameters()]
    avg, downloads = averager_of(mine, [p.detach() for p in swarm.parameters()],
                                 parameter_names(mine.parameters(), mine))
    with pytest.raises(ModelMismatchError, match=r"parameter 0 \(weight\) is \(48, 32\) torch.float32 here and "
                                                 r"\(64, 32\) torch.float32 in the swarm's state"):
        downloads.download()
    assert all(torch.equal(a, b) for a, b in zip(before, mine.parameters(), strict=True))
    assert avg.local_epoch == 0 and not downloads.handed_on and not downloads.installed_once
    assert not downloads.holding_state


def test_a_download_of_the_same_shapes_is_installed_and_only_the_first_holds_this_peers_state():
    mine, swarm = torch.nn.Linear(32, 48), torch.nn.Linear(32, 48)
    seen: list[bool] = []
    avg, downloads = averager_of(mine, [p.detach() for p in swarm.parameters()], seen=seen)
    downloads.download()
    assert avg.local_epoch == 3 and downloads.handed_on and downloads.installed_once
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), swarm.parameters(), strict=True))
    downloads.download()
    assert seen == [True, False] and not downloads.holding_state  # (held while its model was not yet checked)


def test_a_verified_download_raises_when_the_majoritys_state_has_other_shapes(monkeypatch):
    from types import SimpleNamespace

    from collabopt.engine.download_votes import Vote
    from collabopt.lineage import fingerprint

    mine, swarm = torch.nn.Linear(32, 48), torch.nn.Linear(32, 64)
    served = [p.detach() for p in swarm.parameters()]
    avg, downloads = averager_of(mine, served)
    ballot = [Vote(peer, 3, fingerprint(served)) for peer in ("a", "b")]
    avg.votes = SimpleNamespace(read=lambda: ballot)
    monkeypatch.setattr("collabopt.engine.download_votes.canonical", lambda peer: True)
    with pytest.raises(ModelMismatchError, match=r"\(48, 32\) torch.float32 here and \(64, 32\) torch.float32 in "
                                                 r"the state of [ab], which most of the swarm holds"):
        downloads.download()
    assert avg.local_epoch == 0 and not downloads.installed_once
