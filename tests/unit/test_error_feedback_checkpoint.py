"""Checkpoints of a compressed-DiLoCo peer (collabopt.checkpoint): ``state_dict()`` holds this peer's error-feedback
buffer (the committed one, not a round's staged update) and ``load_state_dict()`` restores it exactly; a buffer that
does not fit the model is refused with an error naming the parameter, changing nothing; a checkpoint without one
restores zeros and says so; the dense mode neither saves nor needs one."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import pytest
import torch
from fakes import FakePeer

from collabopt import CollaborativeOptimizer, ConfigurationError
from collabopt.diloco_options import SparseLoCo
from collabopt.error_feedback import ErrorFeedback

OUTER = functools.partial(torch.optim.SGD, lr=1.0)
SPARSE = SparseLoCo(density=0.05, chunk_size=16, bits=2, error_decay=0.9)
NAMES = ["weight", "bias"]


def core(compressed: bool = True) -> tuple[CollaborativeOptimizer, ErrorFeedback | None]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    peer = FakePeer(inner, target_batch_size=10**9)
    shapes = [tuple(p.shape) for p in model.parameters()]
    feedback = SPARSE.error_feedback(shapes) if compressed else None
    averager = SimpleNamespace(error_feedback=feedback) if compressed else SimpleNamespace()
    peer.loop = SimpleNamespace(grad_averager=averager, state_averager=SimpleNamespace(model_names=NAMES))
    copt = CollaborativeOptimizer(inner, outer_optimizer=OUTER, peer=peer, handle_signals=False,
                                  run_id="unit_ef_checkpoint", target_batch_size=64)
    return copt, feedback


def send_a_round(feedback: ErrorFeedback, seed: int, commit: bool = True) -> None:
    generator = torch.Generator().manual_seed(seed)
    feedback.compress([torch.randn(shape, generator=generator) for shape in feedback.shapes])
    if commit:
        feedback.commit()


def copies(tensors):
    return [t.clone() for t in tensors]


def test_a_checkpoint_holds_the_committed_buffer_and_restores_it_exactly():
    copt, feedback = core()
    send_a_round(feedback, 1)
    committed = copies(feedback.buffers)
    assert float(sum(b.abs().sum() for b in committed)) > 0
    send_a_round(feedback, 2, commit=False)  # a round in flight: its update is not saved
    state = copt.state_dict()
    saved = state["error_feedback"]["buffers"]
    assert all(torch.equal(s, c) for s, c in zip(saved, committed, strict=True))
    feedback.discard()
    send_a_round(feedback, 3)  # the buffer moves on after the checkpoint
    assert not all(torch.equal(b, c) for b, c in zip(feedback.buffers, committed, strict=True))
    copt.load_state_dict(state)
    assert all(torch.equal(b, c) for b, c in zip(feedback.buffers, committed, strict=True))
    assert not feedback.staged
    copt.close()


def test_a_held_update_is_not_saved_and_loading_drops_it():
    """A round whose payload went out while this peer did not apply it: its update waits for a download's news
    (ErrorFeedback.hold); the checkpoint holds the committed buffer, and loading it leaves nothing held."""
    copt, feedback = core()
    send_a_round(feedback, 1)
    committed = copies(feedback.buffers)
    send_a_round(feedback, 2, commit=False)
    feedback.hold()
    state = copt.state_dict()
    assert all(torch.equal(s, c) for s, c in zip(state["error_feedback"]["buffers"], committed, strict=True))
    copt.load_state_dict(state)
    assert not feedback.held and not feedback.staged
    assert all(torch.equal(b, c) for b, c in zip(feedback.buffers, committed, strict=True))
    copt.close()


def test_a_checkpoint_without_a_buffer_restores_zeros_and_says_so(caplog):
    copt, feedback = core()
    send_a_round(feedback, 1)
    state = copt.state_dict()
    del state["error_feedback"]  # (as a dense-mode checkpoint)
    with caplog.at_level(logging.WARNING, logger="collabopt"):
        copt.load_state_dict(state)
    assert all(float(b.abs().sum()) == 0 for b in feedback.buffers)
    assert "no error-feedback buffer" in caplog.text and "zeros" in caplog.text
    copt.close()


@pytest.mark.parametrize("bad, match", [
    (lambda bs: [bs[0], torch.zeros(5)], r"parameter 1 \(bias\).*\(5,\).*\(4,\)"),
    (lambda bs: [bs[0].double(), bs[1]], r"parameter 0 \(weight\).*float64"),
    (lambda bs: [bs[0]], "1 tensors, this model has 2"),
    (lambda bs: [bs[0], torch.full_like(bs[1], float("nan"))], r"parameter 1 \(bias\) holds NaN"),
])
def test_a_buffer_that_does_not_fit_is_refused_naming_the_parameter_and_changes_nothing(bad, match):
    copt, feedback = core()
    send_a_round(feedback, 1)
    state = copt.state_dict()
    state["error_feedback"] = dict(state["error_feedback"], buffers=bad(state["error_feedback"]["buffers"]))
    send_a_round(feedback, 2)
    before = copies(feedback.buffers)
    with pytest.raises(ConfigurationError, match=match) as error:
        copt.load_state_dict(state)
    assert error.value.parameter == "state" and "error_feedback" in error.value.fix
    assert all(torch.equal(b, c) for b, c in zip(feedback.buffers, before, strict=True))
    copt.close()


def test_the_dense_mode_saves_no_buffer_and_loads_a_compressed_checkpoint(caplog):
    compressed, feedback = core()
    send_a_round(feedback, 1)
    state = compressed.state_dict()
    compressed.close()
    dense, _ = core(compressed=False)
    assert "error_feedback" not in dense.state_dict()
    with caplog.at_level(logging.INFO, logger="collabopt"):
        dense.load_state_dict(state)
    assert "not used" in caplog.text
    dense.close()
