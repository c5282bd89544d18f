"""The compressions users pass (``grad_compression``, ``state_averaging_compression``, DiLoCo's pseudo-gradients)
read their own bytes back in the installed environment: hivemind 1.1.12's 8-bit codecs stop doing so under numpy
2.4, and a round whose parts cannot be read fails on every member."""

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType


@pytest.mark.parametrize("kind", ["NONE", "FLOAT16", "MEANSTD_16BIT", "UNIFORM_8BIT", "QUANTILE_8BIT"])
def test_every_codec_reads_its_own_bytes(kind):
    tensor = torch.linspace(-3.0, 3.0, 4096)
    restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, getattr(CompressionType, kind)))
    assert restored.shape == tensor.shape
    assert (restored - tensor).abs().max().item() < 0.1
