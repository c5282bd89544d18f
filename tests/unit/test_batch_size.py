"""Batch-size inference from batches and from the model's forward calls (no network)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from collabopt import ConfigurationError, ForwardSampleCounter, infer_batch_size


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    extra: dict


class Encoding(dict):  # like transformers' BatchEncoding: a mapping with .items()
    pass


@pytest.mark.parametrize(
    "batch, expected",
    [
        (torch.zeros(7, 3), 7),
        ((torch.zeros(5, 3), torch.zeros(5)), 5),
        ([torch.zeros(4, 2), [torch.zeros(4), {"m": torch.zeros(4, 9)}]], 4),
        ({"input_ids": torch.zeros(3, 11), "labels": torch.zeros(3, 11), "scale": torch.tensor(2.0)}, 3),
        (Batch(torch.zeros(6, 2), {"y": torch.zeros(6)}), 6),
        (Encoding(input_ids=torch.zeros(2, 5), attention_mask=torch.ones(2, 5)), 2),
        ((torch.zeros(9, 1), "some text", 42), 9),
    ],
)
def test_infer_batch_size(batch, expected):
    assert infer_batch_size(batch) == expected


def test_ambiguous_batch_is_refused_with_the_fix():
    with pytest.raises(ConfigurationError, match=r"different first dimensions \[4, 10\].*batch_size="):
        infer_batch_size((torch.zeros(4, 3), torch.zeros(10)))


def test_batch_without_tensors_is_refused():
    with pytest.raises(ConfigurationError, match="no tensor with a batch dimension"):
        infer_batch_size({"text": ["a", "b"], "scale": torch.tensor(1.0)})


def test_forward_counter_counts_training_forwards_only():
    model = torch.nn.Linear(3, 1)
    counter = ForwardSampleCounter(model)
    model(torch.zeros(5, 3))
    model(torch.zeros(2, 3))  # gradient accumulation: both calls count
    with torch.no_grad():
        model(torch.zeros(100, 3))  # evaluation under no_grad: not counted
    model.eval()
    model(torch.zeros(50, 3))  # eval mode: not counted
    model.train()
    assert counter.pop() == 7
    assert counter.pop() == 0
    counter.remove()
    model(torch.zeros(5, 3))
    assert counter.pop() == 0


def test_forward_counter_reads_keyword_inputs():
    class KwModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, *, inputs):
            return self.lin(inputs)

    model = KwModel()
    counter = ForwardSampleCounter(model)
    model(inputs=torch.zeros(4, 3))
    assert counter.pop() == 4
